"""LoRA settings of the RL actor (``lora:`` in ``hybridflow.config``), and their checks against
the model: the targets must exist in the family and the rank must fit every target's dims.
"""

from dataclasses import dataclass, field
from typing import Optional

from hfschema.checks import check_choice, check_non_negative, check_positive
from hfschema.layout import ConfigError, ParallelLayout
from hfschema.model import ModelConfig

__all__ = [
    "LORA_PUSHES",
    "LORA_TARGETS",
    "LoRAConfig",
    "adapter_params_per_rank",
    "check_lora_model",
    "engine_target_modules",
    "target_dims",
]

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts", "shared_experts")
"""Target names: megatron-core's attention projections, the dense MLP's projections, every
routed expert's fc1 / fc2, the shared experts' fc1 / fc2."""
LORA_PUSHES = ("merged", "adapter")
"""How the engine gets the trained adapters: merged into the weights, or as adapters."""
_HF_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""The Hugging Face modules (leaf names, every family here) of the dense targets."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the actor's linear layers during RL; the base weights stay frozen."""

    enabled: bool = False
    """Train adapters instead of the full model in RL (SFT stays full fine-tuning)."""
    rank: int = 16
    """Adapter rank r."""
    alpha: float = 32.0
    """Scale numerator: the adapter adds (alpha / rank) * B A x."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 keeps log-probs exact); its masks are
    keyed by step and module, so every layout draws the ones one process draws."""
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj"])
    """Modules that get adapters: linear_qkv, linear_proj, linear_fc1, linear_fc2 (dense MLP),
    experts (routed experts), shared_experts."""
    lr: Optional[float] = None
    """Peak learning rate of the adapters in RL; None = train.lr."""
    seed: int = 0
    """Seed of the A matrices' initialisation and of the dropout masks (the same under every layout)."""
    push: str = "merged"
    """Weight sync: ``merged`` pushes W + (alpha/rank) B A through the reshard plan every step;
    ``adapter`` pushes the base once (again after an engine restart) and then only the adapters,
    through SGLang's LoRA adapter API (SGLang engines, colocated or separate; dense targets)."""

    @property
    def pushes_adapters(self) -> bool:
        """Whether the engine gets the adapters apart from the base (``push=adapter``)."""
        return self.enabled and self.push == "adapter"

    def __post_init__(self) -> None:
        check_choice("push", self.push, LORA_PUSHES)
        check_positive(self, ("rank", "alpha", "lr"))
        check_non_negative(self, ("dropout",))
        if self.dropout >= 1:
            raise ConfigError("{p}dropout={value} must be < 1", value=self.dropout)
        for name in self.target_modules:
            if name not in LORA_TARGETS:
                raise ConfigError(
                    "{p}target_modules has {name!r}; valid targets: {valid}", name=name, valid=", ".join(LORA_TARGETS)
                )
        if not self.target_modules:
            raise ConfigError(
                "{p}target_modules is empty; name at least one of: {valid}", valid=", ".join(LORA_TARGETS)
            )


def engine_target_modules(targets: list[str]) -> list[str]:
    """The Hugging Face module names an inference engine adapts for ``targets`` (dense ones)."""
    return [name for target in targets for name in _HF_MODULES[target]]


def target_dims(model: ModelConfig, target: str) -> tuple[int, int] | None:
    """(in, out) features of ``target`` in ``model`` (fc1: gate and up together), or None when
    the model has no such module."""
    hidden, heads = model.hidden_size, model.num_attention_heads * model.kv_channels
    dense_layers = model.first_k_dense_layers if model.is_moe else model.num_layers
    dims = {
        "linear_qkv": (hidden, heads + 2 * model.num_kv_heads * model.kv_channels),
        "linear_proj": (heads, hidden),
        "linear_fc1": (hidden, 2 * model.ffn_hidden_size) if dense_layers else None,
        "linear_fc2": (model.ffn_hidden_size, hidden) if dense_layers else None,
        "experts": (hidden, model.moe_ffn_hidden_size) if model.is_moe else None,
        "shared_experts": (
            (hidden, model.moe_ffn_hidden_size * model.num_shared_experts)
            if model.is_moe and model.num_shared_experts
            else None
        ),
    }
    if model.kv_lora_rank:  # MLA has no linear_qkv
        dims["linear_qkv"] = None
    return dims[target]


def check_lora_model(lora: LoRAConfig, model: ModelConfig, layout: ParallelLayout) -> None:
    """ValueError (naming ``lora.*`` keys) unless every target exists in ``model`` and fits the rank."""
    if not lora.enabled:
        return
    for target in lora.target_modules:
        dims = target_dims(model, target)
        if dims is None:
            raise ValueError(
                f"lora.target_modules has {target!r}, which model.family={model.family!r} "
                f"(num_experts={model.num_experts}, first_k_dense_layers={model.first_k_dense_layers}, "
                f"num_shared_experts={model.num_shared_experts}) does not have; remove it"
            )
        if lora.rank > min(dims):
            raise ValueError(
                f"lora.rank={lora.rank} is larger than {target}'s smaller dimension {min(dims)} "
                f"(in={dims[0]}, out={dims[1]}); lower lora.rank to <= {min(dims)}"
            )
    experts = "experts" in lora.target_modules and model.is_moe
    if experts and lora.rank % layout.etp:
        raise ValueError(
            f"lora.rank={lora.rank} with actor.parallel.etp={layout.etp}: expert adapters split their "
            f"rank over the etp ranks; use a lora.rank divisible by {layout.etp}"
        )


def _pair(rank: int, dims: tuple[int, int], tp: int, column: bool) -> int:
    """One rank's A + B of one module: column: A whole, B's rows / tp; row: A's columns / tp, B whole."""
    fan_in, fan_out = dims
    return rank * (fan_in + fan_out // tp) if column else rank * (fan_in // tp + fan_out)


def adapter_params_per_rank(
    lora: LoRAConfig, model: ModelConfig, layout: ParallelLayout, *, moe_layer: bool
) -> tuple[int, int]:
    """(dense, routed-expert) adapter parameters one rank holds for one layer (MoE or dense)."""
    if not lora.enabled:
        return 0, 0
    r, tp, targets = lora.rank, layout.tp, set(lora.target_modules)
    dense = experts = 0
    for name, column in (("linear_qkv", True), ("linear_proj", False)):
        if name in targets and (dims := target_dims(model, name)):
            dense += _pair(r, dims, tp, column)
    if not moe_layer:
        for name, column in (("linear_fc1", True), ("linear_fc2", False)):
            if name in targets and (dims := target_dims(model, name)):
                dense += _pair(r, dims, tp, column)
        return dense, 0
    hidden, ffn = model.hidden_size, model.moe_ffn_hidden_size
    if "shared_experts" in targets and model.num_shared_experts:
        shared = ffn * model.num_shared_experts
        dense += _pair(r, (hidden, 2 * shared), tp, True) + _pair(r, (shared, hidden), tp, False)
    if "experts" in targets:
        per_expert = r * (hidden + 2 * ffn) + r * (ffn + hidden)
        experts = per_expert * model.num_experts // (layout.ep * layout.etp)
    return dense, experts
