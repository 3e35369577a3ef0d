"""Routers of a converted model: transformers' gate against megatron-core's routing, token by token.

Each case is a Hugging Face ``config.json`` of a tiny MoE model. The Hugging Face side is
transformers' own router module of the family, built from that config with random weights (and a
random ``e_score_correction_bias`` for DeepSeek-V3); the megatron side is megatron-core's
``topk_routing_with_score_function`` called as ``TopKRouter.routing`` calls it, with the
``TransformerConfig`` that ``megatron_adapters.model.transformer_config`` builds from the
``ModelConfig`` that ``hfschema.hf_config`` reads from the same config. Both get the same logits
(transformers' router returns them), so the chosen experts and their weights must agree exactly:

    equal    read as is; same experts, weights within float32 rounding
    mapped   read into other megatron settings (every group chosen -> no groups); then equal
    differs  refused, naming the config.json and megatron keys; and the straight mapping the
             reader made before (n_group -> moe_router_num_groups, norm_topk_prob ignored) is
             shown to choose other experts or weights

Legend: N tokens, D hidden size, E experts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hfschema.hf_config import read_model_config
from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig

# the CPU patches go in before megatron-core is imported
# isort: off
import megatron_adapters.cpu_compat  # noqa: F401  (megatron-core on the CPU)
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron_adapters.model import transformer_config
# isort: on

N, D = 512, 32

_QWEN3 = dict(
    hidden_size=D,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    vocab_size=64,
)
_MIXTRAL = dict(
    hidden_size=D,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=8,
    vocab_size=64,
)
_DEEPSEEK = dict(
    hidden_size=D,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    vocab_size=64,
    routed_scaling_factor=2.5,
)

CASES = {
    # Qwen3-MoE: softmax -> top-k -> renormalise iff norm_topk_prob (modeling_qwen3_moe.py:257-266);
    # megatron: top-k -> softmax (pre_softmax off) or softmax -> top-k (pre_softmax on); at top-1
    # its TransformerConfig demands pre_softmax, whose weight p is not the renormalised 1.0
    "qwen3_moe-norm-k2": ("qwen3_moe", dict(num_experts_per_tok=2, norm_topk_prob=True), "equal"),
    "qwen3_moe-nonorm-k2": ("qwen3_moe", dict(num_experts_per_tok=2, norm_topk_prob=False), "equal"),
    "qwen3_moe-norm-k1": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=True), "differs"),
    "qwen3_moe-nonorm-k1": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=False), "equal"),
    # Mixtral: softmax -> top-k -> always renormalise (modeling_mixtral.py:103-110)
    "mixtral-k2": ("mixtral", dict(num_experts_per_tok=2), "equal"),
    "mixtral-k1": ("mixtral", dict(num_experts_per_tok=1), "differs"),
    # DeepSeek-V3: sigmoid + bias -> groups by the sum of their top 2 -> top-k of the chosen groups
    # -> unbiased weights, renormalised iff norm_topk_prob, x routed_scaling_factor
    # (modeling_deepseek_v3.py:133-158)
    "deepseek-groups-k4-of-2": ("deepseek_v3", dict(num_experts_per_tok=4, n_group=4, topk_group=2), "equal"),
    "deepseek-groups-k5-of-2": ("deepseek_v3", dict(num_experts_per_tok=5, n_group=4, topk_group=2), "equal"),
    "deepseek-groups-k4-of-2-scale1": (
        "deepseek_v3",
        dict(num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=1.0),
        "equal",
    ),
    "deepseek-nonorm-k1": (
        "deepseek_v3",
        dict(num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=False),
        "equal",
    ),
    "deepseek-one-group": ("deepseek_v3", dict(num_experts_per_tok=4, n_group=1, topk_group=1), "mapped"),
    "deepseek-all-groups": ("deepseek_v3", dict(num_experts_per_tok=3, n_group=4, topk_group=4), "mapped"),
    "deepseek-groups-k2-of-2": ("deepseek_v3", dict(num_experts_per_tok=2, n_group=4, topk_group=2), "differs"),
    "deepseek-groups-k4-of-1": ("deepseek_v3", dict(num_experts_per_tok=4, n_group=4, topk_group=1), "differs"),
    "deepseek-groups-k8-of-1": ("deepseek_v3", dict(num_experts_per_tok=8, n_group=2, topk_group=1), "differs"),
    "deepseek-nonorm-k2": (
        "deepseek_v3",
        dict(num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=False),
        "differs",
    ),
    "deepseek-norm-k1": (
        "deepseek_v3",
        dict(num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=True),
        "differs",
    ),
}
"""name -> (family, router settings of its config.json, expected verdict)."""


def _hf_config(family: str, settings: dict):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    cls, base = {
        "qwen3_moe": (Qwen3MoeConfig, _QWEN3),
        "mixtral": (MixtralConfig, _MIXTRAL),
        "deepseek_v3": (DeepseekV3Config, _DEEPSEEK),
    }[family]
    return cls(**{**base, **settings})


def _hf_router(config, seed: int) -> torch.nn.Module:
    """transformers' router module of the family, with random weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls = {"qwen3_moe": Qwen3MoeTopKRouter, "mixtral": MixtralTopKRouter, "deepseek_v3": DeepseekV3TopkRouter}[
        config.model_type
    ]
    g = torch.Generator().manual_seed(seed)
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):  # negative values too: -inf masks must hold
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.num_experts, generator=g))
    return router


