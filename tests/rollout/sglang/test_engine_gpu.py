"""SGLang's CUDA engine: what the CPU engine cannot show. Run by ``scripts/gpu_check.sh``.

- The experts each sample's tokens were routed to (``return_routed_experts``, on by default for
  MoE models on a GPU) equal transformers' router top-k on the same tokens, in
  ``RolloutSample.routed_experts``' layout ``[P + R - 1, L, k]``.
- ``release_memory`` gives GPU memory back; after ``resume_memory`` and a weight push (what an
  RL step does after training) the engine serves the same tokens as before.
- Expert parallelism (tp=2, ep=2; two GPUs): greedy tokens equal transformers', before and
  after a sliced push laid out for ep=2.

The CPU suite covers the rest of the adapter, and on a GPU ``test_engine.py`` runs the same
checks with this engine.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.rollout import SamplingParams, make_engine
from hybridflow.rollout.sglang import cpu
from tests.rollout.sglang.reference import hf_greedy, load_hf, rank_tensors, tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not cpu.has_cuda_gpu(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it on one)"),
]

PROMPTS = [[7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26], [40, 41, 42], [60, 61, 62, 63]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def _responses(batch) -> list[list[int]]:
    return [list(s.response_ids) for s in batch.samples]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("gpu"), "qwen3_moe", seed=0)


def test_routed_experts_equal_the_router_top_k(moe_dir):
    reference = load_hf(moe_dir)
    top_k = reference.config.num_experts_per_tok
    engine = make_engine("sglang", model_path=str(moe_dir), tp=1, max_total_tokens=2048)
    try:
        batch = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    assert _responses(batch) == hf_greedy(reference, PROMPTS, GREEDY.max_new_tokens)
    for sample in batch.samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            router_logits = reference(ids, output_router_logits=True).router_logits
        expected = torch.stack([torch.topk(layer, top_k, dim=-1).indices for layer in router_logits], dim=1)[:-1]
        got = torch.as_tensor(sample.routed_experts, dtype=torch.long)
        assert got.shape == expected.shape
        # the order within a token's k experts is the kernel's; the set is what replay uses
        assert torch.equal(got.sort(dim=-1).values, expected.sort(dim=-1).values)


@pytest.mark.claim("engine-memory-release")
def test_release_frees_memory_and_resume_then_push_serves_the_same_tokens(moe_dir):
    engine = make_engine("sglang", model_path=str(moe_dir), tp=1, max_total_tokens=65536)
    try:
        before = _responses(engine.generate(PROMPTS, GREEDY))
        free_before, _ = torch.cuda.mem_get_info()
        engine.release_memory()
        free_released, _ = torch.cuda.mem_get_info()
        engine.resume_memory()
        free_resumed, _ = torch.cuda.mem_get_info()
        engine.push_weights(rank_tensors(moe_dir, tp=1), route="sliced")  # resumed weights are not kept
        after = _responses(engine.generate(PROMPTS, GREEDY))
    finally:
        engine.shutdown()
    print(
        f"\nfree GPU memory: {free_before / 2**20:.0f} MiB, released {free_released / 2**20:.0f} MiB, "
        f"resumed {free_resumed / 2**20:.0f} MiB"
    )
    assert free_released - free_before > 64 << 20  # the KV pool of 65,536 tokens alone is larger
    assert free_resumed < free_released - (64 << 20)
    assert after == before


@pytest.mark.skipif(cpu.has_cuda_gpu() and torch.cuda.device_count() < 2, reason="ep=2 needs two GPUs")
def test_expert_parallel_engine_matches_transformers_before_and_after_a_push(moe_dir, tmp_path):
    other = tiny_model_dir(tmp_path, "qwen3_moe", seed=1)
    expected_before = hf_greedy(load_hf(moe_dir), PROMPTS, GREEDY.max_new_tokens)
    expected_after = hf_greedy(load_hf(other), PROMPTS, GREEDY.max_new_tokens)
    assert expected_before != expected_after
    engine = make_engine("sglang", model_path=str(moe_dir), tp=2, ep=2, max_total_tokens=2048)
    try:
        assert _responses(engine.generate(PROMPTS, GREEDY)) == expected_before
        report = engine.push_weights(rank_tensors(other, tp=2, ep=2), route="sliced")
        assert _responses(engine.generate(PROMPTS, GREEDY)) == expected_after
    finally:
        engine.shutdown()
    assert len(report.bytes_per_rank) == 2
