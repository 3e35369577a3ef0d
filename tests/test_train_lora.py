"""``hybridflow train configs/quickstart_cpu_lora.yaml``: full-model SFT, then GRPO on LoRA adapters.

One run, the learning matrix's length (150 SFT + 10 RL steps, about 2 minutes on 2 cores): the
held-out reward after RL must beat the one after SFT, the engine's log-probs must match the
trainer's on the merged weights, and the RL checkpoint's base weights must be the SFT
checkpoint's bit for bit (only the adapters trained). The run's checkpoints then leave through
the command line as a user would take them: the SFT base and the adapters as PEFT files, and
merged weights, which transformers (+ peft) must score alike.

A second run pushes adapters instead (``lora.push=adapter``, attention adapters: the CPU engine
serves dense targets): the base is pushed once before RL, then each step moves the adapters
alone, and the engine's log-probs must match the trainer's at every step. Two more runs push
adapters to separate placement's engine ranks (two tp=1 replicas, each sent its copy by another
actor rank): synchronous, where both replicas' log-probs must match the trainer's at every step,
and asynchronous RL with partial rollouts (K=2), where the engines load each new version's
adapters between the batches they generate ahead and requests continue on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_adapters.checkpoint import read_meta
from megatron_adapters.dist_io import DistReader
from tests.test_train import WARM_UP

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
SHORT = (WARM_UP, "run.steps=10", "run.heldout_every=10", "run.checkpoint_every=10")
LOGPROB_TOL = 1e-4
"""As tests/test_train.py: fp32 SGLang CPU kernels against fp32 megatron-core."""


def _train(out: Path, *overrides: str) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu_lora.yaml",
        f"run.output_dir={out}",
        *SHORT,
        *overrides,
    ]
    result = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1100
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, seeded) -> Path:
    return _train(seeded(tmp_path_factory.mktemp("train_lora") / "run"))


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, seeded) -> Path:
    return _train(seeded(tmp_path_factory.mktemp("train_lora_adapter") / "run"), *ADAPTER_PUSH)


ADAPTER_PUSH = ("lora.push=adapter", "lora.target_modules=[linear_qkv,linear_proj]")
SEPARATE = (
    "rollout.placement=separate",
    "rollout.tp=1",
    "rollout.num_replicas=2",
    "run.steps=6",
    "run.heldout_every=6",
    "run.checkpoint_every=6",
)
ASYNC = (
    "async_rl.mode=async",
    "async_rl.max_staleness=2",
    "async_rl.partial_rollout=true",
    "async_rl.segment_tokens=1",
    "algorithm.rollout_correction=tis",
)


@pytest.fixture(scope="module")
def separate_runs(tmp_path_factory, seeded) -> dict[str, Path]:
    """Adapter pushes to separate engine ranks, synchronous and asynchronous (started when asked)."""
    root = tmp_path_factory.mktemp("train_lora_separate")
    overrides = {"sync": SEPARATE, "async": (*SEPARATE, *ASYNC)}

    class Runs(dict):
        def __missing__(self, mode: str) -> Path:
            self[mode] = _train(seeded(root / mode), *ADAPTER_PUSH, *overrides[mode])
            return self[mode]

    return Runs()


@pytest.mark.claim("lora-quickstart-learns")
@pytest.mark.features("lora_merged")
def test_lora_rl_learns_beyond_the_sft_warm_up(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] < LOGPROB_TOL  # the engine serves W + s B A
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    reader = DistReader(directory)
    out = {}
    for key, meta in reader.tensors().items():
        out[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    reader.read([((key, (0,) * t.dim(), tuple(t.shape)), t) for key, t in out.items()])
    return out


@pytest.mark.claim("lora-base-frozen")
def test_only_the_adapters_trained(run: Path) -> None:
    from hfschema.hf_config import read_model_config

    checkpoints = run / "checkpoints"
    rl = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step"))[-1] / "actor"
    assert read_meta(rl)["lora"] and not read_meta(checkpoints / "sft" / "actor")["lora"]
    sft, trained = _tensors(checkpoints / "sft" / "actor"), _tensors(rl)
    adapters = [k for k in trained if k.endswith(("lora_a", "lora_b"))]
    assert adapters and all(trained[k].abs().sum() > 0 for k in adapters if k.endswith("lora_b"))
    # the model's weights: megatron's vocabulary padding rows are none (RL's actor loads the SFT
    # export, which has no such rows, and the loader zeroes them)
    vocab = read_model_config(run / "model").vocab_size

    def weights(key: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:vocab] if key.startswith(("embedding.word_embeddings.", "output_layer.")) else tensor

    assert sft and all(torch.equal(weights(k, sft[k]), weights(k, trained[k])) for k in sft)


@pytest.mark.claim("lora-peft-files")
def test_the_adapters_leave_as_peft_files_and_as_merged_weights(run: Path, tmp_path) -> None:
    """No --hf-config: a checkpoint in its run directory takes the run's model/ config and tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridflow.cli import main

    checkpoints = run / "checkpoints"
    rl = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step"))[-1] / "actor"
    assert (
        main(["convert", "mcore-to-hf", "--mcore", str(checkpoints / "sft" / "actor"), "--out", str(tmp_path / "base")])
        == 0
    )
    assert main(["convert", "mcore-to-peft", "--mcore", str(rl), "--out", str(tmp_path / "adapter")]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore", str(rl), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    ids = torch.randint(0, 262, (4, 24), generator=torch.Generator().manual_seed(0))

    def scores(net) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(net(input_ids=ids).logits.float(), dim=-1)

    merged = scores(AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval())
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    adapted = scores(with_adapter)
    with with_adapter.disable_adapter():
        plain = scores(with_adapter)
    assert (adapted - merged).abs().max() <= LOGPROB_TOL
    assert (plain - merged).abs().max() > 1e-2  # the adapters carry the RL training


@pytest.mark.claim("lora-adapter-push")
@pytest.mark.features("lora_adapter")
def test_adapter_pushes_move_the_adapters_alone_and_the_engine_serves_them(adapter_run: Path) -> None:
    summary = json.loads((adapter_run / "summary.json").read_text())
    history = json.loads((adapter_run / "checkpoints" / "step_000010" / "state.json").read_text())["history"]
    assert len(history) == 10
    # the base went before RL; every step's push is the adapters (PEFT layout, float32), nothing else
    adapter_bytes = {h["sync/adapter_bytes"] for h in history}
    assert all(h["sync/engine_bytes"] == 0.0 for h in history) and len(adapter_bytes) == 1
    assert 0 < adapter_bytes.pop() < 100_000
    # the engine's own log-probs of what it sampled, with the adapters unmerged, are the trainer's
    assert all(h["rollout/logprob_diff_max"] < LOGPROB_TOL for h in history), history
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary


def _adapter_steps(out: Path, replicas: int) -> list[dict]:
    """The run's step metrics, after checking that every push reached every replica as adapters
    alone (the same bytes each: the base went before RL)."""
    history = json.loads((out / "checkpoints" / "step_000006" / "state.json").read_text())["history"]
    assert len(history) == 6
    for h in history:
        per_replica = {h[f"sync/replica{k}/adapter_bytes"] for k in range(replicas)}
        assert len(per_replica) == 1 and 0 < per_replica.pop() < 100_000, h
        assert h["sync/engine_bytes"] == 0.0 and h["sync/plan_bytes"] == 0.0, h
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
    return history


@pytest.mark.claim("lora-adapters-to-separate-engines")
@pytest.mark.slow  # the async run below takes the same path (actor rank k % A sends replica k's driver)
def test_separate_engine_ranks_receive_the_adapters_from_the_actor_ranks(separate_runs) -> None:
    for h in _adapter_steps(separate_runs["sync"], replicas=2):
        assert min(h["rollout/replica0/samples"], h["rollout/replica1/samples"]) > 0, h
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL, h  # both replicas serve the step's adapters


@pytest.mark.claim("lora-adapters-to-separate-engines")
def test_asynchronous_rl_loads_each_versions_adapters_between_the_batches_it_generates(separate_runs) -> None:
    history = _adapter_steps(separate_runs["async"], replicas=2)
    # batch 0: the SFT base and version 0's adapters sampled it, which the trainer scores alike;
    # later batches span adapter versions (one token per request with the starting version)
    assert history[0]["async/behaviour/current_version_logprob_diff_max"] < LOGPROB_TOL, history[0]
    for step, h in enumerate(history[2:], start=2):
        assert h["async/tokens_version_lag_2"] == 16 * 8 and h["async/tokens_version_lag_1"] > 0, (step, h)
