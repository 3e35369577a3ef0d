"""``hybridflow train`` with ``rollout.placement=separate``: engine ranks of their own.

torchrun starts the quickstart's 2 actor ranks (EP=2) and 2 engine ranks after them, in one job
(``hybridflow/runtime/channel.py``), one tp=1 replica each. The engine ranks receive each push
point to point through the reshard plan and hand it to SGLang; they generate, and the samples go
straight to the actor DP ranks that train on them. The run learns. (One tp=2 replica over the
engine ranks runs in ``tests/test_train_multinode.py``, its ranks on a node of their own; this
run is also the reference that ``tests/test_engine_restart.py``'s killed engines must reproduce.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_train import LOGPROB_TOL, WARM_UP, _history, _ok, _train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

SEPARATE = [
    "rollout.placement=separate",
    "rollout.tp=1",
    "rollout.num_replicas=2",
    WARM_UP,
    "run.steps=6",
    "run.checkpoint_every=6",
    "run.heldout_prompts=20",
    "run.prompts_per_step=16",
    "rollout.n=8",
]
REPLICAS = 2


def uninterrupted_separate_run(tmp_path_factory, seeded) -> tuple[Path, str]:
    """The run to the end from the shared warm-up (``tests/conftest.py``'s ``separate_run``);
    returns it and its stdout."""
    out = seeded(tmp_path_factory.mktemp("separate") / "full")
    result = _train(out, *SEPARATE)
    _ok(result)
    return out, result.stdout


@pytest.mark.claim("separate-placement")
@pytest.mark.features("separate_placement")
def test_separate_engine_ranks_generate_receive_every_push_and_the_run_learns(separate_run) -> None:
    out, stdout = separate_run
    assert "4 process(es)" in stdout and "+ 2 rank(s) of their own" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
    # the plan put generation on the engine ranks 2-3, and so did the run
    assert any(line.startswith("1. generate") and "rollout ranks 2-3" in line for line in summary["executed_stages"])
    history = _history(out, "step_000006")
    for h in history:
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL, h  # the engines hold the pushed weights
        assert sum(h[f"rollout/replica{k}/samples"] for k in range(REPLICAS)) == 16 * 8
        pushed = [h[f"sync/replica{k}/engine_bytes"] for k in range(REPLICAS)]
        assert min(pushed) > 0 and len(set(pushed)) == 1, h  # every push reached every replica
        assert h["sync/plan_bytes"] > 0
    for k in range(REPLICAS):
        assert sum(h[f"rollout/replica{k}/samples"] for h in history) > 0  # each replica generated
