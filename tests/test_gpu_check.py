"""scripts/gpu_check.py runs every check on this CPU with --small (the GPU run is then only a
rerun on other hardware); the shell wrapper refuses a machine without a CUDA driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.claim("gpu-check-small-on-cpu")
@pytest.mark.distributed
@pytest.mark.slow  # run before every use of a lent GPU; each check's path is a default-tier test of its own
def test_every_gpu_check_runs_small_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--small", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    report = json.loads(out.read_text())
    failed = {k: v.get("error") for k, v in report["checks"].items() if not v["ok"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    checks = report["checks"]
    assert set(checks) == {"families", "throughput", "checkpoint", "frozen", "ipc", "train", "efficiency", "fsdp2"}
    cases = checks["families"]["cases"]
    assert {c["family"] for c in cases} == {"llama", "qwen2", "qwen3_moe", "mixtral", "deepseek_v3"}
    assert all(c["max_abs_diff"] < 1e-4 for c in cases if c["dtype"] == "float32")  # exact on the CPU
    assert all(c["direct_load_max_abs_diff"] < 1e-4 for c in cases if c["dtype"] == "float32")  # model.path's loader
    assert checks["checkpoint"]["max_abs_diff_after_load"] == 0.0
    frozen = checks["frozen"]  # a reward model on groups of its own, then offloaded between uses
    assert frozen["max_abs_diff"] < 1e-4 and frozen["offloaded_equals_resident"]
    assert frozen["params_on_host_between_uses"] and frozen["params_on_device_in_use"]
    assert checks["ipc"]["child_checksum"] == checks["ipc"]["checksum"]
    assert checks["ipc"]["handle_bytes"] > checks["ipc"]["tensor_bytes"]  # on a CPU the data itself
    assert checks["throughput"]["policy_step_seconds"] > 0 and checks["throughput"]["plain_step_seconds"] > 0
    assert checks["train"]["summary"]["heldout_reward_after_rl"] is not None
    efficiency = checks["efficiency"]  # the packing and LoRA tests' one-rank cases, as a GPU runs them
    assert efficiency["packing_worst"] < 1e-5 and efficiency["packing_moved"] > 1e-3
    assert efficiency["lora_base_identical"] and efficiency["lora_merge_error"] <= 1e-6
    fsdp2 = checks["fsdp2"]  # the FSDP2 trainer at one rank: parity, checkpoint, a short run
    assert fsdp2["logprob_max_abs_diff_vs_transformers"] < 1e-4 and fsdp2["reload_max_abs_diff"] == 0.0
    assert fsdp2["train_first_step_logprob_diff_max"] < 1e-4


@pytest.mark.claim("gpu-check-small-on-cpu")
def test_gpu_check_sh_refuses_a_machine_without_cuda():
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check: no working CUDA driver here")
