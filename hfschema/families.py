"""The model families, each registered once: everything the project knows about an architecture.

A ``Family`` record says, for one Hugging Face ``model_type``, how its ``config.json`` reads into
``ModelConfig`` and is written back, which settings the architecture fixes (and why), which
router settings megatron-core computes differently, how its layers are built (attention kind, the
MoE block and its tensor names) and what SGLang's model class builds. Every other table derives
from ``FAMILIES``:

    hfschema.model          MODEL_FAMILIES, MOE_FAMILIES, FAMILY_FIXED, ROUTER_RULES
    hfschema.hf_config      HF_CONFIG_READERS, HF_FIXED, IGNORED_TENSORS
    reshard.families        each family's canonical tensors (from attention and moe)
    megatron_adapters.model FamilyTraits (moe, mla, megatron_extra)
    hybridflow.rollout.tiny tiny transformers settings (``tiny``), read back through hf_config
    hybridflow.runtime      GENERATED_FAMILIES (those with ``write``): a random model's directory

So adding a family is one ``Family(...)`` below (and, where its layers are new, the tensor group
or megatron field they need); ``tests/test_families.py`` fails on a product module that names a
family anywhere else. Nothing here imports another module of the project: records are plain data
and functions of duck-typed models, so ``hfschema.model`` can build on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "ConfigKeys",
    "Family",
    "MoEBlock",
    "RouterRule",
    "SGLangTraits",
    "family",
]


# ------------------------------------------------------------------------- config.json access


class ConfigKeys:
    """``config.json`` values; ``refuse`` raises a ValueError naming the file and key."""

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        self.config, self.where = config, where

    def __getitem__(self, key: str) -> Any:
        return self.config[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    def refuse(self, key: str, why: str) -> None:
        raise ValueError(f"{self.where}: {key}={self.config.get(key)!r}: {why}")


def _rope(c: ConfigKeys) -> dict[str, Any]:
    """transformers 5 writes ``rope_parameters``; older configs ``rope_theta`` + ``rope_scaling``."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return {"theta": float(theta), "type": kind, "params": params}


def _plain_rope(c: ConfigKeys) -> float:
    rope = _rope(c)
    if rope["type"] != "default":
        c.refuse(
            "rope_parameters", f"rope_type {rope['type']!r}: only plain RoPE maps onto megatron-core for this family"
        )
    return rope["theta"]


