#!/usr/bin/env bash
# GPU checks (not part of CI): the rollout tests with SGLang's CUDA engine.
#
#   bash scripts/install.sh --gpu && bash scripts/gpu_check.sh [extra pytest args]
#
# On a GPU the rollout tests start SGLang's CUDA engine (the CPU environment and the sgl_kernel
# stand-in apply only without one), and tests/rollout/sglang/test_engine_gpu.py runs what only
# a GPU shows: routed experts against transformers' router, release / resume of GPU memory, and
# expert parallelism (tp=2, ep=2). Cases that need two GPUs (every tp=2 engine, the megatron
# actor push) are deselected on a one-GPU machine and said so. The pytest log and a JUnit XML
# report go to ${GPU_CHECK_OUT:-runs/gpu_check}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no working CUDA driver here ('nvidia-smi -L' fails); nothing to check" >&2
  exit 2
fi
nvidia-smi -L
gpus=$(nvidia-smi -L | grep -c '^GPU ')
out=${GPU_CHECK_OUT:-runs/gpu_check}
mkdir -p "$out"
tests=(tests/rollout tests/reshard/test_executor.py)
select=()
if ((gpus < 2)); then
  echo "gpu_check: $gpus GPU: the tp=2 engines, ep=2 and the megatron actor push need two; deselected" >&2
  select=(-k "not tp2 and not expert_parallel" --deselect tests/rollout/sglang/test_actor_push.py)
fi
export PYTHONUNBUFFERED=1
.venv/bin/python -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"'
.venv/bin/python -m pytest -q -rs "${tests[@]}" "${select[@]}" --junitxml "$out/junit.xml" "$@" 2>&1 \
  | tee "$out/pytest.log"
