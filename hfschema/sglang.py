"""The parallel settings of the SGLang engines, and SGLang's vocabulary padding.

Values only: ``SGLangSettings`` checks the engine's own rules at construction (``dp_size``
divides ``tp``, ``ep * moe_dp`` divides ``tp``); what the settings need of a model (heads,
experts, FFN sizes) is checked by ``reshard.sglang.check_settings``, and the per-rank
parameter layout they imply is planned by ``reshard.sglang.sglang_layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfschema.layout import divisors

__all__ = ["SGLangSettings", "pad_vocab"]


@dataclass(frozen=True, kw_only=True)
class SGLangSettings:
    """Parallel settings of the SGLang engines (server-args names in brackets)."""

    tp: int = 1
    """Ranks per engine (``--tp-size``)."""
    ep: int = 1
    """Expert-parallel size inside an engine (``--ep-size``)."""
    moe_dp: int = 1
    """MoE data-parallel size (``--moe-dp-size``); moe_tp = tp / ep / moe_dp. Only 1 for now:
    SGLang pairs moe_dp > 1 with attention context parallelism, which is not planned."""
    enable_dp_attention: bool = False
    """Attention data parallel (``--enable-dp-attention``): attention tp = tp / dp_size."""
    dp_size: int = 1
    """Attention DP groups per engine (``--dp-size``); > 1 only with DP attention."""
    enable_dp_lm_head: bool = False
    """Split the LM head over the attention-TP group instead of tp (``--enable-dp-lm-head``)."""
    num_replicas: int = 1
    """Independent engines; ranks are numbered engine-major."""
    physical_to_logical: tuple[tuple[int, ...], ...] = ()
    """EPLB map: () = identity; one row for every layer, or one row per layer. A row lists the
    logical expert of each physical slot; num_physical_experts = len(row) >= num_experts."""

    def __post_init__(self) -> None:
        for key in ("tp", "ep", "moe_dp", "dp_size", "num_replicas"):
            if getattr(self, key) < 1:
                raise ValueError(f"sglang.{key}={getattr(self, key)} must be >= 1")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(
                f"sglang.dp_size={self.dp_size} needs sglang.enable_dp_attention=true "
                "(independent engines are sglang.num_replicas)"
            )
        if self.tp % self.dp_size:
            raise ValueError(f"sglang.dp_size={self.dp_size} must divide sglang.tp={self.tp}")
        if self.moe_dp > 1:
            raise ValueError(
                f"sglang.moe_dp={self.moe_dp}: SGLang 0.5.23 runs MoE data parallelism only with "
                f"attention context parallelism of the same size (--attn-cp-size), which hybridflow "
                f"neither starts nor plans; set sglang.moe_dp=1 (or raise sglang.ep)"
            )
        if self.tp % (self.ep * self.moe_dp):
            raise ValueError(
                f"sglang.ep*moe_dp = {self.ep}*{self.moe_dp} must divide sglang.tp={self.tp} "
                f"(moe_tp = tp / ep / moe_dp); valid ep values: "
                f"{', '.join(str(d) for d in divisors(self.tp // self.moe_dp))}"
            )

    @property
    def attn_tp(self) -> int:
        """Attention tensor-parallel size."""
        return self.tp // self.dp_size

    @property
    def moe_tp(self) -> int:
        """Tensor-parallel size inside each expert."""
        return self.tp // self.ep // self.moe_dp

    @property
    def num_ranks(self) -> int:
        """Ranks of all replicas."""
        return self.tp * self.num_replicas

    def describe(self, engine: str = "sglang") -> str:
        """One line, e.g. ``sglang tp=8 ep=8 dp_attention=8 x128 replicas (1024 ranks)``."""
        text = f"{engine} tp={self.tp} ep={self.ep}"
        if self.moe_dp > 1:
            text += f" moe_dp={self.moe_dp}"
        if self.enable_dp_attention:
            text += f" dp_attention={self.dp_size}"
        if self.enable_dp_lm_head:
            text += " dp_lm_head"
        if self.physical_to_logical:
            text += f" eplb={len(self.physical_to_logical[0])} physical experts"
        return text + f" x{self.num_replicas} replicas ({self.num_ranks} ranks)"


def pad_vocab(vocab: int, parts: int) -> int:
    """SGLang's padded vocab: a multiple of 64, or of 64 * parts when 64 does not split evenly.

    Mirrors ``VocabParallelEmbedding.__init__`` (``pad_vocab_size``, ``padding_size *= tp_size``).
    """
    pad = 64
    if -(-vocab // pad) * pad % parts:
        pad *= parts
    return -(-vocab // pad) * pad
