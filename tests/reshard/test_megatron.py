"""The Megatron side: rank order, pipeline stages, shard partitions, bad input."""

import ast
import math
import random
from pathlib import Path

import pytest

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from reshard import PipelineSplit, dense_rank, expert_rank, layer_stages, megatron_layout
from reshard.regions import intersect, num_elements
from tests.reshard.cases import TINY_MODELS, random_megatron

# tp=2 cp=1 dp=2 pp=2, ep=2 etp=1 (expert_dp = 8 / (1*2*2) = 2), written out by hand from
# megatron-core's order "tp-cp-ep-dp-pp" (tp fastest):
#   rank: (tp, dp, pp) dense        (etp, ep, edp, pp) expert
DENSE_TABLE = {
    0: (0, 0, 0),
    1: (1, 0, 0),
    2: (0, 1, 0),
    3: (1, 1, 0),
    4: (0, 0, 1),
    5: (1, 0, 1),
    6: (0, 1, 1),
    7: (1, 1, 1),
}
EXPERT_TABLE = {
    0: (0, 0, 0, 0),
    1: (0, 1, 0, 0),
    2: (0, 0, 1, 0),
    3: (0, 1, 1, 0),
    4: (0, 0, 0, 1),
    5: (0, 1, 0, 1),
    6: (0, 0, 1, 1),
    7: (0, 1, 1, 1),
}


def test_rank_order_matches_the_explicit_table():
    layout = ParallelLayout(tp=2, pp=2, dp=2, ep=2)
    for rank, (tp, dp, pp) in DENSE_TABLE.items():
        assert dense_rank(layout, tp=tp, dp=dp, pp=pp) == rank
    for rank, (etp, ep, edp, pp) in EXPERT_TABLE.items():
        assert expert_rank(layout, etp=etp, ep=ep, edp=edp, pp=pp) == rank


def _megatron_rank_generator():
    """megatron-core's own RankGenerator, taken from its source without importing torch."""
    site = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages"
    path = site / "megatron/core/parallel_state.py"
    if not path.exists():
        pytest.skip("megatron-core is not installed in .venv")
    tree = ast.parse(path.read_text())
    wanted = {"generate_masked_orthogonal_rank_groups", "RankGenerator"}
    module = ast.Module(body=[n for n in tree.body if getattr(n, "name", None) in wanted], type_ignores=[])
    namespace = {"List": list}
    exec(compile(module, str(path), "exec"), namespace)
    return namespace["RankGenerator"]


@pytest.mark.parametrize(
    "tp,cp,dp,pp,ep,etp",
    [
        (2, 1, 2, 2, 2, 1),
        (2, 2, 2, 1, 4, 1),
        (1, 1, 8, 2, 4, 2),
        (4, 1, 2, 2, 2, 4),
        (2, 1, 4, 1, 8, 1),
    ],
)
def test_rank_order_matches_megatron_rank_generator(tp, cp, dp, pp, ep, etp):
    generator = _megatron_rank_generator()
    layout = ParallelLayout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)
    order = "tp-cp-ep-dp-pp"
    dense = generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = generator(tp=etp, ep=ep, dp=layout.expert_dp, pp=pp, cp=1, order=order)
    ours_tp = sorted(
        sorted(dense_rank(layout, tp=t, cp=c, dp=d, pp=p) for t in range(tp))
        for c in range(cp)
        for d in range(dp)
        for p in range(pp)
    )
    assert ours_tp == sorted(dense.get_ranks("tp"))
    ours_dp = sorted(
        sorted(dense_rank(layout, tp=t, cp=c, dp=d, pp=p) for d in range(dp))
        for t in range(tp)
        for c in range(cp)
        for p in range(pp)
    )
    assert ours_dp == sorted(dense.get_ranks("dp"))
    ours_ep = sorted(
        sorted(expert_rank(layout, etp=t, ep=e, edp=d, pp=p) for e in range(ep))
        for t in range(etp)
        for d in range(layout.expert_dp)
        for p in range(pp)
    )
    assert ours_ep == sorted(expert.get_ranks("ep"))
    ours_etp = sorted(
        sorted(expert_rank(layout, etp=t, ep=e, edp=d, pp=p) for t in range(etp))
        for e in range(ep)
        for d in range(layout.expert_dp)
        for p in range(pp)
    )
    assert ours_etp == sorted(expert.get_ranks("tp"))
    assert sorted(expert.get_ranks("pp")) == sorted(dense.get_ranks("pp"))


