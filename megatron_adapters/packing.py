"""Sequence packing and token-budget micro-batches for ``MegatronPolicy``.

```
this DP rank's rows [b, T] (right-padded)
   │ sample_lengths: tokens each row needs (up to its last marked token; 0 for padding rows)
   │ plan_fixed (train.micro_batch_size rows each)  |  plan_budget (LPT into k bins <= budget,
   │                                                |  k >= the most any DP rank needs)
   ▼
PackPlan: micro i = rows (r0, r1, ...) ──pack──► one row [1, W_i]:
   tokens  r0[0:n0] r1[0:n1] ... pad          every [b, T] field gathered the same way (routes
   positions 0..n0-1 0..n1-1 ... 0            too: a token's experts move with it), per-row
   segments  0 ...    1 ...    ... n          fields spread over their row's tokens
   ▼
attention: local spec ─ block-diagonal causal attention: megatron's core attention once per
                        segment (SegmentedAttention), the cost of the samples, not of W²
           TE spec    ─ PackedSeqParams(qkv_format="thd", cu_seqlens) from the same segments
   ▼
scores [1, W_i] ──unpack──► [b, T] (zeros where nothing was computed)
```

The first token of each sample has no context: its score is 0, as at position 0 of an unpacked
row. Padding after the samples is a segment of its own that nothing counts. Rotary embeddings
on the local spec are applied at the row's offsets (megatron's GPTModel builds them from the row
length, not from position ids): q·k under rotary depends only on the distance between two
tokens, and attention keeps both in one sample, so the scores are those of positions 0..n-1
(to rounding). On TE, the THD path restarts them at each sample from ``cu_seqlens``.

Legend: b rows on this DP rank, T columns, W packed row width, L MoE layers, k experts per token.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Sequence

import torch

from hfschema.packing import (  # the planning and the packing itself: shared with the FSDP2 backend
    FIRST_KEY,
    POSITIONS_KEY,
    SEGMENTS_KEY,
    PackPlan,
    balance_shares,
    pack,
    plan_budget,
    plan_fixed,
    sample_lengths,
    segment_lengths,
    unpack,
)

__all__ = [
    "FIRST_KEY",
    "POSITIONS_KEY",
    "SEGMENTS_KEY",
    "PackPlan",
    "SegmentedAttention",
    "balance_shares",
    "pack",
    "packed_seq_params",
    "plan_budget",
    "plan_fixed",
    "sample_lengths",
    "segment_lengths",
    "unpack",
]


class SegmentedAttention:
    """megatron's local core attention, run once per segment of a packed row while ``active``.

    The same numbers as one causal attention under a block-diagonal mask over the row, at the cost
    of the samples (sum of length²) instead of the row (width²), and without a width² mask. Wraps
    the ``forward`` of each local ``DotProductAttention`` of the chunks; outside ``active`` they
    run as before. Sound because nothing re-runs a forward later (no activation recompute).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        self.lengths: list[int] | None = None
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, DotProductAttention):
                    module.forward = partial(self._forward, module.forward)

    @contextlib.contextmanager
    def active(self, lengths: list[int]):
        """Split every core attention call by ``lengths`` (along the sequence) inside the block."""
        self.lengths = lengths
        try:
            yield
        finally:
            self.lengths = None

    def _forward(self, plain, query, key, value, attention_mask, *args, **kwargs):
        if self.lengths is None:
            return plain(query, key, value, attention_mask, *args, **kwargs)
        parts = zip(query.split(self.lengths), key.split(self.lengths), value.split(self.lengths))
        return torch.cat([plain(q, k, v, None, *args, **kwargs) for q, k, v in parts])  # [s, b, ...] each


def packed_seq_params(segments_1W: torch.Tensor):
    """megatron-core's ``PackedSeqParams`` for the THD path of TransformerEngine attention: the
    cumulative sequence lengths of the row's segments (the trailing padding is one segment), as
    int32 on the segments' device."""
    from megatron.core.packed_seq_params import PackedSeqParams

    seg_W = segments_1W[0]
    counts = torch.bincount(seg_W)
    counts = counts[counts > 0]  # the padding segment, when there is no padding
    cu_seqlens = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=seg_W.device)
    cu_seqlens[1:] = torch.cumsum(counts, dim=0).to(torch.int32)
    longest = int(counts.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def uses_te_attention(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the chunks' core attention is TransformerEngine's (the TE layer spec), which
    takes packed rows as THD with ``PackedSeqParams``; megatron's local attention takes a mask."""
    return any(type(m).__name__ == "TEDotProductAttention" for c in chunks for m in c.modules())
