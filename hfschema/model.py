"""The model architecture, described the way its Hugging Face ``config.json`` does.

``ModelConfig`` is the one description of an architecture that every package reads: the config
loader (``hybridflow.config``) nests it under ``model:``, the planners (``reshard``) derive
tensor shapes from it, ``megatron_adapters`` builds megatron-core models from it and
``hfschema.hf_config`` reads it from a Hugging Face directory. It checks itself at construction
and raises ``ConfigError`` with keys relative to itself.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from hfschema.checks import check_choice, check_non_negative, check_positive
from hfschema.families import FAMILIES, RouterRule
from hfschema.layout import ConfigError

__all__ = [
    "FAMILY_DERIVED",
    "FAMILY_FIXED",
    "MODEL_FAMILIES",
    "MOE_FAMILIES",
    "ROUTER_RULES",
    "ModelConfig",
    "RopeScalingConfig",
    "RouterRule",
    "ScoreModelConfig",
    "UNMAPPED_FAMILY",
    "as_score_model",
]

UNMAPPED_FAMILY = "transformers"
"""The family of an architecture no ``Family`` record maps (a model_type transformers ships that
megatron_adapters and reshard's tables do not describe): transformers' own class for
``model.path`` builds it, ``actor.backend=fsdp2`` trains it, its tensors are its weight files'
(``reshard.families``) and the engines load them whole (``rollout.sync_route=full``)."""
MODEL_FAMILIES = (*FAMILIES, UNMAPPED_FAMILY)
MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.is_moe)
FAMILY_FIXED: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    **{name: f.fixed for name, f in FAMILIES.items()},
    UNMAPPED_FAMILY: {},  # nothing to fix: transformers' class reads config.json itself
}
"""Per family: the values a field may take because the family's architecture (as Hugging Face,
SGLang's model class and megatron_adapters build it) fixes them, and why (``Family.fixed``). The
first value is the one to set; the ``FAMILY_DERIVED`` fields left at None take it."""
FAMILY_DERIVED = ("qk_layernorm", "attention_bias")
"""Fields whose None default means the family's value (every family fixes both)."""
ROUTER_RULES: dict[str, tuple[RouterRule, ...]] = {name: f.router_rules for name, f in FAMILIES.items()}
"""Per family: router setting combinations megatron-core computes differently from the family's
Hugging Face router; ``ModelConfig`` refuses them, at config load and at conversion alike. Every
other combination ``FAMILY_FIXED`` leaves open routes alike once ``megatron_adapters.model`` maps
it (``norm_topk_prob`` -> ``moe_router_pre_softmax``): ``tests/megatron_adapters/test_router_rules.py``
runs both implementations on each."""


def _text(value: Any) -> str:
    """A value as a YAML override spells it (true, null, 'softmax', 1.0)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


@dataclass(kw_only=True)
class RopeScalingConfig:
    """RoPE context extension (YaRN for DeepSeek-V3, linear, or Llama-3 style)."""

    type: str = "yarn"
    """Scaling method: yarn, linear or llama3."""
    factor: float = 1.0
    """Context extension factor (new length / original length)."""
    original_max_position_embeddings: int = 4096
    """Context length the model was pre-trained with before extension."""
    beta_fast: float = 32.0
    """YaRN: rotations above which frequencies are left unscaled."""
    beta_slow: float = 1.0
    """YaRN: rotations below which frequencies are fully interpolated."""
    mscale: float = 1.0
    """YaRN: attention-temperature scale."""
    mscale_all_dim: float = 0.0
    """YaRN: attention-temperature scale applied over all dims (DeepSeek-V3 uses 1.0)."""

    def __post_init__(self) -> None:
        check_choice("type", self.type, ("yarn", "linear", "llama3"))
        if self.factor < 1.0:
            raise ConfigError("{p}factor={f} must be >= 1.0", f=self.factor)
        check_positive(self, ("original_max_position_embeddings",))


@dataclass(kw_only=True)
class ModelConfig:
    """Transformer architecture; dense (llama, qwen2, qwen3) or MoE (qwen3_moe, mixtral, deepseek_v3)."""

    family: str = "qwen3_moe"
    """Model family, one of MODEL_FAMILIES; picks the weight mapping and layer spec. ``transformers``:
    an architecture no family maps, read from ``model.path`` and trained by ``actor.backend=fsdp2``."""
    hidden_size: int = 64
    """Residual stream width."""
    num_layers: int = 2
    """Number of transformer layers."""
    num_attention_heads: int = 4
    """Query heads per layer."""
    num_kv_heads: int = 2
    """Key/value heads (GQA); equal to num_attention_heads for MHA. Unused with MLA."""
    head_dim: Optional[int] = None
    """Per-head channels; None = hidden_size // num_attention_heads."""
    ffn_hidden_size: int = 128
    """Intermediate size of dense SwiGLU MLPs."""
    vocab_size: int = 128
    """Tokenizer vocabulary size (before megatron's padding)."""
    max_position_embeddings: int = 256
    """Longest sequence the RoPE tables cover."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: Optional[RopeScalingConfig] = None
    """RoPE context extension; None = plain RoPE."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output (LM head) projection."""
    qk_layernorm: Optional[bool] = None
    """RMSNorm on per-head queries and keys (Qwen3); None = the family's (true for qwen3 and
    qwen3_moe only: ``FAMILY_FIXED``)."""
    attention_bias: Optional[bool] = None
    """Bias on the q/k/v projections (Qwen2); None = the family's (true for qwen2 only)."""
    num_experts: int = 4
    """Routed experts per MoE layer; 0 = dense model (llama, qwen2)."""
    moe_top_k: int = 2
    """Routed experts each token is sent to."""
    moe_ffn_hidden_size: int = 64
    """Intermediate size of each expert's SwiGLU MLP."""
    num_shared_experts: int = 0
    """Always-active shared experts per MoE layer (DeepSeek-V3: 1)."""
    router_score_function: str = "softmax"
    """Router scores: softmax, or sigmoid (DeepSeek-V3)."""
    router_expert_bias: bool = False
    """Aux-loss-free load-balancing bias (DeepSeek-V3); megatron-core requires sigmoid scores."""
    router_topk_scaling_factor: Optional[float] = None
    """Multiplier on the top-k routing weights (DeepSeek-V3: 2.5); None = 1."""
    router_num_groups: Optional[int] = None
    """Expert groups for group-limited routing (DeepSeek-V3: 8); None = off."""
    router_group_topk: Optional[int] = None
    """Groups each token may route into (DeepSeek-V3: 4); set with router_num_groups."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1."""
    first_k_dense_layers: int = 0
    """Leading layers that use a dense MLP instead of MoE (DeepSeek-V3: 3)."""
    q_lora_rank: Optional[int] = None
    """MLA query compression rank; None = uncompressed queries."""
    kv_lora_rank: int = 0
    """MLA key/value compression rank; 0 = no MLA (standard GQA attention)."""
    qk_nope_head_dim: int = 0
    """MLA per-head query/key channels without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA per-head query/key channels with RoPE."""
    v_head_dim: int = 0
    """MLA per-head value channels."""

    def __post_init__(self) -> None:
        check_choice("family", self.family, MODEL_FAMILIES)
        if isinstance(self.rope_scaling, dict):  # as a config.json reader gives it
            self.rope_scaling = RopeScalingConfig(**self.rope_scaling)
        for key in FAMILY_DERIVED:
            if getattr(self, key) is None:  # an unmapped architecture's are its config.json's affair
                setattr(self, key, FAMILY_FIXED[self.family].get(key, ((False,),))[0][0])
        check_positive(
            self,
            (
                "hidden_size",
                "num_layers",
                "num_attention_heads",
                "num_kv_heads",
                "head_dim",
                "ffn_hidden_size",
                "vocab_size",
                "max_position_embeddings",
                "rope_theta",
                "norm_eps",
                "moe_top_k",
                "moe_ffn_hidden_size",
                "router_topk_scaling_factor",
                "q_lora_rank",
            ),
        )
        check_non_negative(
            self,
            (
                "num_experts",
                "num_shared_experts",
                "first_k_dense_layers",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            ),
        )
        self._check_attention()
        self._check_family()
        self._check_moe()
        self._check_router()
        self._check_family_fixed()
        self._check_router_rules()

    def _check_attention(self) -> None:
        if self.is_mla:
            check_positive(self, ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
            return
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "{p}hidden_size={h} is not divisible by {p}num_attention_heads={n}; set {p}head_dim explicitly",
                h=self.hidden_size,
                n=self.num_attention_heads,
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                "{p}num_kv_heads={kv} does not divide {p}num_attention_heads={n}",
                kv=self.num_kv_heads,
                n=self.num_attention_heads,
            )

    def _check_family(self) -> None:
        if self.family == UNMAPPED_FAMILY:
            if self.is_moe or self.is_mla:
                raise ConfigError(
                    "{p}family={fam!r} with routed experts or MLA: only dense architectures train without "
                    "a family mapping; use a mapped MoE family (" + ", ".join(MOE_FAMILIES) + ") with megatron",
                    fam=self.family,
                )
            return
        if FAMILIES[self.family].attention == "mla" and not self.is_mla:
            raise ConfigError(
                "{p}family={fam!r} uses MLA: set {p}kv_lora_rank, {p}qk_nope_head_dim, "
                "{p}qk_rope_head_dim and {p}v_head_dim > 0 (got kv_lora_rank={r})",
                fam=self.family,
                r=self.kv_lora_rank,
            )
        if self.family in MOE_FAMILIES and not self.is_moe:
            raise ConfigError("{p}family={fam!r} is an MoE family: set {p}num_experts > 0", fam=self.family)
        if self.family not in MOE_FAMILIES and self.is_moe:
            raise ConfigError(
                "{p}family={fam!r} is dense: set {p}num_experts=0 (got {e}), or use one of {moe}",
                fam=self.family,
                e=self.num_experts,
                moe=", ".join(MOE_FAMILIES),
            )

    def _check_family_fixed(self) -> None:
        # last: the general rules above name the better fix when both apply
        for key, (allowed, why) in FAMILY_FIXED[self.family].items():
            value = getattr(self, key)
            if value not in allowed:
                raise ConfigError(
                    "{p}{key}={value} with {p}family={fam!r}: {why}; set {p}{key}={fix}",
                    key=key,
                    value=_text(value),
                    fam=self.family,
                    why=why,
                    fix=_text(allowed[0]),
                )

    def _check_router_rules(self) -> None:
        for rule in ROUTER_RULES.get(self.family, ()):
            if rule.differs(self):
                settings = ", ".join(f"{{p}}{key}={_text(getattr(self, key))}" for key in rule.keys)
                raise ConfigError(
                    settings + " (config.json {hf}; megatron-core {mc}) with {p}family={fam!r}: {why}; {fix}",
                    hf=", ".join(rule.hf_keys),
                    mc=", ".join(rule.megatron_keys),
                    fam=self.family,
                    why=rule.why,
                    fix=rule.fix,
                )

    def _check_moe(self) -> None:
        if self.first_k_dense_layers >= self.num_layers:
            raise ConfigError(
                "{p}first_k_dense_layers={k} must be < {p}num_layers={n}",
                k=self.first_k_dense_layers,
                n=self.num_layers,
            )
        if self.is_moe and self.moe_top_k > self.num_experts:
            raise ConfigError(
                "{p}moe_top_k={k} must be <= {p}num_experts={e}",
                k=self.moe_top_k,
                e=self.num_experts,
            )

    def _check_router(self) -> None:
        check_choice("router_score_function", self.router_score_function, ("softmax", "sigmoid"))
        if self.router_expert_bias and self.router_score_function != "sigmoid":
            raise ConfigError(
                "{p}router_expert_bias=true needs {p}router_score_function='sigmoid' (got {f!r}); "
                "megatron-core supports the aux-loss-free bias only with sigmoid scores",
                f=self.router_score_function,
            )
        groups, group_topk = self.router_num_groups, self.router_group_topk
        if (groups is None) != (group_topk is None):
            raise ConfigError(
                "{p}router_num_groups={g} and {p}router_group_topk={k}: set both or neither",
                g=groups,
                k=group_topk,
            )
        if groups is not None:
            self._check_router_groups(groups, group_topk)

    def _check_router_groups(self, groups: int, group_topk: int) -> None:
        if groups <= 0 or not 0 < group_topk <= groups:
            raise ConfigError(
                "{p}router_group_topk={k} must be in 1..{p}router_num_groups={g}",
                k=group_topk,
                g=groups,
            )
        if self.num_experts % groups:
            raise ConfigError(
                "{p}router_num_groups={g} does not divide {p}num_experts={e}",
                g=groups,
                e=self.num_experts,
            )

    @property
    def head(self) -> str:
        """What the last stage ends in: ``lm`` (a causal LM's vocabulary projection) or ``score``
        (a one-label sequence-classification head: ``ScoreModelConfig``). Not a config key: the
        model directory's class says it."""
        return "lm"

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank > 0

    @property
    def kv_channels(self) -> int:
        """Per-head channels of standard attention: head_dim, or hidden_size // heads."""
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // self.num_attention_heads


@dataclass(kw_only=True)
class ScoreModelConfig(ModelConfig):
    """The same architecture ending in a one-label score head (``score.weight`` ``[1, H]``), as
    transformers' ``*ForSequenceClassification`` with ``num_labels=1``: a reward model. Its
    megatron-core model is the critic's (``megatron_adapters.critic``), always built untied."""

    @property
    def head(self) -> str:
        return "score"


def as_score_model(model: ModelConfig) -> ScoreModelConfig:
    """``model``'s architecture under a score head (a reward model trained from a causal LM)."""
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
    return ScoreModelConfig(**fields)
