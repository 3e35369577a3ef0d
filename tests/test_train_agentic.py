"""``hybridflow train`` with multi-turn rollouts (``agentic.enabled``) on the CPU: trajectories
of two policy turns with an observation between them, trained on the policy's tokens only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.mark.claim("agentic-train-runs")
def test_a_multi_turn_run_trains_on_the_policys_tokens_and_reports_its_turns(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.cli",
            "train",
            "configs/quickstart_cpu.yaml",
            f"run.output_dir={out}",
            "rollout.engine=hf",
            "rollout.tp=1",
            "rollout.sync_route=full",
            "sft.steps=200",
            "run.steps=2",
            "run.heldout_prompts=8",
            "agentic.enabled=true",
            "agentic.tools=[calculator]",
            "agentic.environment=tests.agentic.envs:AskAgain",
            "agentic.max_turns=2",
            "agentic.turn_tokens=8",
            "data.max_response_length=48",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    history = json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())["history"]
    for step in history:
        assert step["agentic/turns_mean"] == 2.0  # every trajectory: a turn, the question, a turn
        assert 0 < step["agentic/observation_token_share"] < 1
        assert step["agentic/tool_calls_per_trajectory"] == 0.0  # AskAgain asks; no tool ran
        # the engine's log-probs against the trainer's, on the policy's tokens only (the loss mask)
        assert step["rollout/logprob_diff_max"] < 1e-3, step["rollout/logprob_diff_max"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] is not None
    assert summary["agentic"]["turns_mean"] == 2.0 and summary["agentic"]["tool_errors"] == 0
    assert "multi-turn   2.000 turns and 0.000 tool calls per trajectory" in done.stdout


@pytest.mark.slow
@pytest.mark.claim("agentic-learns-the-tool")
def test_rl_with_the_calculator_beats_the_warm_up_on_a_task_only_the_tool_solves(tmp_path: Path) -> None:
    """configs/agentic_cpu.yaml as the docs run it: two-digit products the tiny model cannot
    compute; SFT imitates demonstrations that call the calculator 40% of the time and guess
    otherwise; RL on the verifier's reward must make it call the tool and beat the warm-up on
    held-out prompts (greedy)."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", "configs/agentic_cpu.yaml", f"run.output_dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"] + 0.2, summary
    history = json.loads((out / "checkpoints" / "step_000020" / "state.json").read_text())["history"]
    calls = [h["agentic/tool_calls_per_trajectory"] for h in history]
    assert sum(calls[-5:]) / 5 > calls[0] + 0.2, calls  # it learnt to reach for the tool
    assert summary["agentic"]["tool_timeouts"] == 0, summary["agentic"]
