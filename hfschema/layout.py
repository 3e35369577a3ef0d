"""Parallel layouts as validated, frozen values.

A ``ParallelLayout`` names the megatron-core parallel axes of one role (actor,
reference, critic). It is checked when it is built, so a layout that exists is a layout
megatron-core can lay out on its world:

    dense grid:   tp x cp x dp x pp                    = world_size
    expert grid:  etp x ep x expert_dp x pp            = world_size

``check_model`` then checks the layout against a model (heads, layers, experts), and
``check_world_size`` against the number of launched ranks. Nothing here touches torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from hfschema.model import ModelConfig

__all__ = ["ConfigError", "ParallelLayout", "divisors"]


class ConfigError(ValueError):
    """A bad value inside one config section, raised by that section's ``__post_init__``.

    A nested dataclass does not know where it sits in the config tree, so its message is a
    ``str.format`` template in which ``{p}`` marks the section path. ``load_config`` fills
    the path in with :meth:`under`; built directly, the message names the bare field.
    """

    def __init__(self, template: str, /, *, prefix: str = "", **values: Any) -> None:
        self.template = template
        self.prefix = prefix
        self.values = values
        super().__init__(template.format(p=prefix, **values))

    def under(self, section: str) -> ConfigError:
        """The same error, with ``section`` (e.g. ``"actor.parallel"``) put before its keys."""
        if not section:
            return self
        return ConfigError(self.template, prefix=f"{section}.{self.prefix}", **self.values)


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _format_choices(values: Iterable[int], limit: int = 12) -> str:
    """``"1, 2, 4"``; long lists are cut after ``limit`` entries."""
    values = list(values)
    text = ", ".join(str(v) for v in values[:limit])
    return text + ", ..." if len(values) > limit else text


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Sizes of the megatron-core parallel axes of one role; validated at construction."""

    tp: int = 1
    """Tensor-parallel size of attention and dense layers."""
    pp: int = 1
    """Pipeline-parallel size (number of pipeline stages)."""
    vpp: int = 1
    """Virtual pipeline stages per pp rank (interleaved schedule); 1 = off."""
    ep: int = 1
    """Expert-parallel size: experts are split across this many ranks."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's FFN is split across this many ranks."""
    cp: int = 1
    """Context-parallel size: the sequence is split across this many ranks."""
    dp: int = 1
    """Data-parallel size of the dense grid."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 1:
                raise ConfigError("{p}{axis}={value} must be >= 1", axis=f.name, value=value)
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("{p}vpp={vpp} needs pipeline parallelism; set {p}pp > 1 or {p}vpp=1", vpp=self.vpp)
        self._check_expert_grid()

    def _check_expert_grid(self) -> None:
        # megatron-core builds the expert grid etp x ep x expert_dp x pp over the same ranks
        # as the dense grid, so etp*ep*pp must divide the world size.
        expert_model = self.etp * self.ep * self.pp
        if self.world_size % expert_model:
            raise ConfigError(
                "{p}etp*ep*pp = {etp}*{ep}*{pp} = {em} does not divide the world size "
                "tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {world}; megatron-core lays experts out "
                "as etp x ep x expert_dp x pp over the same ranks",
                etp=self.etp,
                ep=self.ep,
                pp=self.pp,
                em=expert_model,
                tp=self.tp,
                cp=self.cp,
                dp=self.dp,
                world=self.world_size,
            )

    @property
    def world_size(self) -> int:
        """Number of ranks the layout occupies: tp * pp * cp * dp."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert grid: world_size // (etp * ep * pp)."""
        self._check_expert_grid()
        return self.world_size // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        """One line, e.g. ``tp=2 pp=1 vpp=1 ep=2 etp=1 cp=1 dp=2 (world 4, expert_dp 2)``."""
        axes = " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"{axes} (world {self.world_size}, expert_dp {self.expert_dp})"

    def padded_vocab_size(self, model: ModelConfig, divisible_by: int = 128) -> int:
        """``model.vocab_size`` rounded up to a multiple of ``divisible_by * tp`` (megatron)."""
        multiple = divisible_by * self.tp
        return -(-model.vocab_size // multiple) * multiple

    def check_world_size(self, world_size: int, *, prefix: str = "parallel") -> None:
        """Raise ``ValueError`` unless the layout fills exactly ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} does not match {prefix}: tp*pp*cp*dp = "
                f"{self.tp}*{self.pp}*{self.cp}*{self.dp} = {self.world_size}"
            )

    def check_model(self, model: ModelConfig, *, prefix: str = "parallel") -> None:
        """Raise ``ValueError`` naming ``prefix`` keys if megatron-core cannot shard ``model``."""
        self._check_tp(model, prefix)
        self._check_pp(model, prefix)
        self._check_experts(model, prefix)

    def _tp_sharded_sizes(self, model: ModelConfig) -> dict[str, int]:
        """Model sizes that tensor parallelism splits, keyed by their config path."""
        sizes = {"model.num_attention_heads": model.num_attention_heads}
        if not model.is_mla:  # MLA compresses K/V into one latent shared by all heads
            sizes["model.num_kv_heads"] = model.num_kv_heads
        if not model.is_moe or model.first_k_dense_layers > 0:
            sizes["model.ffn_hidden_size"] = model.ffn_hidden_size
        if model.is_moe and model.num_shared_experts > 0:
            # megatron-core's shared-expert MLP is split by tp like a dense MLP
            shared_ffn = model.moe_ffn_hidden_size * model.num_shared_experts
            sizes["model.moe_ffn_hidden_size*num_shared_experts"] = shared_ffn
        return sizes

    def _check_tp(self, model: ModelConfig, prefix: str) -> None:
        sizes = self._tp_sharded_sizes(model)
        for key, size in sizes.items():
            if size % self.tp:
                valid = [d for d in divisors(model.num_attention_heads) if all(n % d == 0 for n in sizes.values())]
                raise ValueError(
                    f"{prefix}.tp={self.tp} does not divide {key}={size}; valid tp values: {_format_choices(valid)}"
                )

    def _check_pp(self, model: ModelConfig, prefix: str) -> None:
        stages = self.pp * self.vpp
        if model.num_layers % stages:
            valid = [d for d in divisors(model.num_layers) if d % self.vpp == 0]
            raise ValueError(
                f"{prefix}.pp*vpp = {self.pp}*{self.vpp} = {stages} does not divide "
                f"model.num_layers={model.num_layers}; "
                f"valid pp*vpp values: {_format_choices(valid)}"
            )

    def _check_experts(self, model: ModelConfig, prefix: str) -> None:
        if not model.is_moe:
            if self.ep > 1 or self.etp > 1:
                raise ValueError(
                    f"{prefix}.ep={self.ep} and {prefix}.etp={self.etp} need an MoE model, but "
                    f"model.num_experts=0; set both to 1 for a dense model"
                )
            return
        if model.num_experts % self.ep:
            raise ValueError(
                f"{prefix}.ep={self.ep} does not divide model.num_experts={model.num_experts}; "
                f"valid ep values: {_format_choices(divisors(model.num_experts))}"
            )
        if model.moe_ffn_hidden_size % self.etp:
            raise ValueError(
                f"{prefix}.etp={self.etp} does not divide model.moe_ffn_hidden_size="
                f"{model.moe_ffn_hidden_size}; valid etp values: "
                f"{_format_choices(divisors(model.moe_ffn_hidden_size))}"
            )
