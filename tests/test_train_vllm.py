"""``hybridflow train configs/quickstart_cpu_vllm.yaml``: vLLM generates, in an environment of its own.

The quickstart's task and recipe with ``rollout.engine=vllm`` (vLLM's CPU build under
``.venv-vllm``, full pushes through shared memory after every step), each run from a short SFT
warm-up: two colocated replicas (default tier); separate placement with asynchronous RL (K=1,
slow tier: the same runtime path as SGLang's separate async runs). Each must learn as the SGLang
quickstart does, its engine's log-probs at step 0 the trainer's. In the slow tier too: the
multi-turn calculator (``configs/agentic_cpu.yaml``) on vLLM, whose trajectories the trainer must
score token for token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.rollout.vllm import env
from tests.injection import environment
from tests.test_train import WARM_UP, _history, _ok

pytestmark = [pytest.mark.distributed, pytest.mark.vllm, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
CONFIG = "configs/quickstart_cpu_vllm.yaml"
KILL = "1@3"
"""Replica 1's server is killed before generate call 3 (step 2's; call 1 scored the held-out set):
the run must restart it, push it the weights and repeat the step."""
RUNS = {
    "replicas": ["rollout.num_replicas=2"],
    "separate_async": [
        "rollout.placement=separate",
        "async_rl.mode=async",
        "async_rl.max_staleness=1",
        "algorithm.rollout_correction=tis",
    ],
}


def _train(config: str, out: Path, *overrides: str, env: dict | None = None) -> Path:
    command = [sys.executable, "-m", "hybridflow.cli", "train", config, f"run.output_dir={out}", *overrides]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})}
    )
    _ok(result)
    assert "vllm tp=" in result.stdout  # the start line names the engine that runs
    (out / "stderr.txt").write_text(result.stderr)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each run from its own short SFT warm-up (one run in the default tier: no warm-up to share)."""
    if env.version() is None:
        pytest.skip(f"vLLM is not installed ({env.INSTALL_COMMAND})")
    root, settings = tmp_path_factory.mktemp("vllm"), (WARM_UP, f"run.steps={STEPS}", f"run.heldout_every={STEPS}")

    class Runs(dict):
        def __missing__(self, name: str) -> Path:
            faults = environment(KILL_ENGINE=KILL) if name == "replicas" else None
            self[name] = _train(CONFIG, root / name, *settings, "run.tracking.trackers=[]", *RUNS[name], env=faults)
            return self[name]

    return Runs()


@pytest.mark.claim("vllm-engine")
@pytest.mark.parametrize("name", [pytest.param("separate_async", marks=pytest.mark.slow), "replicas"])
def test_vllm_runs_learn_with_the_trainers_logprobs_at_step_0(runs, name: str) -> None:
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] <= 1e-4, summary
    after_sft, after_rl = summary["heldout_reward_after_sft"], summary["heldout_reward_after_rl"]
    assert after_rl >= after_sft + 0.3, (after_sft, after_rl)
    history = _history(runs[name], f"step_{STEPS:06d}")
    assert all(h["checks/failed"] == 0.0 for h in history)
    replicas = 2 if name == "replicas" else 1
    for k in range(replicas):  # every replica took its (tp=1: whole) share, sliced, after every step
        assert all(h[f"sync/replica{k}/engine_bytes"] == history[0]["sync/plan_bytes"] / replicas for h in history)
    if name == "separate_async":
        assert summary["async_rl"]["staleness_max"] == 1


@pytest.mark.claim("vllm-adapter")
def test_a_killed_vllm_server_is_restarted_and_named_by_its_log(runs) -> None:
    """The replicas run's replica 1 lost its server at step 2 (``KILL``): restarted once, the cause
    naming the process and the last lines of its log, and the run learned all the same (above)."""
    out = runs["replicas"]
    assert json.loads((out / "summary.json").read_text())["engine_restarts"] == 1
    lines = re.findall(r"rollout replica 1 lost its engine \((.*)\): restarting it", (out / "stderr.txt").read_text())
    assert len(lines) == 1 and re.search(r"vLLM engine process \d+ .*its log \S+vllm_\d+\.log ends: ", lines[0]), lines


@pytest.mark.slow
@pytest.mark.claim("vllm-engine")
def test_a_multi_turn_calculator_run_on_vllm_scores_its_trajectories_token_for_token(tmp_path) -> None:
    if env.version() is None:
        pytest.skip(f"vLLM is not installed ({env.INSTALL_COMMAND})")
    shape = ("model.head_dim=64", "rollout.engine=vllm", "rollout.tp=1")
    out = _train("configs/agentic_cpu.yaml", tmp_path / "run", *shape, "run.tracking.trackers=[]")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] <= 1e-4, summary  # observations masked, turns re-scored
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
