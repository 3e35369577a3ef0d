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
import dataclasses
import math
from functools import partial
from itertools import accumulate
from typing import Mapping, Sequence

import torch

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

FIRST_KEY = "packed_first"
"""``[1, W]`` bool: a sample's first token, or padding (scored 0)."""
POSITIONS_KEY = "packed_positions"
"""``[1, W]`` position of each token inside its sample."""
SEGMENTS_KEY = "packed_segments"
"""``[1, W]`` index of each token's sample in the row; the padding after them is one more."""


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Which rows each micro-batch packs, and how many tokens of each row."""

    micro_rows: tuple[tuple[int, ...], ...]
    """Rows (indices into this rank's rows) of each micro-batch, in packing order."""
    lengths: tuple[int, ...]
    """Tokens packed of each row."""
    multiple: int = 1
    """Each packed row's width is a multiple of this (tp * cp: sequence parallelism splits it)."""
    width: int | None = None
    """One width for every micro-batch (pipeline stages exchange fixed shapes), or None."""

    def tokens(self, index: int) -> int:
        """Real tokens of micro-batch ``index``."""
        return sum(self.lengths[r] for r in self.micro_rows[index])

    def row_width(self, index: int) -> int:
        """Width of micro-batch ``index``'s packed row (real tokens and padding)."""
        if self.width is not None:
            return self.width
        return _round_up(max(self.tokens(index), 1), self.multiple)

    def with_common_width(self) -> "PackPlan":
        """Every micro-batch as wide as the widest."""
        widest = max((self.row_width(i) for i in range(len(self.micro_rows))), default=self.multiple)
        return dataclasses.replace(self, width=widest)

    def processed_tokens(self) -> int:
        """Tokens the model runs, padding included."""
        return sum(self.row_width(i) for i in range(len(self.micro_rows)))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------------------ planning (pure)


def sample_lengths(batch: Mapping[str, torch.Tensor]) -> list[int]:
    """Tokens each row needs: up to its last token marked by any ``*mask`` field (what any loss,
    statistic or caller reads); the whole row when the batch has no mask; 0 for a row with
    nothing marked (a padding row). Later tokens cannot change earlier ones under causal
    attention, so they are dropped."""
    ids_BT = batch["input_ids"]
    rows, cols = ids_BT.shape
    marks = [v != 0 for k, v in batch.items() if k.endswith("mask") and tuple(v.shape) == (rows, cols)]
    if not marks:
        return [cols] * rows
    marked_BT = torch.stack(marks).any(dim=0)
    last_B = torch.where(marked_BT, torch.arange(1, cols + 1, device=ids_BT.device), 0).max(dim=1).values
    return last_B.tolist()


def plan_fixed(lengths: Sequence[int], micro_batch_size: int, *, multiple: int = 1) -> PackPlan:
    """``micro_batch_size`` consecutive rows per micro-batch, each micro-batch one packed row
    (the same micro-batches as unpacked training; rows of no tokens left out)."""
    rows = len(lengths)
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows per DP rank do not split into micro-batches of {micro_batch_size}")
    micros = tuple(
        tuple(r for r in range(i, i + micro_batch_size) if lengths[r] > 0) for i in range(0, rows, micro_batch_size)
    )
    return PackPlan(micro_rows=micros, lengths=tuple(lengths), multiple=multiple)


def plan_budget(lengths: Sequence[int], budget: int, *, min_micro_batches: int = 1, multiple: int = 1) -> PackPlan:
    """The fewest micro-batches (at least ``min_micro_batches``) of at most ``budget`` tokens,
    each row's width included, with tokens spread evenly over them: longest rows first, each
    into the least-filled micro-batch (LPT); one more micro-batch whenever a row does not fit."""
    capacity = budget - budget % multiple  # a packed row is padded up to the multiple
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(
            f"a sample of {max(too_long)} tokens exceeds packing.max_tokens_per_micro_batch="
            f"{budget} (rounded down to a multiple of {multiple}: {capacity})"
        )
    order = sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: (-lengths[r], r))
    count = max(min_micro_batches, math.ceil(sum(lengths) / max(capacity, 1)), 1)
    while True:
        bins = _lpt(order, lengths, count, capacity)
        if bins is not None:
            return PackPlan(micro_rows=tuple(tuple(sorted(b)) for b in bins), lengths=tuple(lengths), multiple=multiple)
        count += 1


