"""A reward model trained on preference pairs, exported, and the policy trained against it.

``run.mode=rm`` on the quickstart's task (``max(a,b)=``): pairs whose chosen answer is the right
one and whose rejected one is the smaller operand or another answer; the reward model (the
quickstart's MoE under a score head, EP=2) must rank the right answer of each held-out question
above every other answer (160 pairs of 20 questions it never saw) at least 90% of the time. Its
export is a transformers directory that ranks the same pairs the same way. Then GRPO with
``reward_model.path`` at that export, on a layout of its own (TP=2 beside the actor's EP=2), and
no rule reward (``reward.rule_weight=0``) raises the held-out rate of right answers, which only
the rule measures.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.reward.runs import QUICKSTART, train_quickstart
from tests.test_train import WARM_UP

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


RM_RUN = ("run.mode=rm", "sft.steps=0", "rm.steps=150", "rm.lr=3e-3")  # checkpoints at 100 and 150


def rm_mode_run(tmp_path_factory) -> Path:
    """The 150-step ``run.mode=rm`` run (``tests/conftest.py``'s ``rm_run``: once a session)."""
    out = tmp_path_factory.mktemp("rm") / "run"
    train_quickstart(out, *RM_RUN)
    return out


@pytest.mark.claim("rm-mode-trains-and-exports")
def test_the_reward_model_ranks_held_out_answers_and_transformers_loads_it(rm_run: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hybridflow.config import load_config
    from hybridflow.preferences import encode_pair, read_pairs

    summary = json.loads((rm_run / "summary.json").read_text())
    before, after = summary["heldout_pair_accuracy_before"], summary["heldout_pair_accuracy_after"]
    print(f"\nheld-out pair accuracy {before} -> {after}")
    assert summary["heldout_pairs"] == 160
    assert summary["heldout_pair_accuracy_after"] >= 0.9 > summary["heldout_pair_accuracy_before"]
    hf = Path(summary["reward_model_hf"])
    net = AutoModelForSequenceClassification.from_pretrained(str(hf), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    data = load_config(str(QUICKSTART)).data
    pairs = read_pairs(
        [str(rm_run / "data" / "max_pairs_heldout.jsonl")], data, chosen_key="chosen", rejected_key="rejected"
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    wins = 0
    with torch.no_grad():
        for pair in pairs:
            chosen, rejected = encode_pair(pair, tokenizer, data, end, use_chat=True)
            wins += net(torch.tensor([chosen])).logits[0, 0] > net(torch.tensor([rejected])).logits[0, 0]
    assert wins / len(pairs) == pytest.approx(summary["heldout_pair_accuracy_after"])


@pytest.mark.claim("rm-mode-resumes")
def test_a_stopped_reward_model_run_goes_on_from_its_checkpoint_as_the_uninterrupted_one(
    rm_run: Path, tmp_path: Path
) -> None:
    """The uninterrupted run's step-100 checkpoint in a fresh directory (the run as it stood when
    it saved it): the start trains steps 101-150 only and ends where the uninterrupted run did."""
    out = tmp_path / "resumed"
    shutil.copytree(rm_run / "checkpoints" / "rm_000100", out / "checkpoints" / "rm_000100")
    done = train_quickstart(out, *RM_RUN)
    assert f"resuming from {out / 'checkpoints' / 'rm_000100'}" in done.stdout, done.stdout[-2000:]
    first, second = (json.loads((run / "summary.json").read_text()) for run in (rm_run, out))
    assert (first["rm_started_at_step"], second["rm_started_at_step"]) == (0, 100)
    losses = [
        json.loads((run / "checkpoints" / "rm_000150" / "state.json").read_text())["rm_losses"] for run in (rm_run, out)
    ]
    assert len(losses[1]) == 150 and losses[1] == losses[0]
    for key in ("heldout_pair_accuracy_before", "heldout_pair_accuracy_after", "rm_loss_last"):
        assert second[key] == first[key], key
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["rm_000100", "rm_000150"]


RL_RUN = ("reward.rule_weight=0", "run.heldout_every=0")


def rl_against_rm_run(rm_run: Path, tmp_path_factory, seeded) -> Path:
    """GRPO against the exported reward model, after the shared SFT warm-up (tests/conftest.py),
    the reward model on a layout of its own (TP=2) beside the actor's EP=2 x DP=2: its one DP rank
    scores the whole batch, gathered from the actor's two (``rl_run``: once a session)."""
    out = seeded(tmp_path_factory.mktemp("rl") / "run")
    rm = rm_run / "reward_model" / "hf"
    train_quickstart(out, WARM_UP, f"reward_model.path={rm}", "reward_model.parallel.tp=2", "run.steps=6", *RL_RUN)
    return out


@pytest.mark.claim("rl-against-a-reward-model", "frozen-models-overview", "frozen-model-own-layout")
@pytest.mark.features("reward_model")
def test_rl_against_the_exported_reward_model_raises_the_right_answers(rl_run: Path) -> None:
    out = rl_run
    summary = json.loads((out / "summary.json").read_text())
    after_sft, after_rl = summary["heldout_reward_after_sft"], summary["heldout_reward_after_rl"]
    print(f"\nheld-out right answers (the rule's): after SFT {after_sft}, after RL against the reward model {after_rl}")
    assert after_rl >= after_sft + 0.3, summary
    (line,) = [line for line in summary["executed_stages"] if " rm_score [reward_model] rm_score " in line]
    assert "megatron tp=2 pp=1 " in line and "(its own: reward_model.parallel)" in line, line
    history = json.loads((out / "checkpoints" / "step_000006" / "state.json").read_text())["history"]
    assert history[-1]["model_scores/mean"] > history[0]["model_scores/mean"]
    # the samples on disk carry the reward model's score each reward was made of (the rule's
    # weight is 0 here), and the held-out generations the rule's scores, recomputed from the text
    from hybridflow.config import load_config, reward_weights
    from hybridflow.sample_files import read
    from tests.test_train import rescored

    cfg = load_config(str(out / "checkpoints" / "step_000006" / "config.yaml"))
    records = read(out / "samples" / "step_000006.jsonl")
    assert records and all(set(r["scores"]) == {"model"} for r in records)
    for r in records:
        weights = reward_weights(cfg, r["data_source"])
        assert weights["rule"] == 0 and r["reward"] == pytest.approx(
            weights["model"] * r["scores"]["model"], rel=1e-5, abs=1e-6
        )
    held = read(out / "samples" / "heldout_step_000006.jsonl")
    assert [r["reward"] for r in held] == rescored(out, held)
