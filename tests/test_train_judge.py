"""A generative judge on CPU: a second SGLang engine with a small judge model scores the rollouts.

The judge is the learning runs' shared SFT warm-up itself, exported as a Hugging Face directory:
a model that answers ``max(a,b)=``. The judging template asks it ``max({response},{answer})=``,
and the pattern ``^([0-4])$`` accepts only replies 0-4, so a reply of 5-9 (or anything else) is
unparsable: it scores ``judge.on_unparsable`` and is counted, and the run goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reward.runs import train_quickstart
from tests.test_train import WARM_UP

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


JUDGE = [
    "judge.dtype=float32",
    "judge.template=max({response},{answer})=",
    "judge.pattern=^([0-4])$",
    "judge.scale=1.0",
    "judge.on_unparsable=-1.0",
    "judge.max_tokens=4",
]
"""The judge's settings besides its path (the shared warm-up's export): also those of the judge
on GPUs of its own in ``tests/test_train_frozen_gpus.py``, whose first step must score as this
run's."""


def judge_quickstart_run(tmp_path_factory, seeded, sft_warm_up) -> Path:
    """Two GRPO steps after the shared warm-up, the warm-up's export judging (``conftest``'s
    ``judge_run``)."""
    out = seeded(tmp_path_factory.mktemp("judge") / "run")
    judge = sft_warm_up / "checkpoints" / "sft" / "hf"
    train_quickstart(out, WARM_UP, f"judge.path={judge}", *JUDGE, "run.steps=2", "run.heldout_every=0")
    return out


@pytest.mark.claim("generative-judge", "frozen-models-overview", "judge-overlaps-the-step")
@pytest.mark.features("judge")
def test_a_judge_engine_scores_the_rollouts_and_counts_what_it_cannot_parse(judge_run: Path) -> None:
    out = judge_run
    history = json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())["history"]
    unparsable = [h["judge/unparsable"] for h in history]
    means = [h["judge_scores/mean"] for h in history]
    print(f"\njudge: unparsable replies per step {unparsable}, mean judge score {means}")
    samples = 16 * 8
    assert all(0 < n < samples for n in unparsable)  # both kinds of reply, none crashed the run
    # the reward is the judge's alone (no rule weight with a judge): parsed 0-4, or -1
    for h, n in zip(history, unparsable):
        assert h["reward/mean"] == pytest.approx(h["judge_scores/mean"])
        assert -1.0 <= h["judge_scores/mean"] <= (4 * (samples - n) - n) / samples
    summary = json.loads((out / "summary.json").read_text())
    # the judge generated while the actor's log-probs were computed, and the reward waited for it
    stages = [line.split()[1] for line in summary["executed_stages"] if line.split()[0].endswith(".")]
    assert stages[:5] == ["generate", "judge_request", "old_logprob", "judge_score", "reward"], stages
