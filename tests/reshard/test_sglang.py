"""The SGLang side: loader rules on explicit examples, replicas, EPLB, bad settings."""

import dataclasses

import pytest

from hfschema.model import ModelConfig
from hfschema.sglang import SGLangSettings, pad_vocab
from reshard import sglang_layout
from tests.reshard.cases import TINY_MODELS


def _rows(layout, tensor):
    return {s.ranks: (s.region[0], s.param_region[0]) for s in layout.shards[tensor]}


@pytest.mark.claim("reshard-every-tensor-or-refused")
def test_kv_heads_replicated_when_tp_exceeds_them():
    # 8 query heads, 2 kv heads, head_dim 4, tp 8: 4 replicas per kv head; rank r loads kv head
    # r // 4 (QKVParallelLinear.weight_loader: shard_id = tp_rank // num_kv_head_replicas)
    model = ModelConfig(
        family="llama",
        hidden_size=32,
        num_layers=1,
        num_attention_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=16,
        vocab_size=64,
        num_experts=0,
    )
    dst = sglang_layout(model, SGLangSettings(tp=8))
    k = _rows(dst, "model.layers.0.self_attn.k_proj.weight")
    assert k == {(0, 1, 2, 3): ((0, 4), (4, 8)), (4, 5, 6, 7): ((4, 8), (4, 8))}
    q = _rows(dst, "model.layers.0.self_attn.q_proj.weight")
    assert q[(5,)] == ((20, 24), (0, 4))
    assert dst.param_shapes(5)["model.layers.0.self_attn.qkv_proj.weight"] == (12, 32)


def test_kv_heads_split_when_fewer_ranks():
    model = ModelConfig(
        family="llama",
        hidden_size=32,
        num_layers=1,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=16,
        vocab_size=64,
        num_experts=0,
    )
    dst = sglang_layout(model, SGLangSettings(tp=2))
    assert _rows(dst, "model.layers.0.self_attn.v_proj.weight") == {(0,): ((0, 8), (24, 32)), (1,): ((8, 16), (24, 32))}


@pytest.mark.parametrize(
    "vocab,parts,padded",
    [
        (100, 1, 128),
        (128, 2, 128),
        (190, 2, 192),
        (190, 4, 192),
        (190, 5, 320),
        (129280, 8, 129280),
        (151936, 8, 151936),
        (100, 3, 192),
        (32000, 8, 32000),
        (70, 8, 128),
    ],
)
def test_pad_vocab_mirrors_vocab_parallel_embedding(vocab, parts, padded):
    assert pad_vocab(vocab, parts) == padded


def test_vocab_rows_and_padding_only_rank():
    model = dataclasses.replace(TINY_MODELS["llama_tied"], vocab_size=70, tie_word_embeddings=False)
    # 8 heads; vocab 70 pads to 128 at tp 8: 16 rows a rank, ranks 5..7 hold only padding
    dst = sglang_layout(model, SGLangSettings(tp=8))
    rows = _rows(dst, "lm_head.weight")
    assert rows == {(r,): ((16 * r, 16 * r + 16), (0, 16)) for r in range(4)} | {(4,): ((64, 70), (0, 6))}
    assert dst.param_shapes(7)["lm_head.weight"] == (16, 16)  # only padding, still allocated


def test_dp_attention_and_engine_major_replicas():
    # tp 4 with dp_size 2: attention tp 2, rank r has attention rank r % 2; 2 engines
    model = TINY_MODELS["qwen3_moe"]
    dst = sglang_layout(model, SGLangSettings(tp=4, ep=2, enable_dp_attention=True, dp_size=2, num_replicas=2))
    o = {s.ranks: s.region for s in dst.shards["model.layers.0.self_attn.o_proj.weight"]}
    assert o == {(0, 2, 4, 6): ((0, 16), (0, 16)), (1, 3, 5, 7): ((0, 16), (16, 32))}
    # lm_head stays on the full tp group without --enable-dp-lm-head: 4 shards of 48 rows
    assert len(dst.shards["lm_head.weight"]) == 4
    # moe_tp = 4 / 2 = 2: expert 5 (ep rank 1, local 1) at moe_tp rank 0 -> local rank 2, 6
    gate = {s.ranks: s.param_region for s in dst.shards["model.layers.0.mlp.experts.5.gate_proj.weight"]}
    assert gate == {(2, 6): ((1, 2), (0, 4), (0, 16)), (3, 7): ((1, 2), (0, 4), (0, 16))}


@pytest.mark.claim("reshard-every-tensor-or-refused")
def test_eplb_redundant_expert_lands_on_several_ranks():
    model = TINY_MODELS["qwen3_moe_small"]  # 4 experts, moe_ffn 8
    row = (0, 1, 2, 3, 3, 0)  # 6 physical slots, 3 per ep rank: rank 1 holds experts 3, 3, 0
    dst = sglang_layout(model, SGLangSettings(tp=2, ep=2, physical_to_logical=(row,)))
    places = {(s.ranks, s.param_region[0]) for s in dst.shards["model.layers.1.mlp.experts.3.down_proj.weight"]}
    assert places == {((1,), (0, 1)), ((1,), (1, 2))}
    places = {(s.ranks, s.param_region[0]) for s in dst.shards["model.layers.1.mlp.experts.0.gate_proj.weight"]}
    assert places == {((0,), (0, 1)), ((1,), (2, 3))}
    assert dst.param_shapes(1)["model.layers.1.mlp.experts.w13_weight"] == (3, 16, 16)


