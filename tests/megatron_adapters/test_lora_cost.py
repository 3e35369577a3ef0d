"""``benchmarks/lora_cost.py`` on the quickstart model: the keys ``benchmarks/efficiency.py`` reads,
and what LoRA must save (in a child process: it starts torch.distributed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("full_ft_trainer_bytes", "lora_trainer_bytes", "merged_push_bytes", "adapter_push_bytes")


@pytest.mark.claim("lora-cost-benchmark")
def test_lora_cost_reports_less_memory_and_fewer_push_bytes(tmp_path: Path) -> None:
    out = tmp_path / "lora_cost.json"
    cmd = [sys.executable, "benchmarks/lora_cost.py", "--models", "quickstart", "--json", str(out)]
    result = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=250
    )
    assert result.returncode == 0, result.stderr[-4000:]
    row = json.loads(out.read_text())["quickstart"]
    assert all(row[k] > 0 for k in KEYS)
    assert row["lora_trainer_bytes"] < row["full_ft_trainer_bytes"]
    assert row["adapter_push_bytes"] < row["merged_changed_push_bytes"] <= row["merged_push_bytes"]
    # the base is frozen: no gradient or optimizer byte for it
    assert row["lora_breakdown"]["grads"] < row["full_ft_breakdown"]["grads"] / 2
