"""ParallelLayout: arithmetic, immutability and every validation rule."""

import dataclasses

import pytest

from hfschema.layout import ConfigError, ParallelLayout, divisors
from hfschema.model import ModelConfig


def _moe(**overrides) -> ModelConfig:
    base = dict(
        family="qwen3_moe",
        hidden_size=64,
        num_layers=4,
        num_attention_heads=16,
        num_kv_heads=4,
        ffn_hidden_size=128,
        num_experts=8,
        moe_ffn_hidden_size=32,
    )
    return ModelConfig(**{**base, **overrides})


def _dense(**overrides) -> ModelConfig:
    base = dict(
        family="llama",
        hidden_size=64,
        num_layers=4,
        num_attention_heads=16,
        num_kv_heads=4,
        ffn_hidden_size=128,
        num_experts=0,
    )
    return ModelConfig(**{**base, **overrides})


def _mla(**overrides) -> ModelConfig:
    base = dict(
        family="deepseek_v3",
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=128,
        num_experts=8,
        moe_ffn_hidden_size=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )
    return ModelConfig(**{**base, **overrides})


def test_defaults_are_a_single_rank():
    layout = ParallelLayout()
    assert (layout.world_size, layout.expert_dp) == (1, 1)


@pytest.mark.parametrize(
    "axes, world_size, expert_dp",
    [
        (dict(tp=2, dp=2, ep=2), 4, 2),
        (dict(tp=4, pp=2, ep=8, dp=8), 64, 4),  # a 235B MoE layout on 64 GPUs
        (dict(tp=8, ep=64, dp=8), 64, 1),  # a 671B MoE layout on 64 GPUs
        (dict(tp=2, cp=2, dp=2, ep=4, etp=2), 8, 1),
        (dict(tp=2, pp=2, vpp=2, dp=2, ep=2), 8, 2),
    ],
)
def test_world_size_and_expert_dp(axes, world_size, expert_dp):
    layout = ParallelLayout(**axes)
    assert layout.world_size == world_size
    assert layout.expert_dp == expert_dp
    # the dense and expert grids cover the same ranks
    assert layout.etp * layout.ep * layout.expert_dp * layout.pp == layout.world_size


def test_is_frozen():
    layout = ParallelLayout(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 4  # type: ignore[misc]


def test_describe():
    assert ParallelLayout(tp=2, ep=2, dp=2).describe() == (
        "tp=2 pp=1 vpp=1 ep=2 etp=1 cp=1 dp=2 (world 4, expert_dp 2)"
    )


@pytest.mark.parametrize("axis", ["tp", "pp", "vpp", "ep", "etp", "cp", "dp"])
def test_axes_must_be_positive(axis):
    with pytest.raises(ValueError, match=rf"^{axis}=0 must be >= 1$"):
        ParallelLayout(**{axis: 0})


def test_error_prefix_is_added_by_under():
    with pytest.raises(ConfigError) as info:
        ParallelLayout(tp=-1)
    assert str(info.value.under("actor.parallel")) == "actor.parallel.tp=-1 must be >= 1"


def test_vpp_needs_pp():
    with pytest.raises(ValueError, match=r"vpp=2 needs pipeline parallelism"):
        ParallelLayout(vpp=2)


def test_expert_grid_must_divide_world():
    expected = r"etp\*ep\*pp = 1\*3\*1 = 3 does not divide the world size .* = 4"
    with pytest.raises(ValueError, match=expected):
        ParallelLayout(dp=4, ep=3)


def test_check_world_size():
    layout = ParallelLayout(tp=2)
    layout.check_world_size(2)
    with pytest.raises(ValueError) as info:
        layout.check_world_size(4, prefix="actor.parallel")
    assert str(info.value) == ("world size 4 does not match actor.parallel: tp*pp*cp*dp = 2*1*1*1 = 2")


def test_check_model_accepts_valid_layout():
    ParallelLayout(tp=4, pp=2, ep=8, dp=2).check_model(_moe())


def test_tp_must_divide_heads():
    with pytest.raises(ValueError) as info:
        ParallelLayout(tp=3).check_model(_moe(), prefix="actor.parallel")
    message = str(info.value)
    assert "actor.parallel.tp=3 does not divide model.num_attention_heads=16" in message
    assert "valid tp values: 1, 2, 4" in message


def test_tp_must_divide_kv_heads():
    with pytest.raises(ValueError, match=r"tp=8 does not divide model.num_kv_heads=4"):
        ParallelLayout(tp=8).check_model(_moe())


def test_mla_only_needs_tp_to_divide_heads():
    ParallelLayout(tp=8, ep=8).check_model(_mla(num_kv_heads=1))


def test_tp_must_divide_dense_ffn():
    with pytest.raises(ValueError, match=r"tp=4 does not divide model.ffn_hidden_size=18"):
        ParallelLayout(tp=4).check_model(_dense(ffn_hidden_size=18))


def test_moe_without_dense_layers_ignores_ffn_hidden_size():
    ParallelLayout(tp=4).check_model(_moe(ffn_hidden_size=18))


def test_pp_times_vpp_must_divide_layers():
    with pytest.raises(ValueError, match=r"pp\*vpp = 2\*4 = 8 does not divide model.num_layers=4"):
        ParallelLayout(pp=2, vpp=4).check_model(_moe())


def test_ep_must_divide_experts():
    with pytest.raises(ValueError) as info:
        ParallelLayout(ep=3, dp=3).check_model(_moe(), prefix="actor.parallel")
    message = str(info.value)
    assert "actor.parallel.ep=3 does not divide model.num_experts=8" in message
    assert "valid ep values: 1, 2, 4, 8" in message


def test_ep_needs_moe_model():
    with pytest.raises(ValueError, match=r"ep=2 and parallel.etp=1 need an MoE model"):
        ParallelLayout(ep=2, dp=2).check_model(_dense())


def test_etp_must_divide_moe_ffn():
    with pytest.raises(ValueError, match=r"etp=3 does not divide model.moe_ffn_hidden_size=32"):
        ParallelLayout(etp=3, dp=3).check_model(_moe())


def test_cp_is_allowed():
    ParallelLayout(cp=4).check_model(_moe())


def test_padded_vocab_size():
    model = _moe(vocab_size=151936)
    assert ParallelLayout().padded_vocab_size(model) == 151936
    assert ParallelLayout(tp=4).padded_vocab_size(model) == 152064
    assert ParallelLayout(tp=8).padded_vocab_size(model, divisible_by=64) == 152064


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(16) == [1, 2, 4, 8, 16]
    assert divisors(94) == [1, 2, 47, 94]
