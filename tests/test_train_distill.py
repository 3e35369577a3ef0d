"""On-policy distillation: a student trained only by a teacher's log-probs of its own samples.

The teacher is the quickstart's model trained further: SFT on clean demonstrations
(``task.sft_noise=0.2``), exported as a Hugging Face directory by its run. The student is the
learning runs' shared SFT warm-up (60% wrong demonstrations). Its RL run scores every response 0
(``tests/reward/constant.py``), so GRPO's advantages are 0 and only the reverse-KL term of
``distillation.teacher_path`` trains it. The held-out KL(student || teacher), estimated from
responses sampled from the student, must fall to under half of where it started (seen: 0.237 ->
0.079 per token in 6 steps), and so must the same estimate on each step's training samples. The
teacher runs on a layout of its own (two pipeline stages beside the actor's EP=2 x DP=2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reward.runs import train_quickstart
from tests.test_train import WARM_UP

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


DISTILL = ("reward.function=tests.reward.constant.zero", "run.heldout_every=0")


def teacher_export(tmp_path_factory) -> Path:
    """The quickstart's model trained further (SFT on cleaner demonstrations), exported
    (``tests/conftest.py``'s ``distill_teacher``: once a session)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train_quickstart(
        out, "run.mode=sft", "sft.steps=150", "task.sft_noise=0.2", "run.heldout_prompts=0", "run.tracking.trackers=[]"
    )
    return out / "checkpoints" / "sft" / "hf"


def student_run(teacher: Path, tmp_path_factory, seeded) -> Path:
    """Six steps of distillation after the shared warm-up, the teacher on a layout of its own (two
    stages beside the actor's EP=2 x DP=2), on the host between its uses (``distill_student``:
    once a session)."""
    out = seeded(tmp_path_factory.mktemp("student") / "run")
    train_quickstart(
        out,
        WARM_UP,
        f"distillation.teacher_path={teacher}",
        "distillation.parallel.pp=2",
        "distillation.offload=true",  # on the host between uses (the offloaded path; on a CPU nothing moves)
        "run.steps=6",
        *DISTILL,
    )
    return out


@pytest.mark.claim("on-policy-distillation", "frozen-models-overview", "frozen-model-own-layout")
@pytest.mark.features("distillation")
def test_the_student_moves_towards_the_teacher(distill_student: Path) -> None:
    student = distill_student
    summary = json.loads((student / "summary.json").read_text())
    (first_step, before), (last_step, after) = summary["heldout_teacher_kl"][0], summary["heldout_teacher_kl"][-1]
    print(
        f"\nheld-out KL(student || teacher) per token: step {first_step} {before:.3f} -> step {last_step} {after:.3f}"
    )
    assert (first_step, last_step) == (0, 6)
    assert after < 0.5 * before, summary["heldout_teacher_kl"]
    history = json.loads((student / "checkpoints" / "step_000006" / "state.json").read_text())["history"]
    (line,) = [line for line in summary["executed_stages"] if " teacher_logprob [teacher] " in line]
    assert "megatron tp=1 pp=2 " in line and "(its own: distillation.parallel)" in line, line
    assert all(h["reward/mean"] == 0 for h in history)  # the teacher is the only signal
    assert history[-1]["distill/reverse_kl"] < history[0]["distill/reverse_kl"]
