"""benchmarks/reshard_exec.py at its small scale: four processes over gloo, every method exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "reshard_exec.py"
REQUIRED = {
    "name",
    "bytes",
    "executor_seconds",
    "baseline_seconds",
    "megatron_resharding_seconds",
    "memcpy_seconds",
    "checksums_ok",
    "executor_gbps",
    "baseline_gbps",
    "speedup_vs_baseline",
    "fraction_of_memcpy",
}


@pytest.mark.claim("reshard-exec-benchmark")
@pytest.mark.distributed
@pytest.mark.slow  # a benchmark's run at a small size: the executor's exactness is tests/reshard/test_executor.py's
@pytest.mark.timeout(120)
def test_small_run_writes_exact_cases(tmp_path) -> None:
    out = tmp_path / "exec.json"
    cmd = [sys.executable, str(BENCHMARK), "--small", "--repeats", "1", "--json", str(out)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    cases = json.loads(out.read_text())["cases"]
    assert json.loads(result.stdout) == {"cases": cases}  # stdout carries only the JSON
    names = {c["name"] for c in cases}
    assert names >= {"sglang_tp2_on_0_1", "sglang_tp2_ep2_on_2_3", "megatron_tp1_ep4"}
    for case in cases:
        assert REQUIRED <= set(case), REQUIRED - set(case)
        assert case["checksums_ok"] and case["bytes"] > 0
        assert case["executor_seconds"] > 0 and case["baseline_seconds"] > 0
        # the baseline sends every engine process whole tensors: more than the boxes it needs
        assert case["baseline_broadcast_bytes"] > case["executor_bytes_sent"]
        megatron = case["name"].startswith("megatron")
        assert (case["megatron_resharding_seconds"] is not None) == megatron
        assert case["megatron_resharding_note"]
    assert [p.name for p in tmp_path.iterdir()] == ["exec.json"]  # the tmp file was renamed
