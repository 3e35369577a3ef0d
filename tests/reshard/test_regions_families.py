"""Region arithmetic and the family registry."""

import pytest

from hfschema.model import ModelConfig
from reshard import FAMILIES, canonical_tensors
from reshard.megatron import MEGATRON_RULES
from reshard.regions import intersect, map_into, num_elements, split_even
from reshard.sglang import SGLANG_RULES
from tests.reshard.cases import TINY_MODELS


def test_region_arithmetic():
    assert intersect(((0, 4), (0, 8)), ((2, 6), (8, 9))) is None
    assert intersect(((0, 4), (0, 8)), ((2, 6), (3, 9))) == ((2, 4), (3, 8))
    assert num_elements(((2, 4), (3, 8))) == 10
    assert split_even(12, 3, 2) == (8, 12)
    # a box of gate_proj[I, H] at rows 4:8 of expert slot 2 of w13[E, 2I, H]
    box, param_box = ((4, 8), (0, 16)), ((2, 3), (8, 12), (0, 16))
    assert map_into(((5, 7), (4, 6)), box, param_box) == ((2, 3), (9, 11), (4, 6))


def test_every_placement_names_an_existing_rule():
    for family in FAMILIES.values():
        for spec in family.tensors:
            assert spec.sglang.rule in SGLANG_RULES, spec.hf
            for placement in spec.megatron:
                assert placement.rule in MEGATRON_RULES, spec.hf


def test_deepseek_names_on_both_sides():
    spec = {s.hf: s for s in FAMILIES["deepseek_v3"].tensors}
    kv_a = spec["model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"]
    mq = "decoder.layers.{layer}.self_attention"
    assert kv_a.megatron[0].param == f"{mq}.linear_kv_down_proj.weight"
    gate = spec["model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"]
    assert gate.megatron[0].param == "decoder.layers.{layer}.mlp.experts.local_experts.{local}.linear_fc1.weight"
    assert gate.sglang.param == "model.layers.{layer}.mlp.experts.w13_weight"
    norm = spec["model.layers.{layer}.input_layernorm.weight"]
    assert norm.megatron[0].te_param == f"{mq}.linear_qkv.layer_norm_weight"


def test_tensor_counts():
    m = TINY_MODELS["deepseek_v3"]  # 3 layers, first dense, 8 experts, 1 shared
    names = [t.name for t in canonical_tensors(m)]
    assert len(names) == len(set(names))
    per_layer = 2 + 7  # norms + MLA (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o)
    moe_layer = 2 + 3 + 3 * 8  # router + bias, shared gate/up/down, experts
    assert len(names) == 3 + 3 * per_layer + 3 + 2 * moe_layer


def test_unknown_dtype():
    with pytest.raises(ValueError, match="dtype='int3' is not one of"):
        canonical_tensors(ModelConfig(), dtype="int3")
