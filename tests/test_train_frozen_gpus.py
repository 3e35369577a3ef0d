"""Frozen models on GPUs of their own: a reward model, a distillation teacher and a generative
judge each on a process of its own beside the quickstart's two actor ranks
(``reward_model.gpus=1``, ``distillation.gpus=1``, ``judge.gpus=1``), against the same models on
the actor's ranks.

One step after the shared SFT warm-up: its samples are those of the first step of the runs that
placed the models on the actor's ranks (``rl_run``: the reward model under TP=2;
``distill_student``: the teacher under PP=2; ``judge_run``: the judge's engine on rank 0), so the
reward model's scores of them, the teacher's reverse KL to them and the held-out KL before
training must be theirs, within fp32 rounding of the other layouts, and the judge's replies
(greedy) must score and fail to parse exactly as there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reward.runs import train_quickstart
from tests.test_train import WARM_UP
from tests.test_train_judge import JUDGE

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.claim("frozen-model-own-gpus")
def test_a_reward_model_a_teacher_and_a_judge_on_gpus_of_their_own_answer_as_on_the_actors(
    rm_run: Path,
    rl_run: Path,
    distill_teacher: Path,
    distill_student: Path,
    judge_run: Path,
    sft_warm_up: Path,
    tmp_path: Path,
    seeded,
) -> None:
    out = seeded(tmp_path / "own")
    done = train_quickstart(
        out,
        WARM_UP,
        f"reward_model.path={rm_run / 'reward_model' / 'hf'}",
        "reward_model.gpus=1",
        f"distillation.teacher_path={distill_teacher}",
        "distillation.gpus=1",
        f"judge.path={sft_warm_up / 'checkpoints' / 'sft' / 'hf'}",
        *JUDGE,
        "judge.gpus=1",
        "reward.rule_weight=0",
        "run.steps=1",
        "run.heldout_every=0",
    )
    assert "5 process(es)" in done.stdout and "+ 3 rank(s) of their own" in done.stdout, done.stdout[-2000:]
    (own,) = json.loads((out / "checkpoints" / "step_000001" / "state.json").read_text())["history"]
    scored, distilled, judged = (
        json.loads((run / "checkpoints" / f"step_{steps:06d}" / "state.json").read_text())["history"][0]
        for run, steps in ((rl_run, 6), (distill_student, 6), (judge_run, 2))
    )
    for key in ("judge_scores/mean", "judge/unparsable"):  # greedy replies of the same requests
        assert own[key] == judged[key], key
    for key in ("model_scores/mean", "model_scores/std"):
        assert own[key] == pytest.approx(scored[key], abs=1e-5), key
    assert own["distill/reverse_kl"] == pytest.approx(distilled["distill/reverse_kl"], abs=1e-5)
    summary, shared = (json.loads((run / "summary.json").read_text()) for run in (out, distill_student))
    assert summary["heldout_teacher_kl"][0][1] == pytest.approx(shared["heldout_teacher_kl"][0][1], abs=1e-5)
    stages = [line for line in summary["executed_stages"] if " [" in line]
    where = {line.split(". ")[1].split(" [")[0]: line for line in stages}
    assert (
        "on reward_model rank 2 " in where["rm_request"] and "(its own GPUs: reward_model.gpus)" in where["rm_request"]
    )
    assert (
        "on teacher rank 3 " in where["teacher_logprob"]
        and "(its own GPUs: distillation.gpus)" in where["teacher_logprob"]
    )
    assert "on judge rank 4 " in where["judge_request"] and "(its own GPUs: judge.gpus)" in where["judge_request"]
    names = list(where)
    assert names.index("rm_request") < names.index("old_logprob") < names.index("rm_score")  # they compute meanwhile
    assert names.index("teacher_request") < names.index("old_logprob") < names.index("teacher_logprob")
    assert names.index("judge_request") < names.index("old_logprob") < names.index("judge_score")
