"""The reshard plan into vLLM's layout (``reshard.vllm.vllm_layout``) against vLLM's own loader.

For a dense and an MoE model at tp 1 / 2 / 4, one vLLM engine (its CPU build, fp32) is given the
model twice: whole Hugging Face tensors, which vLLM's loaders cut and fuse for each rank; then each
rank's share as the plan lays it out (``placement.place``, what a sliced push does). Each time
every rank's parameters are read just before vLLM's kernels repack them (``placement.capturing``),
and the two must be equal, rank for rank, name for name, element for element; the plan's parameter
shapes must be the ones vLLM reports, and after the sliced push vLLM's greedy tokens must be
transformers'. tp=4 with two KV heads: vLLM repeats each KV head on two ranks.

The default tier runs the MoE model at tp=2 (fused QKV, gate_up and experts, the vocabulary
split); the slow tier the other five cases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfschema.hf_config import read_model_config
from hfschema.sglang import SGLangSettings
from hybridflow.rollout import SamplingParams, make_engine
from hybridflow.rollout.tiny import make_tiny_model_dir
from hybridflow.rollout.vllm import env
from hybridflow.rollout.vllm.handles import prepare_rank_payload
from reshard.executor import fill_rank
from reshard.vllm import vllm_layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CASES = [
    pytest.param("qwen3_moe", 2, id="moe-tp2"),
    *(pytest.param(f, tp, id=f"{n}-tp{tp}", marks=pytest.mark.slow) for f, n, tp in [
        ("qwen3", "dense", 1), ("qwen3", "dense", 2), ("qwen3", "dense", 4), ("qwen3_moe", "moe", 1),
        ("qwen3_moe", "moe", 4)]),
]  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


def _model_dir(root: Path, family: str, tp: int) -> Path:
    # head_dim 64 (vLLM's CPU attention refuses 16); heads split tp ways, two KV heads; each
    # rank's expert width a multiple of 32 (vLLM's CPU MoE reloads no padded width)
    extra = {"moe_intermediate_size": 32 * tp} if family == "qwen3_moe" else {}
    shape = dict(head_dim=64, num_attention_heads=max(2, tp), num_key_value_heads=2, **extra)
    return make_tiny_model_dir(root / f"{family}-tp{tp}", family, seed=3, **shape)


@pytest.mark.claim("vllm-sliced-push")
@pytest.mark.parametrize("family, tp", CASES)
def test_each_rank_holds_after_a_sliced_push_what_vllms_loader_builds_from_the_full_tensors(family, tp, tmp_path):
    if env.version() is None:
        pytest.skip(f"vLLM is not installed ({env.INSTALL_COMMAND})")
    model = _model_dir(tmp_path, family, tp)
    hf = load_file(str(model / "model.safetensors"))
    layout = vllm_layout(read_model_config(model), SGLangSettings(tp=tp), dtype="float32")
    engine = make_engine("vllm", model_path=str(model), tp=tp, max_context=128, log_dir=str(tmp_path / "logs"))
    try:
        params = engine.rank_params()
        for rank in range(tp):  # the plan's parameters are vLLM's, of vLLM's shapes
            assert {n: list(s) for n, s in layout.param_shapes(rank).items()} == {
                n: p["shape"] for n, p in params[rank].items()
            }
        loaded, placed = tmp_path / "loader", tmp_path / "plan"
        loaded.mkdir(), placed.mkdir()
        whole = tmp_path / "whole.safetensors"
        save_file(hf, str(whole))
        engine._call({"op": "load", "path": str(whole), "capture": str(loaded)})
        payloads = [prepare_rank_payload(r, fill_rank(layout, hf, r), params[r])[0] for r in range(tp)]
        try:
            engine._call({"op": "load_ranks", "paths": [p.path for p in payloads], "capture": str(placed)})
        finally:
            for payload in payloads:
                Path(payload.path).unlink()
        for rank in range(tp):
            theirs, ours = (load_file(str(d / f"rank{rank}.safetensors")) for d in (loaded, placed))
            assert sorted(theirs) == sorted(ours) and set(params[rank]) <= set(ours)
            for name, tensor in theirs.items():
                assert torch.equal(tensor, ours[name]), (rank, name)
        reference = make_engine("hf", model_path=str(model))
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        got, want = engine.generate(PROMPTS, greedy), reference.generate(PROMPTS, greedy)
        assert [s.response_ids for s in got.samples] == [s.response_ids for s in want.samples]
    finally:
        engine.shutdown()
