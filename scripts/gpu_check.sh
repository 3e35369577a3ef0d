#!/usr/bin/env bash
# GPU checks (not part of CI): the rollout and megatron tests on a CUDA machine.
#
#   bash scripts/gpu_check.sh            # uses .venv (run scripts/install.sh --gpu first)
#
# On a GPU the same tests run the CUDA SGLang engine (no CPU stand-ins are installed there),
# with expert parallelism (HYBRIDFLOW_TEST_ROLLOUT_EP=2) where the CPU engine cannot, and the
# megatron-core tests use NCCL and TransformerEngine when it is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no working CUDA driver here ('nvidia-smi -L' fails); nothing to check" >&2
  exit 2
fi
nvidia-smi -L
export HYBRIDFLOW_TEST_ROLLOUT_DEVICE=cuda HYBRIDFLOW_TEST_ROLLOUT_EP=2 PYTHONUNBUFFERED=1
.venv/bin/python -m pytest -q -x tests/rollout tests/reshard/test_executor.py "$@"
