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
TOL = 1e-5
"""fp32 both sides; observed: log-probs equal, entropy 1.4e-6, parameters 1.3e-6 relative."""


def _hub_dir(root: Path, family: str) -> Path:
    """A tiny model as transformers saves it, in several shards (llama: separate output
    embedding; qwen3: tied, as its small models are)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    path = root / family
    model.save_pretrained(path, max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) >= 2
    return path


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp2")
    dirs = [_hub_dir(root, family) for family in ("llama", "qwen3")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(WORKER), str(root)]
    done = subprocess.run(
        [*command, *map(str, dirs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return root


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fsdp2_at_dp2_scores_and_steps_as_transformers_in_one_process(compared: Path, family: str) -> None:
    seen = json.loads((compared / f"{family}.json").read_text())
    assert seen["names"] and seen["tied"] == (family == "qwen3")
    assert seen["logprobs"] <= TOL and seen["entropy"] <= TOL, seen
    assert seen["megatron_logprobs"] <= TOL, seen  # the other backend, on the same weights
    assert seen["grad_norm"] <= TOL * 10 and seen["params_relative"] <= TOL, seen
    assert seen["tokens"] == 29  # the loss mask's tokens over both ranks' rows
