"""``hybridflow train`` on the quickstart with routing replay R2 (the CPU engine returns no routes,
so R3 cannot run here): every training forward replays the old-log-prob forward's experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import ROOT, SHORT

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def test_quickstart_with_r2_replays_every_route(tmp_path: Path) -> None:
    out = tmp_path / "r2"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", "configs/quickstart_cpu.yaml", f"run.output_dir={out}",
           *SHORT, "moe.routing_replay=r2"]
    result = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "routing replay r2" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step_ppo_kl"] == 0.0  # replayed routes of unchanged weights: exact
    moe = summary["moe"]
    assert moe["routing_replay"] == "r2"
    assert moe["metrics"]["moe/train/replay_match"]["mean"] == 1.0
    history = json.loads((out / "checkpoints" / "step_000004" / "state.json").read_text())["history"]
    assert all(h["moe/train/replay_match"] == 1.0 for h in history)
    assert all(h[f"moe/train/layer{layer}/replay_match"] == 1.0 for h in history for layer in (0, 1))
    # every MoE layer routed the same tokens, k = 2 each
    totals = {sum(layer) for layer in moe["tokens_per_expert_last_step"]}
    assert len(totals) == 1 and totals.pop() % 2 == 0
