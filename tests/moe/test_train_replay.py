"""``hybridflow train`` on the quickstart with routing replay R2 (the CPU engine returns no routes,
so R3 cannot run here): every training forward replays the old-log-prob forward's experts.

The run is ``full_run`` (``tests/conftest.py``): the short deterministic quickstart runs with R2 on,
so the runs that must reproduce it (a stop, a kill, a damaged checkpoint, killed engines and ranks)
replay routes too. The packed run (tests/test_train_packed.py) replays them through packed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.mark.claim("routing-replay", "router-statistics")
def test_quickstart_with_r2_replays_every_route(full_run: Path) -> None:
    assert "routing replay r2" in (full_run.parent / "stdout.txt").read_text()  # the summary screen
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["first_step_ppo_kl"] == 0.0  # replayed routes of unchanged weights: exact
    moe = summary["moe"]
    assert moe["routing_replay"] == "r2"
    assert moe["metrics"]["moe/train/replay_match"]["mean"] == 1.0
    history = json.loads((full_run / "checkpoints" / "step_000004" / "state.json").read_text())["history"]
    assert all(h["moe/train/replay_match"] == 1.0 for h in history)
    assert all(h[f"moe/train/layer{layer}/replay_match"] == 1.0 for h in history for layer in (0, 1))
    # every MoE layer routed the same tokens, k = 2 each
    totals = {sum(layer) for layer in moe["tokens_per_expert_last_step"]}
    assert len(totals) == 1 and totals.pop() % 2 == 0
