"""The ``packing`` config section: sequence packing and token-budget micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hfschema.checks import check_positive
from hfschema.layout import ConfigError

__all__ = ["PackingConfig"]


@dataclass(kw_only=True)
class PackingConfig:
    """How the trained roles (actor, reference, critic) lay samples out in micro-batches."""

    enabled: bool = False
    """Pack several samples into one row per micro-batch: per-sample position ids, attention
    confined to each sample, no padding between samples (off: one right-padded row per sample)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of one packed micro-batch: samples are grouped into micro-batches of at most
    this many tokens, balanced over micro-batches and data-parallel ranks; null keeps
    ``train.micro_batch_size`` samples per micro-batch. Needs ``enabled``."""

    def __post_init__(self) -> None:
        check_positive(self, ("max_tokens_per_micro_batch",))
        if self.max_tokens_per_micro_batch is not None and not self.enabled:
            raise ConfigError(
                "{p}max_tokens_per_micro_batch={b} needs {p}enabled=true (token-budget micro-batches "
                "are packed rows); set {p}enabled=true or {p}max_tokens_per_micro_batch=null",
                b=self.max_tokens_per_micro_batch,
            )

    @property
    def budget(self) -> Optional[int]:
        """The token budget when packing is on, else None."""
        return self.max_tokens_per_micro_batch if self.enabled else None
