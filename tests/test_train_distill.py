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
from tests.test_train import WARM_UP, seed_from_warm_up

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


DISTILL = ("reward.function=tests.reward.constant.zero", "run.heldout_every=0")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The quickstart's model trained further (SFT on cleaner demonstrations), exported."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train_quickstart(
        out, "run.mode=sft", "sft.steps=150", "task.sft_noise=0.2", "run.heldout_prompts=0", "run.tracking.backend=none"
    )
    return out / "checkpoints" / "sft" / "hf"


@pytest.fixture(scope="module")
def student(teacher: Path, tmp_path_factory, sft_warm_up) -> Path:
    """Six steps of distillation after the shared warm-up, the teacher on a layout of its own (two
    stages beside the actor's EP=2 x DP=2), on the host between its uses."""
    out = seed_from_warm_up(sft_warm_up, tmp_path_factory.mktemp("student") / "run")
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
def test_the_student_moves_towards_the_teacher(student: Path) -> None:
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


@pytest.mark.claim("frozen-model-own-gpus")
def test_a_teacher_on_a_gpu_of_its_own_gives_the_log_probs_it_gives_on_the_actors(
    teacher: Path, student: Path, tmp_path: Path, seeded
) -> None:
    """``distillation.gpus=1``: the teacher's own process answers each step's log-prob requests;
    the held-out KL before training and the first step's reverse KL equal the run's with the
    teacher on the actor's ranks (PP=2 there, one rank here)."""
    out = seeded(tmp_path / "own")
    done = train_quickstart(
        out, WARM_UP, f"distillation.teacher_path={teacher}", "distillation.gpus=1", "run.steps=1", *DISTILL
    )
    assert "3 process(es)" in done.stdout, done.stdout[-2000:]
    own, shared = (json.loads((run / "summary.json").read_text()) for run in (out, student))
    assert own["heldout_teacher_kl"][0][1] == pytest.approx(shared["heldout_teacher_kl"][0][1], abs=1e-5)
    (first,) = json.loads((out / "checkpoints" / "step_000001" / "state.json").read_text())["history"]
    same = json.loads((student / "checkpoints" / "step_000006" / "state.json").read_text())["history"][0]
    assert first["distill/reverse_kl"] == pytest.approx(same["distill/reverse_kl"], abs=1e-5)
    (line,) = [line for line in own["executed_stages"] if " teacher_logprob [teacher] " in line]
    assert "on teacher rank 2 " in line and "(its own GPUs: distillation.gpus)" in line, line