def _dense(weights_Nk: torch.Tensor, experts_Nk: torch.Tensor, num_experts: int):
    probs_NE = torch.zeros(weights_Nk.shape[0], num_experts).scatter(1, experts_Nk, weights_Nk.float())
    map_NE = torch.zeros(weights_Nk.shape[0], num_experts, dtype=torch.bool).scatter(1, experts_Nk, True)
    return probs_NE, map_NE


def _hf_route(router: torch.nn.Module, seed: int):
    """(logits_NE, probs_NE, map_NE) of transformers' router on random tokens."""
    tokens_ND = torch.randn(N, D, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        logits_NE, weights_Nk, experts_Nk = router(tokens_ND)
    return (logits_NE.float(), *_dense(weights_Nk, experts_Nk, router.num_experts))


def _megatron_route(logits_NE: torch.Tensor, bias_E: torch.Tensor | None, **settings):
    probs_NE, map_NE = topk_routing_with_score_function(
        logits_NE, fused=False, router_replay=None, expert_bias=bias_E, **settings
    )
    return probs_NE, map_NE


def _as_router_routes(model: ModelConfig, logits_NE: torch.Tensor, bias_E: torch.Tensor | None):
    """megatron-core's routing with the TransformerConfig megatron_adapters builds (as in
    ``TopKRouter.routing``, megatron/core/transformer/moe/router.py)."""
    c = transformer_config(model, ParallelLayout())
    return _megatron_route(
        logits_NE,
        bias_E if c.moe_router_enable_expert_bias else None,
        topk=c.moe_router_topk,
        use_pre_softmax=c.moe_router_pre_softmax,
        num_groups=c.moe_router_num_groups,
        group_topk=c.moe_router_group_topk,
        scaling_factor=c.moe_router_topk_scaling_factor,
        score_function=c.moe_router_score_function,
    )


def _straight_routes(config, logits_NE: torch.Tensor, bias_E: torch.Tensor | None):
    """The nearest megatron-core settings: for DeepSeek-V3 what its reader mapped before it refused
    anything (n_group / topk_group onto megatron's groups as they stand, norm_topk_prob dropped:
    megatron has no switch); for a top-1 softmax router the pre-softmax megatron-core insists on."""
    if config.model_type != "deepseek_v3":
        return _megatron_route(logits_NE, None, topk=1, use_pre_softmax=True, score_function="softmax")
    groups = config.n_group if config.n_group > 1 else None
    return _megatron_route(
        logits_NE,
        bias_E,
        topk=config.num_experts_per_tok,
        use_pre_softmax=False,
        num_groups=groups,
        group_topk=config.topk_group if groups else None,
        scaling_factor=config.routed_scaling_factor,
        score_function="sigmoid",
    )


def _write(tmp_path: Path, config) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return tmp_path


@pytest.mark.claim("router-rules")
@pytest.mark.parametrize("name", list(CASES))
def test_router_is_equal_mapped_or_refused(name, tmp_path):
    family, settings, verdict = CASES[name]
    config = _hf_config(family, settings)
    router = _hf_router(config, seed=len(name))
    logits_NE, hf_probs_NE, hf_map_NE = _hf_route(router, seed=len(name))
    bias_E = getattr(router, "e_score_correction_bias", None)
    if verdict == "differs":
        with pytest.raises(
            ValueError,
            match=r"config\.json: .*\(config\.json .*num_experts_per_tok.*; "
            r"megatron-core moe_router_topk",
        ):
            read_model_config(_write(tmp_path, config))
        probs_NE, map_NE = _straight_routes(config, logits_NE, bias_E)
        assert not (torch.equal(map_NE, hf_map_NE) and torch.allclose(probs_NE, hf_probs_NE)), name
        return
    model = read_model_config(_write(tmp_path, config))
    if verdict == "mapped":
        assert (model.router_num_groups, model.router_group_topk) == (None, None)
    elif "groups" in name:  # group-limited routing stays on, and changes the routes
        assert (model.router_num_groups, model.router_group_topk) == (config.n_group, config.topk_group)
        ungrouped = dataclasses.replace(model, router_num_groups=None, router_group_topk=None)
        assert not torch.equal(_as_router_routes(ungrouped, logits_NE, bias_E)[1], hf_map_NE)
    probs_NE, map_NE = _as_router_routes(model, logits_NE, bias_E)
    assert torch.equal(map_NE, hf_map_NE), name
    torch.testing.assert_close(probs_NE, hf_probs_NE, rtol=1e-6, atol=1e-7)


def test_group_refusal_names_every_key(tmp_path):
    config = _hf_config("deepseek_v3", dict(num_experts_per_tok=2, n_group=4, topk_group=2))
    with pytest.raises(ValueError) as info:
        read_model_config(_write(tmp_path, config))
    message = str(info.value)
    assert "\n" not in message and "moe_top_k=2, router_group_topk=2, router_num_groups=4" in message
    for key in (
        "num_experts_per_tok, topk_group, n_group",
        "moe_router_topk, moe_router_group_topk, moe_router_num_groups",
        "only moe_top_k // router_group_topk = 2",
    ):
        assert key in message


def test_absent_router_keys_read_as_transformers_defaults(tmp_path):
    from transformers import DeepseekV3Config

    config = _hf_config("deepseek_v3", dict(num_experts_per_tok=8, num_hidden_layers=4))
    raw = config.to_dict()
    for key in (
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "n_shared_experts",
        "first_k_dense_replace",
    ):
        raw.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model, defaults = read_model_config(tmp_path), DeepseekV3Config()
    assert (model.router_num_groups, model.router_group_topk) == (defaults.n_group, defaults.topk_group)
    assert model.router_topk_scaling_factor == defaults.routed_scaling_factor
    assert model.norm_topk_prob is defaults.norm_topk_prob
    assert model.num_shared_experts == defaults.n_shared_experts
    assert model.first_k_dense_layers == defaults.first_k_dense_replace


def test_mixtral_router_jitter_is_refused(tmp_path):
    config = _hf_config("mixtral", dict(num_experts_per_tok=2, router_jitter_noise=0.01))
    with pytest.raises(
        ValueError,
        match=r"config\.json: router_jitter_noise=0\.01: .*only "
        r"router_jitter_noise=0\.0 maps",
    ):
        read_model_config(_write(tmp_path, config))


@pytest.mark.claim("router-rules")
def test_yaml_model_section_is_refused_by_the_same_rules():
    from hybridflow.config import load_config

    with pytest.raises(
        ValueError,
        match=r"model\.moe_top_k=4, model\.router_group_topk=4, "
        r"model\.router_num_groups=8 \(config\.json",
    ):
        load_config("configs/grpo_deepseek_v3_671b.yaml", ["model.moe_top_k=4"])
    with pytest.raises(ValueError, match=r"model\.norm_topk_prob=false, model\.moe_top_k=8 "):
        load_config("configs/grpo_deepseek_v3_671b.yaml", ["model.norm_topk_prob=false"])
