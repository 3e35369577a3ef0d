"""A megatron-core actor's weights reach a running SGLang engine through the reshard plan.

The engine starts from one tiny Qwen3-MoE (seed 0); the actor (EP=2, two processes) holds a
different one (seed 1). The reshard executor lays the actor's live parameters out as SGLang
tp=2 per-rank tensors, and the engine receives each rank's share only. Afterwards SGLang's
greedy tokens equal transformers' on the seed-1 model, and the log-probs SGLang returns for
sampled tokens equal the actor's own recomputation on those tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.rollout import SamplingParams, make_engine
from hybridflow.rollout.tokens import pack_batch
from tests.rollout.sglang.reference import hf_greedy, load_hf, tiny_model_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("actor_worker.py")
LOGPROB_TOL = 1e-4
"""fp32 SGLang (torch-native CPU kernels) against fp32 megatron-core: observed ~1e-6."""


def _torchrun(*args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    root = tmp_path_factory.mktemp("actor_push")
    start_dir, actor_dir = tiny_model_dir(root, "qwen3_moe", seed=0), tiny_model_dir(root, "qwen3_moe", seed=1)
    _torchrun("export", str(actor_dir), str(root))
    exported = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    engine = make_engine("sglang", model_path=str(start_dir), tp=2, max_total_tokens=2048)
    try:
        prompts = [[7, 8, 9, 10, 11], [20, 21, 22, 23, 24], [40, 41, 42, 43, 44], [60, 61, 62, 63, 64]]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        before = engine.generate(prompts, greedy)
        report = engine.push_weights([e["tensors"] for e in exported], route="sliced")
        engine.flush_cache()
        after = engine.generate(prompts, greedy)
        sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
    finally:
        engine.shutdown()
    yield {
        "root": root,
        "actor_dir": actor_dir,
        "prompts": prompts,
        "exported": exported,
        "report": report,
        "before": before,
        "after": after,
        "sampled": sampled,
    }


def _responses(batch) -> list[list[int]]:
    return [list(s.response_ids) for s in batch.samples]


def test_generations_follow_the_pushed_weights(pushed) -> None:
    expected = hf_greedy(load_hf(pushed["actor_dir"]), pushed["prompts"], max_new_tokens=8)
    assert _responses(pushed["after"]) == expected
    assert _responses(pushed["before"]) != expected  # the push changed something


@pytest.mark.claim("push-by-handles")
def test_each_rank_received_its_plan_share_only(pushed) -> None:
    full_model = sum(p.numel() * 4 for p in load_hf(pushed["actor_dir"]).parameters())
    for rank, exported in enumerate(pushed["exported"]):
        logical = sum(t.numel() * 4 for t in exported["tensors"].values())
        # the executor filled exactly the plan's share (vocab padding rows stay zero) ...
        assert (
            exported["report"]["bytes_received"] + exported["report"]["bytes_copied_locally"]
            == exported["plan_share_bytes"]
        )
        assert exported["plan_share_bytes"] <= logical
        # ... and the engine received that rank's tensors (plus its CPU padding), not the model
        assert pushed["report"].bytes_per_rank[rank] < full_model


@pytest.mark.claim("push-by-handles")
def test_sglang_logprobs_match_the_actor_recomputation(pushed) -> None:
    samples = pushed["sampled"].samples
    batch = pack_batch(samples, pad_id=0, padding_side="right")
    torch.save({"input_ids": batch["input_ids"]}, pushed["root"] / "seqs.pt")
    _torchrun("score", str(pushed["actor_dir"]), str(pushed["root"]), str(pushed["root"] / "seqs.pt"))
    actor = torch.load(pushed["root"] / "actor_logp.pt")
    mask = batch["response_mask"].bool()
    diff = (actor[mask] - batch["logprobs"][mask]).abs().max().item()
    assert diff < LOGPROB_TOL, diff
