#!/usr/bin/env bash
# The GPU proof (not part of CI), one command on any CUDA machine:
#
#   bash scripts/install.sh --gpu && bash scripts/gpu_check.sh        # from the project's venv
#   bash scripts/gpu_check.sh                                         # a bare CUDA machine, wheels/ carried
#
# 1. scripts/gpu_check.py at world size 1 (NCCL): every family's log-probs against transformers on
#    the same GPU (fp32, bf16), a ~1.6B-parameter MoE's train steps through MegatronPolicy vs a plain
#    megatron-core loop (tokens/s, MFU), dist-checkpoint save/load, CUDA-IPC handles opened by a
#    second process, and `hybridflow train configs/quickstart_gpu.yaml` for a few RL steps.
#    JSON: $OUT/gpu_check.json (OUT defaults to runs/gpu_check).
# 2. Where SGLang and pytest are installed (the venv), the rollout tests on SGLang's CUDA engine
#    (tests/rollout, the executor tests); cases that need two GPUs are deselected on one.
# 3. Where vLLM's CUDA build has an environment of its own (bash scripts/install.sh --vllm, or
#    HYBRIDFLOW_VLLM_VENV; its wheel is too big to carry to a bare machine), vLLM's cases: the
#    adapter's tests and the sliced push against vLLM's loader at every tp the GPUs allow.
#
# Python: $PYTHON, else .venv/bin/python, else python3. Packages that python lacks are taken from
# wheels/ (made by scripts/gpu_wheels.sh: megatron-core, omegaconf for CPython 3.12), unpacked
# outside the tree and put on PYTHONPATH; nothing is downloaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no working CUDA driver here ('nvidia-smi -L' fails); run it on a GPU machine" >&2
  exit 2
fi
nvidia-smi -L
py=${PYTHON:-}
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c 'import megatron.core, omegaconf' >/dev/null 2>&1; then
  shopt -s nullglob
  wheels=(wheels/*.whl)
  if ((${#wheels[@]} == 0)); then
    echo "gpu_check: $py lacks megatron-core or omegaconf and wheels/ is empty; run bash scripts/install.sh --gpu, or bash scripts/gpu_wheels.sh and carry wheels/" >&2
    exit 2
  fi
  site=${TMPDIR:-/tmp}/hybridflow_gpu_site
  rm -rf "$site" && mkdir -p "$site"
  for wheel in "${wheels[@]}"; do "$py" -m zipfile -e "$wheel" "$site"; done
  export PYTHONPATH="$PYTHONPATH:$site"
  echo "gpu_check: using ${wheels[*]} from $site" >&2
fi
"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"'
status=0
"$py" scripts/gpu_check.py --json "$out/gpu_check.json" "$@" || status=$?
if "$py" -c 'import sglang, pytest' >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU ')
  select=()
  if ((gpus < 2)); then
    echo "gpu_check: $gpus GPU: the tp=2 engines, ep=2 and the megatron actor push need two; deselected" >&2
    select=(-k "not tp2 and not expert_parallel" --deselect tests/rollout/sglang/test_actor_push.py)
  fi
  "$py" -m pytest -q -rs tests/rollout tests/reshard/test_executor.py "${select[@]}" --junitxml "$out/junit.xml" \
    2>&1 | tee "$out/pytest.log" || status=1
else
  echo "gpu_check: no SGLang or pytest for $py: the SGLang CUDA engine tests did not run" >&2
fi
if "$py" -c 'import pytest; from hybridflow.rollout.vllm import env; assert env.version()' >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU ')
  wide=()
  ((gpus >= 2)) || wide+=(-k "not tp2 and not tp4")
  ((gpus < 2 || gpus >= 4)) || wide+=(-k "not tp4")
  HYBRIDFLOW_REQUIRE_VLLM=1 "$py" -m pytest -q -rs -m "" tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_loader.py \
    "${wide[@]}" --junitxml "$out/junit_vllm.xml" 2>&1 | tee "$out/pytest_vllm.log" || status=1
else
  echo "gpu_check: no vLLM environment for $py (bash scripts/install.sh --vllm): the vLLM cases did not run" >&2
fi
exit "$status"
