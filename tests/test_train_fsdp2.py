"""``hybridflow train configs/quickstart_cpu_fsdp2.yaml``: the quickstart on the FSDP2 trainer.

transformers' own Qwen3ForCausalLM, sharded with FSDP2 over two CPU processes, trained by SFT then
GRPO with an SGLang tp=2 engine fed through the reshard plan from FSDP2's row shards. One run
(deterministic; the quickstart shortened to the learning runs' 150 SFT and 20 GRPO steps) must
learn as the megatron quickstart does; a second start resumes it from its step-10 checkpoint and
must reproduce its last ten steps; its last checkpoint, converted to a Hugging Face directory,
must answer the held-out prompts in transformers as the engine did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import WARM_UP, _deterministic, _history, _ok, seed_from_warm_up

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/quickstart_cpu_fsdp2.yaml"
RUN = ("run.deterministic=true", "run.tracking.trackers=[]", WARM_UP, "run.steps=20", "run.checkpoint_every=10")


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", CONFIG, f"run.output_dir={out}", *RUN, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    result = _train(out)
    _ok(result)
    assert "fsdp2 dp=2" in result.stdout  # the start line names the trainer that runs
    return out


@pytest.mark.claim("fsdp2-quickstart")
def test_the_fsdp2_quickstart_learns_as_the_megatron_one_does(fsdp2_run: Path) -> None:
    summary = json.loads((fsdp2_run / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] <= 1e-4, summary  # the engine holds the trainer's weights
    after_sft, after_rl = summary["heldout_reward_after_sft"], summary["heldout_reward_after_rl"]
    assert after_rl >= after_sft + 0.3, (after_sft, after_rl)


@pytest.mark.claim("fsdp2-quickstart")
def test_a_resumed_fsdp2_run_reproduces_the_uninterrupted_one(fsdp2_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(fsdp2_run, out, ignore=shutil.ignore_patterns("step_000020", "summary.json"))
    result = _train(out)
    _ok(result)
    assert f"resuming from {out / 'checkpoints' / 'step_000010'}" in result.stdout, result.stdout[-2000:]
    assert _deterministic(_history(out, "step_000020")) == _deterministic(_history(fsdp2_run, "step_000020"))


@pytest.mark.claim("fsdp2-quickstart")
def test_the_fsdp2_checkpoint_converts_and_answers_as_the_engine_did(fsdp2_run: Path, tmp_path: Path) -> None:
    actor, out = fsdp2_run / "checkpoints" / "step_000020" / "actor", tmp_path / "hf"
    convert = [sys.executable, "-m", "hybridflow.cli", "convert", "fsdp2-to-hf", "--checkpoint", str(actor)]
    done = subprocess.run([*convert, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = heldout_rows(fsdp2_run, 20)
    assert transformers_answers(out, rows) == [row["response"].strip() for row in rows]


def heldout_rows(run: Path, step: int) -> list[dict]:
    """The run's held-out scoring at ``step`` (0: before RL), one row a prompt."""
    return [json.loads(line) for line in (run / "samples" / f"heldout_step_{step:06d}.jsonl").open()]


