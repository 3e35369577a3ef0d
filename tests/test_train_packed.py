"""``hybridflow train configs/quickstart_cpu_packed.yaml``, kept short like ``test_train``: packed
rows and token-budget micro-batches through SFT, old / new log-probs and the GRPO update, with
routing replay (r2: the routes the actor records in its packed old-log-prob pass are replayed in
its packed update), and the DP ranks' prompts chosen by tokens. The trainer's packed log-probs
must match the engine's, token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import LOGPROB_TOL, ROOT, SHORT, WARM_UP, _history, _ok

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]


@pytest.mark.claim("token-budget-balance")
@pytest.mark.features("packing", "token_budget")
def test_packed_quickstart_trains_and_scores_as_the_engine(tmp_path: Path) -> None:
    out = tmp_path / "packed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu_packed.yaml",
        f"run.output_dir={out}",
        *SHORT,
        "moe.routing_replay=r2",
    ]
    _ok(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["first_step_logprob_diff_max"] < LOGPROB_TOL
    # old and new log-probs agree to rounding: the update's packed rows hold other samples beside
    # each one than the old-log-prob pass's rows (8.9e-8 seen; exactly 0 unpacked)
    assert abs(summary["first_step_ppo_kl"]) < 1e-6
    for key in ("heldout_reward_after_sft", "heldout_reward_after_rl"):
        assert summary[key] is not None, key
    history = _history(out, "step_000004")
    assert all(h["rollout/logprob_diff_max"] < LOGPROB_TOL for h in history), history
    assert all(h["actor/updated"] == 1.0 for h in history), history
    # the DP ranks' prompts were chosen by tokens (shares.balanced_owners; its unit test shows
    # the balance); every rank agreed on them, or the samples above would not have arrived
    assert all(1.0 <= h["rollout/dp_tokens_max_over_mean"] < 1.25 for h in history), history
    assert any(h["actor/grad_norm"] > 0 for h in history), history  # a step of equal rewards has none
    assert all(h["moe/train/replay_match"] == 1.0 for h in history if "moe/train/replay_match" in h), history


@pytest.mark.slow  # a learning run (the learning matrix's length) of a path the run above covers
@pytest.mark.claim("packed-quickstart-learns")
def test_the_packed_quickstart_learns(tmp_path: Path, seeded) -> None:
    out = seeded(tmp_path / "packed_learns")
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu_packed.yaml",
        f"run.output_dir={out}",
        WARM_UP,
        "run.steps=10",
        "run.heldout_every=10",
        "run.checkpoint_every=10",
    ]
    _ok(
        subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1100
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
