"""A converted checkpoint in the SGLang engine: greedy tokens equal transformers' on the original.

A tiny Qwen3-MoE (and a tiny Qwen3, the dense family added last) goes Hugging Face ->
megatron-core (TP2 x EP2, or TP2, vocabulary padding) -> Hugging Face (several safetensors
shards and an index), and SGLang (CPU engine, tp=1) serves the result.
"""

from __future__ import annotations

import random

import pytest

from hybridflow.rollout import SamplingParams, make_engine
from megatron_adapters.convert import hf_to_mcore, mcore_to_hf
from tests.megatron_adapters.convert_models import make_hf_dir
from tests.rollout.sglang.reference import hf_greedy, load_hf

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

MAX_NEW = 12


@pytest.mark.claim("family-one-registration")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3"])
def test_sglang_serves_the_converted_checkpoint(tmp_path, family):
    original = make_hf_dir(tmp_path, family)
    hf_to_mcore(original, tmp_path / "mcore", tp=2, ep=2 if family == "qwen3_moe" else 1)
    # small shards: the engine reads the index and several files, as for a real checkpoint
    mcore_to_hf(tmp_path / "mcore", tmp_path / "converted", shard_bytes=256 << 10, checksums=True)
    assert len(list((tmp_path / "converted").glob("*.safetensors"))) > 1
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 320) for _ in range(rng.randrange(3, 11))] for _ in range(4)]
    engine = make_engine("sglang", model_path=str(tmp_path / "converted"), tp=1, max_total_tokens=2048)
    try:
        batch = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    finally:
        engine.shutdown()
    got = [list(s.response_ids) for s in batch.samples]
    assert got == hf_greedy(load_hf(original), prompts, MAX_NEW)
    assert all(len(r) > 0 for r in got)
