"""Per-family registry of canonical tensors and where each sits on both sides.

A canonical tensor is a Hugging Face checkpoint tensor (``model.layers.3.self_attn.q_proj.weight``).
For each one the registry records its shape, and for each side the fused parameter it lives in
and the rule that slices it there:

    TensorSpec(hf="model.layers.{layer}.self_attn.q_proj.weight", shape=q_rows x hidden,
        megatron=Placement(param="decoder.layers.{layer}.self_attention.linear_qkv.weight",
                           rule="qkv", part="q"),      # interleaved per query group
        sglang=Placement(param="model.layers.{layer}.self_attn.qkv_proj.weight",
                         rule="qkv", part="q", axis="attn_tp"))   # [q_local | k_local | v_local]

The rules themselves live with their side (``reshard.megatron``, ``reshard.sglang``); this module
only names them, so the HF <-> Megatron converters (issue 6) can reuse the same table.

Megatron names are megatron-core's local-spec names (``input_layernorm.weight``,
``pre_mlp_layernorm.weight``, ``q_layernorm`` ...) with global layer numbers, as its
checkpoints use them; ``Placement.te_param`` gives the TransformerEngine-spec name where it
differs (norms fused into the following linear as ``layer_norm_weight``). Routed experts use
``SequentialMLP`` names (``mlp.experts.local_experts.{local}``), ``{local}`` being the expert's
index on its expert-parallel rank.

Families are looked up by ``ModelConfig.family``; no code branches on a family name. An
architecture no family maps (``hfschema.model.UNMAPPED_FAMILY``) has the tensors of its weight
files, each moved whole under its own name (``STORED``): no side slices them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from hfschema.families import FAMILIES as REGISTERED
from hfschema.families import Family
from hfschema.model import UNMAPPED_FAMILY, ModelConfig
from hfschema.model_source import model_source, stored_shapes

__all__ = [
    "CanonicalTensor",
    "FAMILIES",
    "FamilySpec",
    "Placement",
    "STORED",
    "TensorSpec",
    "canonical_tensors",
    "family_spec",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
"""Bytes per element of the dtypes a plan may carry."""

SCOPES = ("model", "layer", "dense_mlp", "moe", "expert")
"""``model``: once; ``layer``: every layer; ``dense_mlp``: layers with a dense MLP; ``moe``:
MoE layers; ``expert``: every routed expert of every MoE layer."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a canonical tensor sits on one side: a fused parameter and the rule slicing it."""

    param: str
    """Parameter name template; ``{layer}`` and ``{local}`` (index on the EP rank) filled in."""
    rule: str
    """Key into the side's rule registry (``qkv``, ``column``, ``row``, ``vocab`` ...)."""
    part: str = ""
    """Which part of a fused parameter this tensor is (``q``/``k``/``v``, ``gate``/``up``, ...)."""
    axis: str = "tp"
    """SGLang: the parallel group that splits it (``tp``, ``attn_tp``, ``lm_head``, ``moe``)."""
    stage: str = "layer"
    """Megatron: the pipeline stage owning it (``layer``, ``first``, ``last``,
    ``last_if_pipelined`` for the tied output-layer copy that exists only when pp > 1)."""
    te_param: str = ""
    """Megatron TransformerEngine-spec name when it differs from the local-spec ``param``."""


