"""Planner layout -> engine layout: the CPU padding rules, and that padding changes no output."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.rollout.sglang.padding import to_engine_layout

E, H, I_LOCAL, P = 3, 8, 4, 6  # experts, hidden, real rows per rank, padded rows per rank


def test_matching_shape_is_returned_as_is():
    t = torch.randn(4, 8)
    assert to_engine_layout("model.layers.0.self_attn.qkv_proj.weight", t, (4, 8)) is t


def test_w13_gets_zero_rows_after_each_half():
    w13 = torch.randn(E, 2 * I_LOCAL, H)
    out = to_engine_layout("model.layers.0.mlp.experts.w13_weight", w13, (E, 2 * P, H))
    assert torch.equal(out[:, :I_LOCAL], w13[:, :I_LOCAL])  # gate
    assert torch.equal(out[:, P : P + I_LOCAL], w13[:, I_LOCAL:])  # up
    assert not out[:, I_LOCAL:P].any() and not out[:, P + I_LOCAL :].any()


def test_dense_gate_up_follows_the_same_rule():
    gate_up = torch.randn(2 * I_LOCAL, H)
    out = to_engine_layout("model.layers.1.mlp.gate_up_proj.weight", gate_up, (2 * P, H))
    assert torch.equal(out[P : P + I_LOCAL], gate_up[I_LOCAL:])


@pytest.mark.parametrize(
    "name,shape,padded,dim",
    [
        ("model.layers.0.mlp.experts.w2_weight", (E, H, I_LOCAL), (E, H, P), 2),
        ("model.layers.0.mlp.down_proj.weight", (H, I_LOCAL), (H, P), 1),
        ("model.embed_tokens.weight", (100, H), (128, H), 0),
        ("lm_head.weight", (100, H), (128, H), 0),
    ],
)
def test_tail_padding(name, shape, padded, dim):
    t = torch.randn(shape)
    out = to_engine_layout(name, t, padded)
    assert torch.equal(out.narrow(dim, 0, shape[dim]), t)
    assert not out.narrow(dim, shape[dim], padded[dim] - shape[dim]).any()


def test_padded_expert_computes_the_same_output():
    x = torch.randn(5, H)
    w13, w2 = torch.randn(2 * I_LOCAL, H), torch.randn(H, I_LOCAL)

    def expert(w13, w2):
        gate, up = w13.chunk(2)
        return (F.silu(x @ gate.T) * (x @ up.T)) @ w2.T

    padded13 = to_engine_layout("experts.w13_weight", w13[None], (1, 2 * P, H))[0]
    padded2 = to_engine_layout("experts.w2_weight", w2[None], (1, H, P))[0]
    assert torch.allclose(expert(padded13, padded2), expert(w13, w2), atol=1e-6)


@pytest.mark.parametrize(
    "name,shape,engine_shape",
    [
        ("model.layers.0.self_attn.o_proj.weight", (8, 3), (8, 4)),  # the engine pads no dim of o_proj
        ("model.layers.0.self_attn.qkv_proj.weight", (12, 8), (16, 8)),  # padded heads: unsupported
        ("model.layers.0.mlp.experts.w2_weight", (E, H - 1, I_LOCAL), (E, H, P)),  # wrong dim grows
        ("model.layers.0.mlp.experts.w2_weight", (E, H, P + 1), (E, H, P)),  # shrinking
        ("model.layers.0.mlp.experts.w13_weight", (E + 1, 2 * I_LOCAL, H), (E, 2 * P, H)),
        ("model.layers.0.mlp.experts.w13_weight", (E, 2 * I_LOCAL, H), (E, 2 * P + 1, H)),  # odd
        ("model.embed_tokens.weight", (100, H), (128,)),
    ],
)
def test_shapes_no_rule_reaches_are_refused_by_name(name, shape, engine_shape):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        to_engine_layout(name, torch.zeros(shape), engine_shape)


def test_meta_tensors_check_without_allocating():
    out = to_engine_layout("x.mlp.experts.w13_weight", torch.empty(E, 2 * I_LOCAL, H, device="meta"), (E, 2 * P, H))
    assert out.is_meta and out.shape == (E, 2 * P, H)