def test_layer_stages_interleaved_and_uneven():
    model = ModelConfig(family="llama", num_layers=8, num_experts=0)
    assert layer_stages(model, ParallelLayout(pp=2, vpp=2)) == (0, 0, 1, 1, 0, 0, 1, 1)
    assert layer_stages(model, ParallelLayout(pp=2)) == (0,) * 4 + (1,) * 4
    assert layer_stages(model, ParallelLayout(pp=4, vpp=2)) == (0, 1, 2, 3, 0, 1, 2, 3)
    model61 = ModelConfig(family="llama", num_layers=61, num_experts=0)
    split = PipelineSplit(num_layers_in_first_pipeline_stage=4, num_layers_in_last_pipeline_stage=1)
    stages = layer_stages(model61, ParallelLayout(pp=16), split)
    assert [stages.count(p) for p in range(16)] == [4] + [4] * 14 + [1]
    assert stages == tuple(sorted(stages))


def test_stage_ownership_of_embedding_head_and_layers():
    model = TINY_MODELS["llama_tied"]  # tied, 2 layers
    src = megatron_layout(model, ParallelLayout(pp=2, dp=2))
    # stage 0 = ranks 0,1 (embedding + layer 0); stage 1 = ranks 2,3 (layer 1, norm, tied copy)
    embed = src.shards["model.embed_tokens.weight"]
    assert {(s.param, s.ranks) for s in embed} == {
        ("embedding.word_embeddings.weight", (0, 1)),
        ("output_layer.weight", (2, 3)),
    }
    assert src.shards["model.norm.weight"][0].ranks == (2, 3)
    assert src.shards["model.layers.0.input_layernorm.weight"][0].ranks == (0, 1)
    assert src.shards["model.layers.1.input_layernorm.weight"][0].ranks == (2, 3)
    no_pp = megatron_layout(model, ParallelLayout(dp=2))
    assert {s.param for s in no_pp.shards["model.embed_tokens.weight"]} == {"embedding.word_embeddings.weight"}


def test_qkv_interleaving_and_expert_ownership():
    model = TINY_MODELS["qwen3_moe"]  # 4 heads, 2 kv heads, head_dim 8, 8 experts
    src = megatron_layout(model, ParallelLayout(tp=2, ep=4, dp=2))
    # tp rank 1 holds query group 1: q heads 2,3 (rows 16:32), k head 1, v head 1;
    # its linear_qkv rows are [q(16) k(8) v(8)]
    q, k, v = (
        {s.ranks: (s.region[0], s.param_region[0]) for s in src.shards[f"model.layers.0.self_attn.{x}_proj.weight"]}
        for x in "qkv"
    )
    assert q[(1, 3)] == ((16, 32), (0, 16)) and k[(1, 3)] == ((8, 16), (16, 24))
    assert v[(1, 3)] == ((8, 16), (24, 32))
    # experts: 8 / ep 4 = 2 per ep rank; expert 5 = local 1 of ep rank 2 = ranks 2 (edp 0)
    (shard,) = src.shards["model.layers.1.mlp.experts.5.up_proj.weight"]
    assert shard.param == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert shard.ranks == (2,) and shard.param_region == ((8, 16), (0, 16))


@pytest.mark.parametrize("seed", range(12))
def test_each_copy_partitions_every_tensor(seed):
    rng = random.Random(seed)
    name = list(TINY_MODELS)[seed % len(TINY_MODELS)]
    model = TINY_MODELS[name]
    layout, split = random_megatron(rng, model)
    src = megatron_layout(model, layout, split=split)
    for tensor, shards in src.shards.items():
        size = math.prod(src.tensors[tensor].shape)
        by_param_kind = {}
        for s in shards:  # copies differ by parameter (tied embedding / output layer)
            by_param_kind.setdefault(s.param.split(".")[0], []).append(s)
        for group in by_param_kind.values():
            assert sum(num_elements(s.region) for s in group) == size, tensor
            for i, a in enumerate(group):
                assert all(intersect(a.region, b.region) is None for b in group[i + 1 :]), tensor
        holders = {r for s in shards for r in s.ranks}
        assert holders <= set(range(layout.world_size))


def test_bad_source_layouts_are_refused():
    model = TINY_MODELS["qwen3_moe"]  # 8 experts, 4 layers
    with pytest.raises(ValueError, match=r"source.ep=3 does not divide model.num_experts=8"):
        megatron_layout(model, ParallelLayout(ep=3, dp=3))
    with pytest.raises(ValueError, match=r"source.tp=4 does not divide model.num_kv_heads=2"):
        megatron_layout(model, ParallelLayout(tp=4))
    with pytest.raises(ValueError, match="leave 1 of model.num_layers=4 layers for 2 middle"):
        megatron_layout(model, ParallelLayout(pp=3), split=PipelineSplit(num_layers_in_first_pipeline_stage=3))
    with pytest.raises(ValueError, match="vpp=2 with an uneven pipeline split"):
        megatron_layout(model, ParallelLayout(pp=2, vpp=2), split=PipelineSplit(num_layers_in_first_pipeline_stage=1))