def _always(model: ModelConfig) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One kind of canonical tensor of a family and its placement on both sides."""

    hf: str
    """Hugging Face name template (``{layer}``, ``{expert}``)."""
    shape: Callable[[ModelConfig], tuple[int, ...]]
    """Global shape of the canonical tensor."""
    scope: str
    """How often it occurs: one of ``SCOPES``."""
    megatron: tuple[Placement, ...]
    """Megatron copies (more than one only for the tied embedding / output layer)."""
    sglang: Placement
    """SGLang placement."""
    dtype: Optional[str] = None
    """Dtype override (DeepSeek's expert bias is float32); None = the plan's dtype."""
    when: Callable[[ModelConfig], bool] = _always
    """Whether the model has this tensor (bias, q-norm, tied head ...)."""


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """A model family: its canonical tensors and what SGLang supports for it."""

    tensors: tuple[TensorSpec, ...]
    """Every kind of canonical tensor, in checkpoint order."""
    dp_attention: bool
    """SGLang builds attention over the attention-TP group (DP attention works)."""
    tied_head: bool = True
    """With tie_word_embeddings SGLang's model class uses ``embed_tokens`` as the LM head; False:
    it always builds its own ``lm_head.weight`` and never copies the embedding into it."""
    redundant_experts: bool = False
    """SGLang's MoE block allocates the EPLB redundant slots (``--ep-num-redundant-experts``)."""
    gate_bias: bool = False
    """SGLang's MoE gate always holds ``e_score_correction_bias`` (DeepSeek-V3's noaux_tc)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CanonicalTensor:
    """One concrete canonical tensor of a model."""

    name: str
    """Hugging Face name."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """Element type (a key of ``DTYPE_BYTES``)."""
    spec: TensorSpec
    """The registry entry it comes from."""
    layer: Optional[int] = None
    """Global layer index, or None for model-level tensors."""
    expert: Optional[int] = None
    """Routed expert index, or None."""

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]


# ------------------------------------------------------------------------- shapes


def _hidden(m: ModelConfig) -> tuple[int, ...]:
    return (m.hidden_size,)


def _vocab(m: ModelConfig) -> tuple[int, ...]:
    return (m.vocab_size, m.hidden_size)


def _q_rows(m: ModelConfig) -> int:
    return m.num_attention_heads * m.kv_channels


def _kv_rows(m: ModelConfig) -> int:
    return m.num_kv_heads * m.kv_channels


def _router_shape(m: ModelConfig) -> tuple[int, ...]:
    return (m.num_experts, m.hidden_size)


def _shared_ffn(m: ModelConfig) -> int:
    return m.moe_ffn_hidden_size * m.num_shared_experts


def _q_head(m: ModelConfig) -> int:
    return m.qk_nope_head_dim + m.qk_rope_head_dim


# ------------------------------------------------------------------- tensor groups


def _tied_head(m: ModelConfig) -> bool:
    """The LM head is the word embeddings. A score model's megatron model is built untied
    whatever config.json says (its head is no copy of the embeddings)."""
    return m.head == "lm" and m.tie_word_embeddings


def _global_tensors() -> tuple[TensorSpec, ...]:
    """Embedding, final norm and LM head (tied: one tensor held by embedding and output layer)."""
    embed_megatron = (
        Placement(param="embedding.word_embeddings.weight", rule="vocab", stage="first"),
        Placement(param="output_layer.weight", rule="vocab", stage="last_if_pipelined"),
    )
    return (
        TensorSpec(
            hf="model.embed_tokens.weight",
            shape=_vocab,
            scope="model",
            megatron=embed_megatron[:1],
            sglang=Placement(param="model.embed_tokens.weight", rule="vocab", axis="attn_tp"),
            when=lambda m: not _tied_head(m),
        ),
        # Tied: megatron keeps a synchronised copy as output_layer.weight on the last stage
        # when pp > 1 (GPTModel.shared_embedding_or_output_weight); SGLang's lm_head is the
        # embedding module itself (e.g. Qwen2ForCausalLM: self.lm_head = self.model.embed_tokens).
        TensorSpec(
            hf="model.embed_tokens.weight",
            shape=_vocab,
            scope="model",
            megatron=embed_megatron,
            sglang=Placement(param="model.embed_tokens.weight", rule="vocab", axis="attn_tp"),
            when=_tied_head,
        ),
        TensorSpec(
            hf="model.norm.weight",
            shape=_hidden,
            scope="model",
            megatron=(Placement(param="decoder.final_layernorm.weight", rule="replicated", stage="last"),),
            sglang=Placement(param="model.norm.weight", rule="replicated"),
        ),
        TensorSpec(
            hf="lm_head.weight",
            shape=_vocab,
            scope="model",
            megatron=(Placement(param="output_layer.weight", rule="vocab", stage="last"),),
            sglang=Placement(param="lm_head.weight", rule="vocab", axis="lm_head"),
            when=lambda m: m.head == "lm" and not m.tie_word_embeddings,
        ),
        # A reward model's one-label head: the critic's value head, whole on every TP rank.
        TensorSpec(
            hf="score.weight",
            shape=lambda m: (1, m.hidden_size),
            scope="model",
            megatron=(Placement(param="output_layer.weight", rule="replicated", stage="last"),),
            sglang=Placement(param="score.weight", rule="replicated"),
            when=lambda m: m.head == "score",
        ),
    )


def _layer_norms() -> tuple[TensorSpec, ...]:
    prefix = "decoder.layers.{layer}"
    return (
        TensorSpec(
            hf="model.layers.{layer}.input_layernorm.weight",
            shape=_hidden,
            scope="layer",
            megatron=(
                Placement(
                    param=f"{prefix}.input_layernorm.weight",
                    rule="replicated",
                    te_param=f"{prefix}.self_attention.linear_qkv.layer_norm_weight",
                ),
            ),
            sglang=Placement(param="model.layers.{layer}.input_layernorm.weight", rule="replicated"),
        ),
        TensorSpec(
            hf="model.layers.{layer}.post_attention_layernorm.weight",
            shape=_hidden,
            scope="layer",
            megatron=(
                Placement(
                    param=f"{prefix}.pre_mlp_layernorm.weight",
                    rule="replicated",
                    # TE fuses it into linear_fc1 in dense layers only; MoE layers keep the norm
                    te_param=f"{prefix}.mlp.linear_fc1.layer_norm_weight",
                ),
            ),
            sglang=Placement(param="model.layers.{layer}.post_attention_layernorm.weight", rule="replicated"),
        ),
    )


def _gqa_attention() -> tuple[TensorSpec, ...]:
    """q/k/v/o (+ q/k/v bias, + Qwen3 q/k norms) of grouped-query attention."""
    mq = "decoder.layers.{layer}.self_attention"
    sq = "model.layers.{layer}.self_attn"
    rows = {"q": _q_rows, "k": _kv_rows, "v": _kv_rows}
    specs = []
    for part in ("q", "k", "v"):
        n = rows[part]
        specs.append(
            TensorSpec(
                hf=f"{sq}.{part}_proj.weight",
                shape=lambda m, n=n: (n(m), m.hidden_size),
                scope="layer",
                megatron=(Placement(param=f"{mq}.linear_qkv.weight", rule="qkv", part=part),),
                sglang=Placement(param=f"{sq}.qkv_proj.weight", rule="qkv", part=part, axis="attn_tp"),
            )
        )
    for part in ("q", "k", "v"):
        n = rows[part]
        specs.append(
            TensorSpec(
                hf=f"{sq}.{part}_proj.bias",
                shape=lambda m, n=n: (n(m),),
                scope="layer",
                megatron=(Placement(param=f"{mq}.linear_qkv.bias", rule="qkv", part=part),),
                sglang=Placement(param=f"{sq}.qkv_proj.bias", rule="qkv", part=part, axis="attn_tp"),
                when=lambda m: m.attention_bias,
            )
        )
    specs.append(
        TensorSpec(
            hf=f"{sq}.o_proj.weight",
            shape=lambda m: (m.hidden_size, _q_rows(m)),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_proj.weight", rule="row"),),
            sglang=Placement(param=f"{sq}.o_proj.weight", rule="row", axis="attn_tp"),
        )
    )
    for hf_norm, mg_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        specs.append(
            TensorSpec(
                hf=f"{sq}.{hf_norm}.weight",
                shape=lambda m: (m.kv_channels,),
                scope="layer",
                megatron=(Placement(param=f"{mq}.{mg_norm}.weight", rule="replicated"),),
                sglang=Placement(param=f"{sq}.{hf_norm}.weight", rule="replicated"),
                when=lambda m: m.qk_layernorm,
            )
        )
    return tuple(specs)


def _mla_attention() -> tuple[TensorSpec, ...]:
    """DeepSeek-V3 multi-latent attention.

    Megatron: hybridflow builds the down projections replicated (megatron_adapters.model:
    ``_use_local_mla_attention``; TE's spec uses ``TELinear(parallel_mode='duplicated')``), the
    up projections column-parallel by heads, ``linear_proj`` row-parallel. SGLang
    (``DeepseekV2AttentionMLA.__init__``): ``fused_qkv_a_proj_with_mqa`` = [q_a_proj;
    kv_a_proj_with_mqa] replicated (``ReplicatedLinear``), ``q_b_proj`` / ``q_proj`` /
    ``kv_b_proj`` ``ColumnParallelLinear`` over attn_tp, ``o_proj`` ``RowParallelLinear``.
    """
    mq = "decoder.layers.{layer}.self_attention"
    sq = "model.layers.{layer}.self_attn"
    lora = lambda m: m.q_lora_rank is not None  # noqa: E731
    return (
        TensorSpec(
            hf=f"{sq}.q_a_proj.weight",
            shape=lambda m: (m.q_lora_rank, m.hidden_size),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_q_down_proj.weight", rule="replicated"),),
            sglang=Placement(param=f"{sq}.fused_qkv_a_proj_with_mqa.weight", rule="replicated_rows", part="q_a"),
            when=lora,
        ),
        TensorSpec(
            hf=f"{sq}.q_a_layernorm.weight",
            shape=lambda m: (m.q_lora_rank,),
            scope="layer",
            megatron=(
                Placement(
                    param=f"{mq}.q_layernorm.weight",
                    rule="replicated",
                    te_param=f"{mq}.linear_q_up_proj.layer_norm_weight",
                ),
            ),
            sglang=Placement(param=f"{sq}.q_a_layernorm.weight", rule="replicated"),
            when=lora,
        ),
        TensorSpec(
            hf=f"{sq}.q_b_proj.weight",
            shape=lambda m: (m.num_attention_heads * _q_head(m), m.q_lora_rank),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_q_up_proj.weight", rule="column"),),
            sglang=Placement(param=f"{sq}.q_b_proj.weight", rule="column", axis="attn_tp"),
            when=lora,
        ),
        TensorSpec(
            hf=f"{sq}.q_proj.weight",
            shape=lambda m: (m.num_attention_heads * _q_head(m), m.hidden_size),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_q_proj.weight", rule="column"),),
            sglang=Placement(param=f"{sq}.q_proj.weight", rule="column", axis="attn_tp"),
            when=lambda m: not lora(m),
        ),
        TensorSpec(
            hf=f"{sq}.kv_a_proj_with_mqa.weight",
            shape=lambda m: (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_kv_down_proj.weight", rule="replicated"),),
            sglang=Placement(param=f"{sq}.fused_qkv_a_proj_with_mqa.weight", rule="replicated_rows", part="kv_a"),
            when=lora,
        ),
        TensorSpec(
            hf=f"{sq}.kv_a_proj_with_mqa.weight",
            shape=lambda m: (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_kv_down_proj.weight", rule="replicated"),),
            sglang=Placement(param=f"{sq}.kv_a_proj_with_mqa.weight", rule="replicated"),
            when=lambda m: not lora(m),
        ),
        TensorSpec(
            hf=f"{sq}.kv_a_layernorm.weight",
            shape=lambda m: (m.kv_lora_rank,),
            scope="layer",
            megatron=(
                Placement(
                    param=f"{mq}.kv_layernorm.weight",
                    rule="replicated",
                    te_param=f"{mq}.linear_kv_up_proj.layer_norm_weight",
                ),
            ),
            sglang=Placement(param=f"{sq}.kv_a_layernorm.weight", rule="replicated"),
        ),
        TensorSpec(
            hf=f"{sq}.kv_b_proj.weight",
            shape=lambda m: (m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_kv_up_proj.weight", rule="column"),),
            sglang=Placement(param=f"{sq}.kv_b_proj.weight", rule="column", axis="attn_tp"),
        ),
        TensorSpec(
            hf=f"{sq}.o_proj.weight",
            shape=lambda m: (m.hidden_size, m.num_attention_heads * m.v_head_dim),
            scope="layer",
            megatron=(Placement(param=f"{mq}.linear_proj.weight", rule="row"),),
            sglang=Placement(param=f"{sq}.o_proj.weight", rule="row", axis="attn_tp"),
        ),
    )


def _gated_mlp(
    *,
    hf_prefix: str,
    mg_prefix: str,
    sg_prefix: str,
    scope: str,
    ffn: Callable[[ModelConfig], int],
    when: Callable[[ModelConfig], bool] = _always,
) -> tuple[TensorSpec, ...]:
    """A SwiGLU MLP: megatron ``linear_fc1`` = [gate_r; up_r] per TP rank; SGLang gate_up_proj."""
    specs = [
        TensorSpec(
            hf=f"{hf_prefix}.{name}_proj.weight",
            shape=lambda m: (ffn(m), m.hidden_size),
            scope=scope,
            megatron=(Placement(param=f"{mg_prefix}.linear_fc1.weight", rule="gated_column", part=name),),
            sglang=Placement(param=f"{sg_prefix}.gate_up_proj.weight", rule="gated_column", part=name),
            when=when,
        )
        for name in ("gate", "up")
    ]
    specs.append(
        TensorSpec(
            hf=f"{hf_prefix}.down_proj.weight",
            shape=lambda m: (m.hidden_size, ffn(m)),
            scope=scope,
            megatron=(Placement(param=f"{mg_prefix}.linear_fc2.weight", rule="row"),),
            sglang=Placement(param=f"{sg_prefix}.down_proj.weight", rule="row"),
            when=when,
        )
    )
    return tuple(specs)


def _dense_mlp() -> tuple[TensorSpec, ...]:
    return _gated_mlp(
        hf_prefix="model.layers.{layer}.mlp",
        mg_prefix="decoder.layers.{layer}.mlp",
        sg_prefix="model.layers.{layer}.mlp",
        scope="dense_mlp",
        ffn=lambda m: m.ffn_hidden_size,
    )


def _router(hf_block: str, sg_block: str, *, expert_bias: bool) -> tuple[TensorSpec, ...]:
    """Router weight [E, H] (and DeepSeek's aux-loss-free bias), replicated on both sides."""
    specs = [
        TensorSpec(
            hf=f"model.layers.{{layer}}.{hf_block}.gate.weight",
            shape=_router_shape,
            scope="moe",
            megatron=(Placement(param="decoder.layers.{layer}.mlp.router.weight", rule="replicated"),),
            sglang=Placement(param=f"model.layers.{{layer}}.{sg_block}.gate.weight", rule="replicated"),
        )
    ]
    if expert_bias:
        specs.append(
            TensorSpec(
                hf=f"model.layers.{{layer}}.{hf_block}.gate.e_score_correction_bias",
                shape=lambda m: (m.num_experts,),
                scope="moe",
                dtype="float32",
                megatron=(Placement(param="decoder.layers.{layer}.mlp.router.expert_bias", rule="replicated"),),
                sglang=Placement(
                    param=f"model.layers.{{layer}}.{sg_block}.gate.e_score_correction_bias", rule="replicated"
                ),
                when=lambda m: m.router_expert_bias,
            )
        )
    return tuple(specs)


def _experts(hf_block: str, sg_block: str, names: dict[str, str]) -> tuple[TensorSpec, ...]:
    """Routed experts: megatron SequentialMLP local experts; SGLang FusedMoE w13 / w2.

    ``names`` maps the roles gate / up / down to the checkpoint names (Mixtral: w1 / w3 / w2).
    """
    hf = f"model.layers.{{layer}}.{hf_block}.experts.{{expert}}"
    mg = "decoder.layers.{layer}.mlp.experts.local_experts.{local}"
    sg = f"model.layers.{{layer}}.{sg_block}.experts"
    fc1 = lambda m: (m.moe_ffn_hidden_size, m.hidden_size)  # noqa: E731
    return (
        *(
            TensorSpec(
                hf=f"{hf}.{names[role]}.weight",
                shape=fc1,
                scope="expert",
                megatron=(Placement(param=f"{mg}.linear_fc1.weight", rule="expert_gated_column", part=role),),
                sglang=Placement(param=f"{sg}.w13_weight", rule="expert_w13", part=role, axis="moe"),
            )
            for role in ("gate", "up")
        ),
        TensorSpec(
            hf=f"{hf}.{names['down']}.weight",
            shape=lambda m: (m.hidden_size, m.moe_ffn_hidden_size),
            scope="expert",
            megatron=(Placement(param=f"{mg}.linear_fc2.weight", rule="expert_row"),),
            sglang=Placement(param=f"{sg}.w2_weight", rule="expert_w2", axis="moe"),
        ),
    )


def _shared_experts() -> tuple[TensorSpec, ...]:
    """DeepSeek's shared experts: megatron SharedExpertMLP, SGLang DeepseekV2MLP, both over tp."""
    return _gated_mlp(
        hf_prefix="model.layers.{layer}.mlp.shared_experts",
        mg_prefix="decoder.layers.{layer}.mlp.shared_experts",
        sg_prefix="model.layers.{layer}.mlp.shared_experts",
        scope="moe",
        ffn=_shared_ffn,
        when=lambda m: m.num_shared_experts > 0,
    )


def _spec(family: Family) -> FamilySpec:
    """A family's canonical tensors from its registration (``hfschema.families``): the shared
    tensors, its attention kind, the dense MLP, then its MoE block's router, shared and routed
    experts, in checkpoint order."""
    attention = _mla_attention() if family.attention == "mla" else _gqa_attention()
    tensors = (*_global_tensors(), *_layer_norms(), *attention, *_dense_mlp())
    moe = family.moe
    if moe is not None:
        tensors += _router(moe.module, moe.module, expert_bias=moe.expert_bias)
        tensors += _shared_experts() if moe.shared_experts else ()
        tensors += _experts(moe.module, moe.module, dict(moe.expert_names))
    traits = family.sglang
    return FamilySpec(
        tensors=tensors,
        dp_attention=traits.dp_attention,
        tied_head=traits.tied_head,
        redundant_experts=traits.redundant_experts,
        gate_bias=traits.gate_bias,
    )


FAMILIES: dict[str, FamilySpec] = {name: _spec(family) for name, family in REGISTERED.items()}
"""Each registered family's canonical tensors and SGLang traits."""


def family_spec(model: ModelConfig) -> FamilySpec:
    """The registry entry of ``model.family``."""
    if model.family not in FAMILIES:
        raise ValueError(f"model.family={model.family!r} has no reshard mapping; known families: {', '.join(FAMILIES)}")
    return FAMILIES[model.family]


def _scope_layers(model: ModelConfig, scope: str) -> range | list[int]:
    first_moe = model.first_k_dense_layers if model.is_moe else model.num_layers
    return {
        "layer": range(model.num_layers),
        "dense_mlp": range(first_moe),
        "moe": range(first_moe, model.num_layers),
        "expert": range(first_moe, model.num_layers),
    }[scope]


def _instances(spec: TensorSpec, model: ModelConfig, dtype: str) -> list[CanonicalTensor]:
    shape = spec.shape(model)
    dtype = spec.dtype or dtype
    if spec.scope == "model":
        return [CanonicalTensor(name=spec.hf, shape=shape, dtype=dtype, spec=spec)]
    out = []
    for layer in _scope_layers(model, spec.scope):
        if spec.scope != "expert":
            out.append(
                CanonicalTensor(name=spec.hf.format(layer=layer), shape=shape, dtype=dtype, spec=spec, layer=layer)
            )
            continue
        out.extend(
            CanonicalTensor(
                name=spec.hf.format(layer=layer, expert=e), shape=shape, dtype=dtype, spec=spec, layer=layer, expert=e
            )
            for e in range(model.num_experts)
        )
    return out


STORED = TensorSpec(hf="", shape=lambda m: (), scope="model", megatron=(), sglang=Placement(param="", rule="whole"))
"""The spec of each tensor of an unmapped architecture: whole, under its checkpoint name."""


_RECOMPUTED = ("rotary_emb.inv_freq",)
"""Buffers older checkpoints store that transformers computes instead (no parameter holds them)."""


def _stored_tensors(model: ModelConfig, dtype: str) -> tuple[CanonicalTensor, ...]:
    """The tensors of ``model.path``'s safetensors files (their headers alone are read), as
    transformers' model names its parameters; a tied LM head is the embedding's, so a copy stored
    beside it is not one of them."""
    path = getattr(model, "path", None)  # a ModelSection's; a bare ModelConfig has no weight files
    if not path:
        raise ValueError(
            f"model.family={UNMAPPED_FAMILY}: its tensors are those of model.path's weight files; set model.path"
        )
    if not os.path.exists(os.path.expanduser(path)):
        raise ValueError(
            f"model.path={path} does not exist here: an unmapped architecture's tensors are its weight files'"
        )
    shapes = stored_shapes(model_source(path).weights)
    if model.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    for name in [n for n in shapes if n.endswith(_RECOMPUTED)]:
        del shapes[name]
    return tuple(CanonicalTensor(name=n, shape=tuple(s), dtype=dtype, spec=STORED) for n, s in shapes.items())


def canonical_tensors(model: ModelConfig, *, dtype: str = "bfloat16") -> tuple[CanonicalTensor, ...]:
    """Every canonical tensor of ``model``, in registry order (model, then per layer kind)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of: {', '.join(DTYPE_BYTES)}")
    if model.family == UNMAPPED_FAMILY:
        return _stored_tensors(model, dtype)
    specs = [s for s in family_spec(model).tensors if s.when(model)]
    return tuple(t for spec in specs for t in _instances(spec, model, dtype))
