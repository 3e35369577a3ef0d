"""Sequence packing and token-budget micro-batches: the ``packing`` config section, and the
planning and packing every trainer backend shares (``megatron_adapters/packing.py`` draws the
picture; each backend runs attention inside the samples its own way).

Legend: b rows on this DP rank, T columns, W packed row width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from hfschema.checks import check_positive
from hfschema.layout import ConfigError

if TYPE_CHECKING:  # the config section is read without torch (``hybridflow plan``); the packing imports it
    import torch

__all__ = [
    "FIRST_KEY",
    "POSITIONS_KEY",
    "SEGMENTS_KEY",
    "PackPlan",
    "PackingConfig",
    "balance_shares",
    "pack",
    "plan_budget",
    "plan_fixed",
    "sample_lengths",
    "segment_lengths",
    "unpack",
]


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
    import torch

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
    import torch

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
    import torch

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
    import torch

    counts = torch.bincount(segments_1W[0])
    return counts[counts > 0].tolist()