def _common(c: ConfigKeys) -> dict[str, Any]:
    heads = c["num_attention_heads"]
    return dict(
        hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim", c["hidden_size"] // heads),
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"],
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


# ------------------------------------------------------------------------- router rules


@dataclass(frozen=True, kw_only=True)
class RouterRule:
    """A combination of router settings that megatron-core routes differently from the family's
    Hugging Face router (transformers 5.19), so the converted model's logits would differ."""

    keys: tuple[str, ...]
    """The ``ModelConfig`` fields involved, named in the error."""
    hf_keys: tuple[str, ...]
    """The ``config.json`` keys they are read from (``hfschema.hf_config``)."""
    megatron_keys: tuple[str, ...]
    """The megatron-core ``TransformerConfig`` fields they become (``megatron_adapters.model``)."""
    differs: Callable[[Any], bool]
    """Whether the two implementations compute different routes or weights for this model."""
    why: str
    """What each side computes."""
    fix: str
    """The settings that compute alike."""


def _group_scores_differ(m) -> bool:
    # choosing every group drops no expert: the group scores are then never compared
    return (
        m.router_num_groups is not None
        and m.router_group_topk < m.router_num_groups
        and m.moe_top_k // m.router_group_topk != 2
    )


def _sigmoid_norm_differs(m) -> bool:
    return m.router_score_function == "sigmoid" and m.norm_topk_prob != (m.moe_top_k > 1)


def _softmax_top1_differs(m) -> bool:
    return m.router_score_function == "softmax" and m.moe_top_k == 1 and m.norm_topk_prob


_GROUP_SCORES = RouterRule(
    keys=("moe_top_k", "router_group_topk", "router_num_groups"),
    hf_keys=("num_experts_per_tok", "topk_group", "n_group"),
    megatron_keys=("moe_router_topk", "moe_router_group_topk", "moe_router_num_groups"),
    differs=_group_scores_differ,
    why=(
        "transformers' DeepseekV3TopkRouter ranks expert groups by the sum of each group's top 2 "
        "biased scores, megatron-core's group_limited_topk by the sum of its top "
        "moe_router_topk // moe_router_group_topk"
    ),
    fix=(
        "only moe_top_k // router_group_topk = 2 (DeepSeek-V3: 8 // 4), or router_group_topk = "
        "router_num_groups, routes alike"
    ),
)
_SIGMOID_NORM = RouterRule(
    keys=("norm_topk_prob", "moe_top_k"),
    hf_keys=("norm_topk_prob", "num_experts_per_tok"),
    megatron_keys=("moe_router_topk",),
    differs=_sigmoid_norm_differs,
    why=(
        "megatron-core renormalises sigmoid top-k weights exactly when moe_router_topk > 1 (it has "
        "no switch for it), transformers exactly when norm_topk_prob is true"
    ),
    fix="only norm_topk_prob = (moe_top_k > 1) weighs alike",
)
_SOFTMAX_TOP1 = RouterRule(
    keys=("moe_top_k", "norm_topk_prob"),
    hf_keys=("num_experts_per_tok", "norm_topk_prob (Mixtral: always true)"),
    megatron_keys=("moe_router_topk", "moe_router_pre_softmax"),
    differs=_softmax_top1_differs,
    why=(
        "transformers renormalises the one softmax weight to 1.0; megatron-core refuses top-1 "
        "softmax routing without moe_router_pre_softmax (the router would get no gradient) and "
        "with it weighs by the softmax probability"
    ),
    fix="only norm_topk_prob = false routes a top-1 model alike",
)


# ------------------------------------------------------------------------- the record


@dataclass(frozen=True, kw_only=True)
class MoEBlock:
    """A family's MoE layers as its checkpoint and SGLang name them."""

    module: str = "mlp"
    """The layer's MoE module in HF and SGLang names (``model.layers.{layer}.<module>.experts``)."""
    expert_names: Mapping[str, str] = field(
        default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    )
    """Checkpoint names of each expert's gate / up / down projections (Mixtral: w1 / w3 / w2)."""
    expert_bias: bool = False
    """The router may hold DeepSeek's aux-loss-free ``gate.e_score_correction_bias``."""
    shared_experts: bool = False
    """The layer may hold always-active shared experts (``mlp.shared_experts``)."""


@dataclass(frozen=True, kw_only=True)
class SGLangTraits:
    """What SGLang's model class for the family builds (``reshard`` plans for it)."""

    dp_attention: bool = False
    """Attention is built over the attention-TP group (DP attention works)."""
    tied_head: bool = True
    """With tie_word_embeddings the LM head is ``embed_tokens``; False: it always builds its own
    ``lm_head.weight`` and never copies the embedding into it."""
    redundant_experts: bool = False
    """The MoE block allocates the EPLB redundant slots (``--ep-num-redundant-experts``)."""
    gate_bias: bool = False
    """The MoE gate always holds ``e_score_correction_bias`` (DeepSeek-V3's noaux_tc)."""


Fixed = dict[str, tuple[tuple[Any, ...], str]]


@dataclass(frozen=True, kw_only=True)
class Family:
    """One architecture, as every part of the project needs it."""

    model_type: str
    """transformers' ``model_type`` (config.json), which is the family's name here."""
    read: Callable[[ConfigKeys], dict[str, Any]]
    """``config.json`` -> ``ModelConfig`` fields (the family is the model_type)."""
    fixed: Fixed
    """``ModelConfig`` fields the architecture fixes: the values allowed (the first is set when
    the field is left at None) and why."""
    hf_fixed: tuple[tuple[str, Any, str], ...] = ()
    """``config.json`` keys without a ``ModelConfig`` field whose other values megatron would
    compute differently: (key, the one value that maps, why); an absent key reads as that value."""
    router_rules: tuple[RouterRule, ...] = ()
    """Router combinations megatron-core computes differently; refused."""
    moe: MoEBlock | None = None
    """The MoE block; None: a dense family."""
    attention: str = "gqa"
    """``gqa`` (grouped-query attention, per-head q/k norms where ``qk_layernorm``) or ``mla``."""
    sglang: SGLangTraits = SGLangTraits()
    """What SGLang's model class builds."""
    megatron_extra: Callable[[Any], dict[str, Any]] = lambda model: {}
    """Extra megatron-core ``TransformerConfig`` fields for a model of this family."""
    write: Callable[[Any], dict[str, Any]] | None = None
    """``ModelConfig`` -> the family's own ``config.json`` keys (on top of the shared ones), for a
    random model's directory; None: the run cannot write one (``model.path`` is needed)."""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    """transformers config values of the family's tiny test models, on top of the shared tiny
    dims (``hybridflow.rollout.tiny``); empty: no tiny model is made for it."""
    ignored_tensor: Callable[[str, Any], bool] | None = None
    """Checkpoint tensors that are not part of the model megatron builds (skipped, counted)."""

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


# ------------------------------------------------------------------------- the families

_SILU = ("hidden_act", "silu", "megatron_adapters builds SwiGLU (silu) MLPs only")
_O_PROJ_BIAS = (
    "its attention_bias also puts a bias on o_proj (HF and SGLang alike), which "
    "megatron-core builds only with add_bias_linear, MLP biases included"
)
_NO_QK_NORM = "the family has no per-head q/k norms (SGLang's attention builds none)"
_PLAIN_ROUTER = "SGLang routes this family by softmax top-k, without expert bias, groups or scaling"
_NO_DENSE = "SGLang builds every layer of this family as an MoE layer"
_DENSE_FIXED: Fixed = {}
_MOE_FIXED: Fixed = {
    "first_k_dense_layers": ((0,), _NO_DENSE),
    "num_shared_experts": ((0,), "the family has no shared experts (nor has SGLang's MoE block)"),
    "router_expert_bias": ((False,), _PLAIN_ROUTER),
    "router_score_function": (("softmax",), _PLAIN_ROUTER),
    "router_num_groups": ((None,), _PLAIN_ROUTER),
    "router_topk_scaling_factor": ((None, 1.0), _PLAIN_ROUTER),
}
_ALL_MOE = (
    ("mlp_only_layers", [], "only all-MoE models map onto ModelConfig"),
    ("decoder_sparse_step", 1, "only all-MoE models map onto ModelConfig"),
)
_MOE_TINY = dict(num_experts_per_tok=2, norm_topk_prob=True)


def _llama(c: ConfigKeys) -> dict[str, Any]:
    return dict(
        _common(c), rope_theta=_plain_rope(c), num_experts=0, attention_bias=bool(c.get("attention_bias", False))
    )


def _qwen2(c: ConfigKeys) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases; its config has no switch for them.
    return dict(_common(c), rope_theta=_plain_rope(c), num_experts=0, attention_bias=True)


def _qwen3(c: ConfigKeys) -> dict[str, Any]:
    return dict(
        _common(c),
        rope_theta=_plain_rope(c),
        num_experts=0,
        qk_layernorm=True,
        attention_bias=bool(c.get("attention_bias", False)),
    )


def _qwen3_moe(c: ConfigKeys) -> dict[str, Any]:
    return dict(
        _qwen3(c),
        # the hub's configs say num_experts; transformers 5 writes its alias num_local_experts
        num_experts=c.get("num_experts") or c["num_local_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
    )


def _mixtral(c: ConfigKeys) -> dict[str, Any]:
    # Mixtral's intermediate_size is each expert's; it always renormalises the top-k weights.
    return dict(
        _common(c),
        rope_theta=_plain_rope(c),
        num_experts=c["num_local_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["intermediate_size"],
        norm_topk_prob=True,
    )


def _yarn(c: ConfigKeys) -> tuple[float, dict[str, Any] | None]:
    rope = _rope(c)
    if rope["type"] == "default":
        return rope["theta"], None
    if rope["type"] != "yarn":
        c.refuse("rope_parameters", f"rope_type {rope['type']!r}: DeepSeek-V3 maps with yarn only")
    p = rope["params"]
    scaling = dict(
        type="yarn",
        factor=float(p["factor"]),
        original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast", 32.0)),
        beta_slow=float(p.get("beta_slow", 1.0)),
        mscale=float(p.get("mscale", 1.0)),
        mscale_all_dim=float(p.get("mscale_all_dim", 0.0)),
    )
    return rope["theta"], scaling


def _deepseek_groups(c: ConfigKeys) -> tuple[int | None, int | None]:
    """(router_num_groups, router_group_topk); None when every group is chosen: both sides then
    route by plain top-k, and megatron-core is spared group scores that change nothing."""
    groups, chosen = c.get("n_group", 8), c.get("topk_group", 4)  # transformers' defaults
    return (None, None) if chosen == groups else (groups, chosen)


def _deepseek_v3(c: ConfigKeys) -> dict[str, Any]:
    theta, scaling = _yarn(c)
    groups, chosen = _deepseek_groups(c)
    common = _common(c)
    return dict(
        common,
        head_dim=c["v_head_dim"],
        num_kv_heads=common["num_attention_heads"],
        rope_theta=theta,
        rope_scaling=scaling,
        num_experts=c["n_routed_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        # transformers always multiplies by routed_scaling_factor and renormalises by norm_topk_prob
        num_shared_experts=c.get("n_shared_experts", 1),
        router_score_function="sigmoid",
        router_expert_bias=True,
        router_topk_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        router_num_groups=groups,
        router_group_topk=chosen,
        first_k_dense_layers=c.get("first_k_dense_replace", 3),
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
    )


def _deepseek_megatron(model) -> dict[str, Any]:
    scaling = model.rope_scaling
    extra: dict[str, Any] = {
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_head_dim": model.qk_nope_head_dim,
        "qk_pos_emb_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        # megatron's unfused attention sizes its output by kv_channels: MLA's is v_head_dim.
        "kv_channels": model.v_head_dim,
        "rotary_base": model.rope_theta,
        "rope_type": "rope" if scaling is None else "yarn",
        # DeepSeek's q_a_layernorm / kv_a_layernorm on the latent projections.
        "qk_layernorm": True,
    }
    if scaling is not None:
        extra.update(
            rotary_scaling_factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            mscale=scaling.mscale,
            mscale_all_dim=scaling.mscale_all_dim,
        )
    return extra


def _deepseek_mtp(name: str, model) -> bool:
    """DeepSeek-V3's multi-token-prediction layers follow the last decoder layer
    (``model.layers.61.*`` in the released checkpoint); transformers skips them too."""
    parts = name.split(".")
    return (
        len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= model.num_layers
    )


def _write_attention_bias(model) -> dict[str, Any]:
    return dict(attention_bias=model.attention_bias)


def _write_qwen3_moe(model) -> dict[str, Any]:
    return dict(
        num_experts=model.num_experts,
        num_experts_per_tok=model.moe_top_k,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        norm_topk_prob=model.norm_topk_prob,
        attention_bias=model.attention_bias,
    )


def _write_mixtral(model) -> dict[str, Any]:  # its intermediate_size is each expert's
    return dict(
        num_local_experts=model.num_experts,
        num_experts_per_tok=model.moe_top_k,
        intermediate_size=model.moe_ffn_hidden_size,
    )


_FAMILY_LIST = (
    Family(
        model_type="llama",
        read=_llama,
        write=_write_attention_bias,
        fixed={"attention_bias": ((False,), _O_PROJ_BIAS), "qk_layernorm": ((False,), _NO_QK_NORM)},
        hf_fixed=(
            _SILU,
            ("mlp_bias", False, "MLP biases are not supported (megatron_adapters sets add_bias_linear=False)"),
        ),
        tiny=dict(attention_bias=False),
    ),
    Family(
        model_type="qwen2",
        read=_qwen2,
        write=lambda model: {},
        fixed={
            "attention_bias": (
                (True,),
                "Qwen2 always has q/k/v biases (SGLang's Qwen2Attention builds qkv_proj.bias whatever the config says)",
            ),
            "qk_layernorm": ((False,), _NO_QK_NORM),
        },
        hf_fixed=(_SILU, ("use_sliding_window", False, "sliding-window attention is not built by megatron_adapters")),
        tiny=dict(use_sliding_window=False),
    ),
    Family(
        model_type="qwen3",
        read=_qwen3,
        write=_write_attention_bias,
        fixed={
            "attention_bias": ((False,), _O_PROJ_BIAS),
            "qk_layernorm": (
                (True,),
                "Qwen3 always normalises q and k per head (SGLang's Qwen3Attention builds q_norm / k_norm)",
            ),
        },
        hf_fixed=(_SILU, ("use_sliding_window", False, "sliding-window attention is not built by megatron_adapters")),
        # Qwen3ForCausalLM ties lm_head to embed_tokens as Qwen2's does; its attention is built
        # over attn_tp, its MLP (Qwen2's) over tp: DP attention is left refused until a run shows it
        tiny=dict(attention_bias=False, use_sliding_window=False),
    ),
    Family(
        model_type="qwen3_moe",
        read=_qwen3_moe,
        write=_write_qwen3_moe,
        fixed={
            "attention_bias": ((False,), _O_PROJ_BIAS),
            "qk_layernorm": (
                (True,),
                "Qwen3-MoE always normalises q and k per head (SGLang's Qwen3MoeAttention builds q_norm / k_norm)",
            ),
            # SGLang's Qwen3MoeDecoderLayer.stage_facts makes every layer sparse: mlp_only_layers
            # and decoder_sparse_step are not honoured
            **_MOE_FIXED,
        },
        hf_fixed=(_SILU, *_ALL_MOE),
        router_rules=(_SOFTMAX_TOP1,),
        moe=MoEBlock(),
        # Qwen3MoeForCausalLM: ParallelLMHead whatever tie_word_embeddings says;
        # Qwen3MoeSparseMoeBlock: num_experts + ep_num_redundant_experts slots
        sglang=SGLangTraits(dp_attention=True, tied_head=False, redundant_experts=True),
        tiny=dict(_MOE_TINY, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
    ),
    Family(
        model_type="mixtral",
        read=_mixtral,
        write=_write_mixtral,
        fixed={
            "attention_bias": ((False,), "Mixtral has no attention biases"),
            "qk_layernorm": ((False,), _NO_QK_NORM),
            **_MOE_FIXED,
            "norm_topk_prob": ((True,), "SGLang's MixtralMoE always renormalises the top-k weights"),
        },
        hf_fixed=(
            _SILU,
            (
                "router_jitter_noise",
                0.0,
                "transformers multiplies the MoE block's input "
                "(the experts' too) by uniform noise when training; megatron_adapters adds "
                "none, and megatron-core's moe_input_jitter_eps would jitter the router's "
                "input only",
            ),
        ),
        router_rules=(_SOFTMAX_TOP1,),
        moe=MoEBlock(module="block_sparse_moe", expert_names={"gate": "w1", "up": "w3", "down": "w2"}),
        # MixtralForCausalLM: its own ParallelLMHead; MixtralMoE: FusedMoE(num_local_experts)
        sglang=SGLangTraits(tied_head=False),
        tiny=dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    Family(
        model_type="deepseek_v3",
        read=_deepseek_v3,
        attention="mla",
        fixed={
            "attention_bias": ((False,), "MLA's projections have no biases (SGLang builds none)"),
            "qk_layernorm": (
                (False,),
                "MLA's q_a / kv_a layernorms are always built; qk_layernorm is Qwen3's per-head norm",
            ),
        },
        hf_fixed=(
            _SILU,
            ("rope_interleave", True, "megatron-core's MLA applies RoPE to interleaved channels"),
            (
                "topk_method",
                "noaux_tc",
                "only the aux-loss-free router maps (its gate.e_score_correction_bias "
                "is router.expert_bias; SGLang builds that tensor for noaux_tc alone)",
            ),
            (
                "scoring_func",
                "sigmoid",
                "megatron_adapters routes DeepSeek-V3 by sigmoid scores, as transformers does whatever the key says",
            ),
            (
                "moe_layer_freq",
                1,
                "only MoE in every layer after first_k_dense_replace maps (SGLang makes "
                "layers with layer % moe_layer_freq != 0 dense)",
            ),
            ("attention_bias", False, "MLA's projections map without biases (SGLang builds none)"),
        ),
        router_rules=(_GROUP_SCORES, _SIGMOID_NORM),
        moe=MoEBlock(expert_bias=True, shared_experts=True),
        # DeepseekV2MoE: n_routed_experts + ep_num_redundant_experts slots; MoEGate builds
        # e_score_correction_bias for topk_method noaux_tc (hf_fixed refuses the others)
        sglang=SGLangTraits(dp_attention=True, redundant_experts=True, gate_bias=True),
        megatron_extra=_deepseek_megatron,
        ignored_tensor=_deepseek_mtp,
    ),
)
FAMILIES: dict[str, Family] = {f.model_type: f for f in _FAMILY_LIST}
"""Every supported family by ``model_type``."""


def family(name: str) -> Family:
    """The record of ``name``; ValueError listing the supported families otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]