def test_mixtral_has_no_redundant_expert_slots():
    # MixtralMoE builds FusedMoE(num_experts=num_local_experts): an EPLB map may permute the
    # experts but not add slots (the plan would address slots the engine never allocates)
    with pytest.raises(
        ValueError,
        match=r"6 physical experts for model.num_experts=4: SGLang's "
        r"mixtral MoE allocates no redundant expert slots",
    ):
        sglang_layout(TINY_MODELS["mixtral"], SGLangSettings(tp=2, ep=2, physical_to_logical=((0, 1, 2, 3, 3, 0),)))


@pytest.mark.claim("reshard-every-tensor-or-refused")
def test_moe_dp_is_refused():
    # SGLang 0.5.23 asserts "attn_cp_size != moe_dp_size is only supported when moe_dp_size == 1"
    # (arg_groups/parallel_hook.py) and hybridflow neither passes nor plans --attn-cp-size
    with pytest.raises(ValueError, match=r"sglang.moe_dp=2: .*set sglang.moe_dp=1"):
        SGLangSettings(tp=4, ep=2, moe_dp=2)


@pytest.mark.claim("reshard-every-tensor-or-refused")
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_tied_embeddings_are_refused_where_sglang_keeps_its_own_head(name):
    # Qwen3MoeForCausalLM / MixtralForCausalLM build a ParallelLMHead whatever
    # tie_word_embeddings says: the plan (embed_tokens only) would leave lm_head unwritten
    model = dataclasses.replace(TINY_MODELS[name], tie_word_embeddings=True)
    with pytest.raises(
        ValueError,
        match=rf"model.tie_word_embeddings=true: SGLang's {name} model "
        r"builds its own lm_head.weight",
    ):
        sglang_layout(model, SGLangSettings())


@pytest.mark.claim("reshard-every-tensor-or-refused")
def test_deepseek_gate_bias_is_required():
    # DeepSeek-V3's MoEGate (topk_method noaux_tc) always holds e_score_correction_bias
    model = dataclasses.replace(TINY_MODELS["deepseek_v3"], router_expert_bias=False)
    with pytest.raises(
        ValueError,
        match=r"model.router_expert_bias=false: SGLang's deepseek_v3 "
        r"gate always holds e_score_correction_bias",
    ):
        sglang_layout(model, SGLangSettings())


def test_mla_split_and_replicated_parts():
    model = TINY_MODELS["deepseek_v3"]  # q_lora 8, kv_lora 8, rope 4, 4 heads
    dst = sglang_layout(model, SGLangSettings(tp=2))
    (kv_a,) = dst.shards["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.param == "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
    assert kv_a.ranks == (0, 1) and kv_a.param_region == ((8, 20), (0, 16))
    assert len(dst.shards["model.layers.0.self_attn.kv_b_proj.weight"]) == 2
    # shared experts and the dense first layer are split over tp
    assert len(dst.shards["model.layers.1.mlp.shared_experts.up_proj.weight"]) == 2
    assert len(dst.shards["model.layers.0.mlp.down_proj.weight"]) == 2
    (bias,) = dst.shards["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert dst.tensors[bias.tensor].dtype == "float32"


def test_tp_not_dividing_heads_lists_valid_values():
    model = TINY_MODELS["qwen3_moe"]  # 4 heads, 2 kv heads
    with pytest.raises(
        ValueError,
        match=r"sglang.tp=3 .* model.num_attention_heads=4 and "
        r"model.num_kv_heads=2 .* "
        r"valid sglang.tp values: 1, 2, 4",
    ):
        sglang_layout(model, SGLangSettings(tp=3))
    llama = ModelConfig(
        family="llama",
        hidden_size=48,
        num_layers=1,
        num_attention_heads=12,
        num_kv_heads=4,
        ffn_hidden_size=48,
        vocab_size=64,
        num_experts=0,
    )
    with pytest.raises(ValueError, match=r"valid sglang.tp values: 1, 2, 4, 12$"):
        sglang_layout(llama, SGLangSettings(tp=8))


def test_experts_not_divisible_by_ep():
    model = TINY_MODELS["qwen3_moe_small"]  # 4 experts
    with pytest.raises(ValueError, match=r"sglang.ep=8 does not divide the 4 physical experts"):
        sglang_layout(model, SGLangSettings(tp=8, ep=8))


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(tp=2, dp_size=2), "needs sglang.enable_dp_attention=true"),
        (dict(tp=4, ep=3), r"sglang.ep\*moe_dp = 3\*1 must divide sglang.tp=4"),
        (dict(tp=2, dp_size=4, enable_dp_attention=True), "dp_size=4 must divide sglang.tp=2"),
    ],
)
def test_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        SGLangSettings(**settings)


def test_bad_settings_for_the_model():
    with pytest.raises(ValueError, match="enable_dp_attention=true: SGLang builds llama"):
        sglang_layout(TINY_MODELS["llama"], SGLangSettings(tp=2, enable_dp_attention=True, dp_size=2))
    with pytest.raises(ValueError, match="covering every logical expert"):
        sglang_layout(TINY_MODELS["mixtral"], SGLangSettings(physical_to_logical=((0, 1, 2, 2),)))
    with pytest.raises(
        ValueError,
        match=r"moe_tp = sglang.tp/ep/moe_dp=4 does not divide "
        r"model.moe_ffn_hidden_size=6",
    ):
        sglang_layout(dataclasses.replace(TINY_MODELS["qwen3_moe"], moe_ffn_hidden_size=6), SGLangSettings(tp=4))
