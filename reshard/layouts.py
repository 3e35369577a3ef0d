"""Tensor layouts: which box of which canonical tensor each rank holds, and where in its params.

Both sides of a reshard are described the same way. A ``Shard`` is a box of one canonical
tensor together with the place it occupies inside a rank's own (fused) parameter, and the
ranks that have it there: on the Megatron side the ranks *holding* it (data-parallel copies
are candidate sources), on the SGLang side the ranks *needing* it. A ``TensorLayout`` is all
shards of all canonical tensors of one side, plus every rank's parameter shapes (what an
executor allocates). ``RankHoldings`` is the same information seen from one rank.

    side builder (megatron.py / sglang.py)
        for each canonical tensor: rule(tensor) -> pieces (box, param box, position)
        position -> ranks            (the side's rank-order convention)
        LayoutBuilder: merge identical (tensor, box, param, param box), intern rank tuples
        -> TensorLayout

Rank tuples are interned: thousands of expert shards share a handful of tuples, which keeps
a 1,024-rank, 671B-parameter layout to a few tens of MB.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from hfschema.model import ModelConfig
from reshard.families import DTYPE_BYTES, CanonicalTensor
from reshard.regions import Region, num_elements

__all__ = ["Holding", "LayoutBuilder", "ParamInfo", "RankHoldings", "Shard", "TensorLayout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """A box of a canonical tensor, where it sits in the ranks' parameter, and those ranks."""

    tensor: str
    """Canonical (Hugging Face) tensor name."""
    region: Region
    """Box of the canonical tensor."""
    param: str
    """The side's parameter that holds the box (e.g. ``...linear_qkv.weight``)."""
    param_region: Region
    """Box inside that parameter: same trailing extents as ``region``, maybe extra unit dims."""
    ranks: tuple[int, ...]
    """Ranks (of this side) that hold (source) or need (destination) exactly this, ascending."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamInfo:
    """One parameter of some ranks, with its per-rank (local) shape."""

    name: str
    """Parameter name on the side (global layer numbering)."""
    shape: tuple[int, ...]
    """Local shape on each of ``ranks`` (includes padding rows / unused slots)."""
    ranks: tuple[int, ...]
    """Ranks that have this parameter with this shape."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Holding:
    """One entry of a rank's holdings: a canonical box and where it lies in the rank's param."""

    tensor: str
    """Canonical tensor name."""
    region: Region
    """Box of the canonical tensor."""
    param: str
    """Parameter of the rank holding it."""
    param_region: Region
    """Box inside that parameter."""


@dataclass(frozen=True, kw_only=True)
class RankHoldings:
    """Everything one rank holds (source) or needs (destination)."""

    rank: int
    """The rank, on its side."""
    holdings: tuple[Holding, ...]
    """Its boxes, in canonical-tensor order."""
    param_shapes: Mapping[str, tuple[int, ...]]
    """Its parameters and their local shapes."""


@dataclass(frozen=True, kw_only=True, eq=False)
class TensorLayout:
    """One side of a reshard: every canonical tensor and every rank's part of it."""

    side: str
    """``megatron`` (source) or ``sglang`` (destination)."""
    description: str
    """The layout as one line of text (e.g. ``megatron tp=2 pp=2 ep=4 ...``)."""
    model: ModelConfig
    """The model both sides must agree on."""
    dtype: str
    """Default element type of the weights."""
    num_ranks: int
    """Ranks on this side, numbered 0..num_ranks-1."""
    tensors: Mapping[str, CanonicalTensor]
    """Canonical tensors by name, in registry order."""
    shards: Mapping[str, tuple[Shard, ...]]
    """Shards of each canonical tensor."""
    params: tuple[ParamInfo, ...]
    """Every (parameter, shape, ranks) group of the side."""

    def shard_nbytes(self, shard: Shard) -> int:
        """Bytes of one copy of the shard's box."""
        return num_elements(shard.region) * DTYPE_BYTES[self.tensors[shard.tensor].dtype]

    def holdings(self, rank: int) -> RankHoldings:
        """What ``rank`` holds (or needs); scans every shard: call it once per rank."""
        self.check_rank(rank)
        held = tuple(
            Holding(tensor=s.tensor, region=s.region, param=s.param, param_region=s.param_region)
            for shards in self.shards.values()
            for s in shards
            if rank in s.ranks
        )
        return RankHoldings(rank=rank, holdings=held, param_shapes=self.param_shapes(rank))

    def param_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Local shape of each parameter of ``rank`` (what the executor allocates)."""
        self.check_rank(rank)
        return {p.name: p.shape for p in self.params if rank in p.ranks}

    def check_rank(self, rank: int) -> None:
        """Raise ValueError unless ``rank`` exists on this side."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"{self.side} rank {rank} does not exist: this layout has ranks 0..{self.num_ranks - 1}")


class LayoutBuilder:
    """Collects pieces from a side's rules and builds a ``TensorLayout``.

    Identical (tensor, box, param, param box) pieces reported for different positions (kv heads
    replicated over tp ranks, moe_dp copies) are merged into one shard with the union of ranks.
    """

    def __init__(self, tensors: Iterable[CanonicalTensor]) -> None:
        self._tensors = {t.name: t for t in tensors}
        # value dicts are ordered sets of rank tuples (most keys get exactly one)
        self._pieces: dict[str, dict[tuple, dict[tuple[int, ...], None]]] = {name: {} for name in self._tensors}
        self._params: dict[tuple[str, tuple[int, ...]], dict[tuple[int, ...], None]] = {}
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}

    def intern(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """One shared tuple object per distinct sorted rank set."""
        key = tuple(sorted(ranks))
        return self._interned.setdefault(key, key)

    def add(
        self,
        tensor: str,
        region: Optional[Region],
        param: str,
        param_region: Optional[Region],
        param_shape: tuple[int, ...],
        ranks: tuple[int, ...],
    ) -> None:
        """Record that ``ranks`` have ``region`` of ``tensor`` at ``param_region`` of ``param``.

        ``region`` None records only the parameter (a rank whose vocab rows are all padding).
        """
        if region is not None:
            self._pieces[tensor].setdefault((region, param, param_region), {})[ranks] = None
        self._params.setdefault((param, param_shape), {})[ranks] = None

    def _merged(self, groups: dict[tuple[int, ...], None]) -> tuple[int, ...]:
        if len(groups) == 1:
            return next(iter(groups))
        return self.intern({r for g in groups for r in g})

    def build(self, *, side: str, description: str, model: ModelConfig, dtype: str, num_ranks: int) -> TensorLayout:
        """The finished layout."""
        shards = {
            name: tuple(
                Shard(tensor=name, region=region, param=param, param_region=param_region, ranks=self._merged(groups))
                for (region, param, param_region), groups in pieces.items()
            )
            for name, pieces in self._pieces.items()
        }
        params = tuple(
            ParamInfo(name=name, shape=shape, ranks=self._merged(groups))
            for (name, shape), groups in self._params.items()
        )
        return TensorLayout(
            side=side,
            description=description,
            model=model,
            dtype=dtype,
            num_ranks=num_ranks,
            tensors=self._tensors,
            shards=shards,
            params=params,
        )
