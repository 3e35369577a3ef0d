#!/usr/bin/env bash
# GPU checks (not part of CI): the rollout and megatron tests on a CUDA machine.
#
#   bash scripts/gpu_check.sh            # uses .venv (run scripts/install.sh --gpu first)
#
# On a GPU the same tests run the CUDA SGLang engine (the CPU environment and the sgl_kernel
# stand-in are applied only without a GPU), where routed experts and memory release are live,
# and the reshard executor test runs beside it. Expert parallelism in SGLang (ep > 1) is not
# yet covered by a test: the CPU engine cannot run it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no working CUDA driver here ('nvidia-smi -L' fails); nothing to check" >&2
  exit 2
fi
nvidia-smi -L
export PYTHONUNBUFFERED=1
.venv/bin/python -m pytest -q -x tests/rollout tests/reshard/test_executor.py "$@"
