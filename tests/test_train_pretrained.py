"""From a pretrained directory to a model others load: GSM8K-style RL on verl-format parquet.

The first run a user makes, end to end. ``model.path`` names a hub-style directory (a tiny Qwen3,
``tests/megatron_adapters/convert_models.py``; the actor under TP=2) and no other ``model.*`` key.
The prompts are parquet files laid out as verl's GSM8K preprocessing writes them: ``prompt`` a
list of chat messages, ``data_source='openai/gsm8k'``, ``ability``, ``reward_model.ground_truth``
and ``extra_info`` with the worked answer ending in ``#### N``. The questions are the
quickstart's (which of two digits is larger), and 60% of the worked answers give the smaller one.
The run warms up on ``extra_info.answer`` (SFT), then GRPO scores each response with verl's
strict GSM8K check (``reward.function=auto`` routes by data_source). Then:

- the held-out reward (greedy) after RL is above the one after SFT;
- ``hybridflow convert mcore-to-hf`` of the last RL checkpoint writes a directory that
  transformers loads, with the starting model's tokenizer and chat template, and SGLang's engine
  starts on it with log-probs equal to transformers';
- the export of the checkpoint one step before scores as the trainer did at the last step, which
  started from those weights (the run dumps the trainer's log-probs of each step: one run, not a
  second one resumed for a step).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.data import write_parquet
from tests.dumped_logprobs import transformers_logprobs, worst_difference
from tests.injection import environment
from tests.megatron_adapters.convert_models import make_hf_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
LOGPROB_TOL = 1e-4
RL_STEPS = 8
HELDOUT = 20
SFT_NOISE = 0.6


def _gsm8k_row(a: int, b: int, split: str, index: int, worked: str) -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py lays it out."""
    question = f"max({a},{b})?"
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(max(a, b))},
        "extra_info": {"split": split, "index": index, "answer": worked, "question": question},
    }


def _write_data(root: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    rng.shuffle(pairs)
    heldout, train = pairs[:HELDOUT], pairs[HELDOUT:]
    rows = []
    for index in range(2000):
        a, b = rng.choice(train)
        given = min(a, b) if rng.random() < SFT_NOISE else max(a, b)
        rows.append(_gsm8k_row(a, b, "train", index, f"#### {given}"))
    test = [_gsm8k_row(a, b, "test", i, f"#### {max(a, b)}") for i, (a, b) in enumerate(heldout)]
    return write_parquet(root / "train.parquet", rows), write_parquet(root / "test.parquet", test)


TEMPLATE = ROOT / "configs" / "my_model.yaml"
"""The run is the template users copy (docs/getting-started.md), as they would type it: the model
and the files on the command line, and what a tiny model on a toy task needs besides."""


def _overrides(model: Path, train: Path, test: Path) -> list[str]:
    return [
        f"model.path={model}",
        f"data.train_files=[{train}]",
        f"data.heldout_files=[{test}]",
        # the toy task: one-digit answers, and a 64-wide model that learns at a high rate
        "data.max_prompt_length=48",
        "data.max_response_length=8",
        "rollout.max_total_tokens=4096",
        "sft.steps=100",
        "sft.lr=3.0e-3",
        "sft.batch_size=64",
        "algorithm.mini_batches=4",
        "train.lr=1.0e-3",
        "train.micro_batch_size=16",
        "train.clip_grad=1.0",
        "run.name=gsm8k_style",
        f"run.steps={RL_STEPS}",
        f"run.checkpoint_every={RL_STEPS - 1}",  # and the last step: the one before is kept to compare
        f"run.heldout_prompts={HELDOUT}",
        "run.tracking.trackers=[]",
    ]


def _train(config: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(config), f"run.output_dir={out}", *extra],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=1000,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


@pytest.mark.claim("gsm8k-verl-parquet-end-to-end", "template-runs")
def test_a_pretrained_directory_learns_gsm8k_style_answers_and_leaves_as_a_loadable_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.cli import main
    from hybridflow.rollout import SamplingParams, make_engine

    model_dir = make_hf_dir(tmp_path, "qwen3")
    train, test = _write_data(tmp_path)
    out, dump = tmp_path / "run", tmp_path / "dump"
    _train(TEMPLATE, out, *_overrides(model_dir, train, test), env=environment(DUMP_LOGPROBS=str(dump)))
    summary = json.loads((out / "summary.json").read_text())
    print(
        f"\nheld-out reward: after SFT {summary['heldout_reward_after_sft']}, "
        f"after RL {summary['heldout_reward_after_rl']}"
    )
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"] + 0.2, summary

    checkpoints = out / "checkpoints"
    export, before_last = tmp_path / "export", tmp_path / "export_before_last"
    for step, target in ((RL_STEPS, export), (RL_STEPS - 1, before_last)):
        actor = checkpoints / f"step_{step:06d}" / "actor"
        assert main(["convert", "mcore-to-hf", "--mcore", str(actor), "--out", str(target)]) == 0
    source, exported = AutoTokenizer.from_pretrained(str(model_dir)), AutoTokenizer.from_pretrained(str(export))
    assert exported.chat_template == source.chat_template and exported.get_vocab() == source.get_vocab()

    # the last step (index RL_STEPS - 1) scored its rows with the weights after RL_STEPS - 1 steps
    last_step = dump / f"step_{RL_STEPS - 1:06d}"
    assert sorted(p.name for p in dump.iterdir()) == [f"step_{i:06d}" for i in range(RL_STEPS)]
    model = AutoModelForCausalLM.from_pretrained(str(before_last), dtype=torch.float32).eval()
    worst, scored = worst_difference(model, last_step)
    print(f"trainer (last step) vs transformers on the export before it, {scored} tokens: max |diff| {worst:.2e}")
    assert scored > 0 and worst < LOGPROB_TOL

    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    chats = [
        exported.apply_chat_template(
            [{"role": "user", "content": f"max({a},{b})?"}], add_generation_prompt=True, tokenize=False
        )
        for a, b in ((2, 7), (9, 4))
    ]
    prompts = [exported.encode(text, add_special_tokens=False) for text in chats]
    engine = make_engine("sglang", model_path=str(export), tp=1, dtype="float32", max_total_tokens=2048)
    try:
        batch = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    finally:
        engine.shutdown()
    for prompt, sample in zip(prompts, batch.samples):
        expected = transformers_logprobs(model, torch.tensor(prompt + list(sample.response_ids)))[len(prompt) - 1 :]
        assert len(sample.response_ids) > 0
        assert max(abs(a - b) for a, b in zip(sample.logprobs, expected.tolist())) < LOGPROB_TOL
    print("SGLang on the export, greedy:", [exported.decode(s.response_ids) for s in batch.samples])