def transformers_answers(hf_dir: Path, rows: list[dict]) -> list[str]:
    """transformers' greedy answers (4 tokens, the quickstart's budget) from ``hf_dir`` to the
    held-out ``rows``' prompts, each under the directory's own chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    answered = []
    for row in rows:
        chat = [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        prompt = ids["input_ids"]
        assert prompt.shape[1] == row["prompt_tokens"]  # the run's own prompt, token for token
        new = model.generate(prompt, max_new_tokens=4, do_sample=False)[0, prompt.shape[1] :]
        answered.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    return answered


@pytest.mark.claim("fsdp2-quickstart")
def test_ppo_trains_an_fsdp2_critic_that_starts_from_the_sft_policy(fsdp2_run: Path, tmp_path: Path) -> None:
    """The run's SFT warm-up, then PPO: the critic is the actor's decoder under a value head
    (the transformer copied in by name), trained beside the actor and saved with it."""
    out = seed_from_warm_up(fsdp2_run, tmp_path / "run")
    _ok(_train(out, "algorithm.name=ppo", "run.steps=4", "run.checkpoint_every=2"))
    history = _history(out, "step_000004")
    losses = [h["critic/vf_loss"] for h in history]
    assert losses[-1] < losses[0], losses  # the values move towards the returns
    assert all(h["rollout/logprob_diff_max"] <= 1e-4 for h in history), history
    assert (out / "checkpoints" / "step_000004" / "critic" / "trainer.json").is_file()


ENGINE_LAYOUTS = {
    "separate": ("rollout.placement=separate",),
    "hf_engine": ("rollout.engine=hf", "rollout.tp=1", "rollout.sync_route=full"),
    "two_replicas": ("rollout.num_replicas=2", "rollout.tp=1"),
    "ulysses_sp2": ("actor.parallel.dp=1", "actor.parallel.cp=2"),
    "packed_budget": ("packing.enabled=true", "packing.max_tokens_per_micro_batch=256"),
}
"""The layouts beside the quickstart's (FSDP2 dp=2, colocated SGLang tp=2) that FSDP2's shards are
pushed from and into: the engine's, the actor under Ulysses sequence parallel (its two ranks
share each row's tokens and shard the parameters alike), and packed to a token budget."""


@pytest.mark.slow
@pytest.mark.claim("fsdp2-quickstart")
@pytest.mark.parametrize("layout", sorted(ENGINE_LAYOUTS))
def test_fsdp2_pushes_its_shards_into_every_engine_layout(layout: str, tmp_path: Path) -> None:
    short = ("sft.steps=20", "run.steps=2", "run.heldout_every=0", "checks.refit_every=1")
    _ok(_train(tmp_path / "run", *short, *ENGINE_LAYOUTS[layout]))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] <= 1e-4, summary
    history = _history(tmp_path / "run", "step_000002")
    assert all(h["checks/failed"] == 0.0 for h in history), history
    if (
        layout != "hf_engine"
    ):  # SGLang's weights are read back after every push (the hf engine's are the tensors pushed)
        read_back = [h["checks/refit_max_rel_diff"] for h in history if "checks/refit_max_rel_diff" in h]
        assert read_back and all(d == 0.0 for d in read_back), history


@pytest.mark.slow
@pytest.mark.claim("fsdp2-quickstart")
def test_an_fsdp2_run_resumes_under_another_data_parallel_size(fsdp2_run: Path, tmp_path: Path) -> None:
    """dp=2's step-10 checkpoint read by one rank (DCP reshards on load; the engine at tp=1): the
    engine scores the loaded weights as the trainer does, and the run goes on learning."""
    out = tmp_path / "run"
    shutil.copytree(fsdp2_run, out, ignore=shutil.ignore_patterns("step_000020", "summary.json"))
    result = _train(out, "actor.parallel.dp=1", "rollout.tp=1")
    _ok(result)
    assert "actor.parallel.dp: 2 -> 1" in result.stdout, result.stdout[-2000:]
    resumed = _history(out, "step_000020")[10:]
    assert all(h["rollout/logprob_diff_max"] <= 1e-4 for h in resumed), resumed
    assert json.loads((out / "summary.json").read_text())["heldout_reward_after_rl"] >= 0.9


@pytest.mark.slow
@pytest.mark.claim("fsdp2-quickstart")
def test_the_fsdp2_reference_starts_as_the_actor_and_holds_its_kl(fsdp2_run: Path, tmp_path: Path) -> None:
    """GRPO with the KL loss: the frozen FSDP2 reference reads the SFT warm-up's export, so at the
    first update (one mini-batch) the actor's KL to it is exactly 0; later steps move away from it."""
    out = seed_from_warm_up(fsdp2_run, tmp_path / "run")
    kl = ("reference.enabled=true", "algorithm.kl_loss_coef=0.001", "algorithm.mini_batches=1")
    _ok(_train(out, *kl, "run.steps=3", "run.checkpoint_every=3"))
    history = _history(out, "step_000003")
    assert history[0]["actor/kl_loss"] == 0.0 and history[-1]["actor/kl_loss"] > 0.0, history