def _lpt(order: Sequence[int], lengths: Sequence[int], count: int, capacity: int) -> list[list[int]] | None:
    """Rows in ``order`` into ``count`` bins, each to the least-filled; None if one does not fit."""
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for row in order:
        target = min(range(count), key=lambda i: (loads[i], i))
        if loads[target] + lengths[row] > capacity:
            return None
        bins[target].append(row)
        loads[target] += lengths[row]
    return bins


def balance_shares(lengths: Sequence[int], num_shares: int) -> list[list[int]]:
    """Rows into ``num_shares`` equal-count shares (data-parallel ranks) with token totals as
    close as greedy gets: longest first, each to the lightest share that still has room."""
    rows = len(lengths)
    if rows % num_shares:
        raise ValueError(f"batch of {rows} rows does not split over data-parallel size {num_shares}")
    room = rows // num_shares
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    loads = [0] * num_shares
    for row in sorted(range(rows), key=lambda r: (-lengths[r], r)):
        target = min((i for i in range(num_shares) if len(shares[i]) < room), key=lambda i: (loads[i], i))
        shares[target].append(row)
        loads[target] += lengths[row]
    return [sorted(s) for s in shares]


# ------------------------------------------------------------------------------ tensors


def _index(plan: PackPlan, index: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, segment) of each real token of micro-batch ``index``."""
    rows = plan.micro_rows[index]
    lengths = [plan.lengths[r] for r in rows]
    row_N = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))
    seg_N = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths, dtype=torch.long))
    starts = torch.tensor([0, *accumulate(lengths)][:-1], dtype=torch.long)
    col_N = torch.arange(row_N.numel()) - starts[seg_N] if row_N.numel() else row_N
    return row_N.to(device), col_N.to(device), seg_N.to(device)


def pack(batch: Mapping[str, torch.Tensor], plan: PackPlan, index: int, *, fills: Mapping[str, int]) -> dict:
    """Micro-batch ``index`` of ``plan`` as one packed row ``[1, W]``: ``[b, T, ...]`` fields
    gathered token by token, ``[b, ...]`` fields repeated over their row's tokens, padding filled
    with ``fills[key]`` (0 by default); plus the position, segment and first-token fields."""
    ids_BT = batch["input_ids"]
    rows, cols = ids_BT.shape
    row_N, col_N, seg_N = _index(plan, index, ids_BT.device)
    real, width = row_N.numel(), plan.row_width(index)
    out = {}
    for key, value in batch.items():
        token_wise = value.dim() >= 2 and value.shape[0] == rows and value.shape[1] == cols
        picked = value[row_N, col_N] if token_wise else value[row_N]
        pad = picked.new_full((width - real, *picked.shape[1:]), fills.get(key, 0))
        out[key] = torch.cat([picked, pad])[None]
    pad_positions = torch.zeros(width - real, dtype=torch.long, device=ids_BT.device)
    out[POSITIONS_KEY] = torch.cat([col_N, pad_positions])[None]
    out[SEGMENTS_KEY] = torch.cat([seg_N, pad_positions + len(plan.micro_rows[index])])[None]
    out[FIRST_KEY] = out[POSITIONS_KEY] == 0
    return out


def unpack(packed: Sequence[torch.Tensor], plan: PackPlan, shape: Sequence[int], *, fill=0) -> torch.Tensor:
    """Packed rows ``[1, W_i, ...]`` (one per micro-batch) back to this rank's ``shape``
    (``[b, T, ...]``); ``fill`` where no token was computed."""
    first = packed[0]
    out = first.new_full(tuple(shape), fill)
    for index, row in enumerate(packed):
        row_N, col_N, _ = _index(plan, index, row.device)
        out[row_N, col_N] = row[0, : row_N.numel()]
    return out


def segment_lengths(segments_1W: torch.Tensor) -> list[int]:
    """Lengths of a packed row's segments (its samples, then the padding if any), in order."""
    counts = torch.bincount(segments_1W[0])
    return counts[counts > 0].tolist()


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
