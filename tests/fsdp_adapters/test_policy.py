"""The FSDP2 backend against transformers in one process and against the megatron backend, on
hub-style directories (``save_pretrained`` in several shards): log-probs, entropy and the
parameters after one step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
FAMILIES = ("llama", "qwen3", "qwen3_moe")
TOL = 1e-5
"""fp32 both sides; observed: log-probs equal, entropy 1.4e-6, parameters 1.3e-6 relative."""


def _hub_dir(root: Path, family: str) -> Path:
    """A tiny model as transformers saves it, in several shards (llama: separate output
    embedding; qwen3: tied, as its small models are; qwen3_moe: transformers fuses its experts in
    the model, ``experts.gate_up_proj``, and saves them one by one, ``experts.0.gate_proj``)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=False))
    elif family == "qwen3_moe":
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_key_value_heads=2, head_dim=8, **experts))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    path = root / family
    model.save_pretrained(path, max_shard_size="20KB")
    from hybridflow.rollout.tiny import make_tiny_tokenizer

    make_tiny_tokenizer().save_pretrained(path)  # what an export must carry along
    assert len(list(path.glob("*.safetensors"))) >= 2
    return path


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp2")
    dirs = [_hub_dir(root, family) for family in FAMILIES]
    # a rendezvous of its own on a free port (--standalone), whatever an earlier test left in the environment
    inherited = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # the comparison with megatron (which installs its CPU workarounds process-wide) in a job of its own
    for ranks, mode in ((2, "compare"), (2, "fsdp2_only"), (1, "resume_alone")):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        command.append(str(WORKER))
        done = subprocess.run(
            [*command, str(root), mode, *map(str, dirs if mode != "resume_alone" else [root / "qwen3"])],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stderr[-4000:]
    return root


@pytest.mark.claim("fsdp2-backend-parity")
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_at_dp2_scores_and_steps_as_transformers_in_one_process(compared: Path, family: str) -> None:
    """qwen3_moe's checkpoint names are not its model's: rank 0 reads it with transformers and
    sends each rank its shards, the path of every family transformers converts as it loads."""
    seen = json.loads((compared / f"{family}.json").read_text())
    assert seen["names"] and seen["tied"] == (family == "qwen3")
    assert seen["read_by_rank0"] == (family == "qwen3_moe"), seen
    # each rank's shards are where the weight sync's planner looks for them (reshard/fsdp.py)
    assert seen["layout_shapes"] is (None if family == "qwen3_moe" else True), seen
    assert seen["logprobs"] <= TOL and seen["entropy"] <= TOL, seen
    assert seen["megatron_logprobs"] <= TOL, seen  # the other backend, on the same weights
    assert seen["grad_norm"] <= TOL * 10 and seen["params_relative"] <= TOL, seen
    assert seen["tokens"] == 29  # the loss mask's tokens over both ranks' rows
    # rank 0's parameters and Adam moments, from their tensors' storage: half the model's at dp=2
    assert seen["held_share"]["params"] == pytest.approx(0.5, abs=0.02), seen["held_share"]
    assert seen["held_share"]["optimizer"] == pytest.approx(0.5, abs=0.02), seen["held_share"]


@pytest.mark.claim("fsdp2-backend-parity")
def test_fsdp2_checkpoints_resume_exactly_also_at_another_dp_and_hand_the_model_back(compared: Path) -> None:
    """Saved after step 1 at dp=2: a fresh policy loading it takes step 2 to the very weights the
    uninterrupted one reached; one rank alone loads it too; the weights stream in buckets of the
    size asked under their Hugging Face names; the exported directory loads in transformers with
    the same weights and the starting directory's tokenizer (qwen3: tied embeddings)."""
    family = "qwen3"
    seen = json.loads((compared / f"{family}_lifecycle.json").read_text())
    assert seen["moved"] > 0 and seen["resume_max_abs"] == 0.0 and seen["steps"] == [2, 2], seen
    alone = json.loads((compared / f"{family}_dp1.json").read_text())
    assert alone == {"max_abs": 0.0, "steps": 1}
    assert seen["stream_names"] and seen["stream_max_abs"] == 0.0 and seen["stream_bucket_bytes"] <= 4096, seen
    assert seen["export_max_abs"] == 0.0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(seen["export_files"])


@pytest.mark.claim("fsdp2-quickstart")
@pytest.mark.parametrize("state", ["trained", "fresh"])
def test_an_undone_step_leaves_the_weights_moments_and_schedule_as_they_were(compared: Path, state: str) -> None:
    """``snapshot`` then ``rollback`` (the undo of an RL step that failed part-way): the step taken
    again lands exactly where the undone one did, after a step (moments) or before any (none)."""
    seen = json.loads((compared / "qwen3_lifecycle.json").read_text())[f"rollback_{state}"]
    assert seen["moved"] > 0 and seen["back_max_abs"] == 0.0 and seen["again_max_abs"] == 0.0, seen
    assert seen["steps"][0] == seen["steps"][1]


@pytest.mark.claim("fsdp2-ulysses")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ulysses_sequence_parallel_scores_and_steps_as_transformers_in_one_process(compared: Path, family: str) -> None:
    """Each rank runs the decoder on half of every row's tokens; attention sees the whole row."""
    seen = json.loads((compared / f"{family}_sp2.json").read_text())
    assert seen["attention"] == "ulysses"
    assert seen["logprobs"] <= TOL and seen["entropy"] <= TOL, seen
    assert seen["params_relative"] <= TOL and seen["grad_norm"] <= TOL, seen
    assert seen["tokens"] == 4 * 10 - 4 - 7  # the loss mask's tokens, counted once over the two ranks


@pytest.mark.claim("fsdp2-packing")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("packing", ["packed", "budget"])
def test_packed_micro_batches_score_and_step_as_unpacked_rows(compared: Path, family: str, packing: str) -> None:
    """A micro-batch's samples in one row (transformers confines attention to each sample from the
    restarting position ids), or packed to a 12-token budget: what the unpacked rows give."""
    seen = json.loads((compared / f"{family}_packed.json").read_text())
    case = seen[packing]
    assert case["logprobs"] <= TOL and case["entropy"] <= TOL and case["loss"] <= TOL, case
    assert case["params"] <= TOL and seen["moved"] > 1e-5, seen
    assert case["tokens"][0] == case["tokens"][1] == 29
