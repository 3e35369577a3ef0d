"""The pure reshard planner: for every box a destination rank needs, a source rank that has it.

    source TensorLayout (megatron)      destination TensorLayout (sglang)      Topology
              |                                    |                               |
              +---------------+--------------------+                               |
                              v                                                    |
     check: same model (field by field), same tensors and dtypes, every rank placed <+
                              v
     per canonical tensor: source boxes (with the ranks holding each, all copies)
                           x destination shards (with the ranks needing each)
                           -> slices = box intersections (interval arithmetic)
                              v
     bundle slices by their (holding ranks, needing ranks) pair
                              v
     per (bundle, needing rank), largest bundles first, needing ranks ascending:
         a holder on the same device  -> local  (copy, no network bytes)
         else holders on the same node -> intra  (least bytes sent so far, then lowest rank)
         else all holders               -> inter  (least bytes sent so far, then lowest rank)
                              v
     Plan: bundles (shared slice lists) + routes (src rank, dst rank, kind, bundle)
           .transfers() / .transfers_for(rank) expand routes into Transfer values

Every destination element is covered exactly once: the source boxes of a tensor partition it,
so the slices of one destination shard partition the shard, and each (bundle, needing rank)
gets exactly one route. No torch, no process groups, no weights: a 671B plan is shapes only.
Routes are compact on purpose: a 1,024-rank DeepSeek-V3 plan has millions of
(slice, destination) pairs but a few hundred thousand routes; statistics are computed from the
routes exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
import numpy as np

from reshard.families import DTYPE_BYTES
from reshard.layouts import Shard, TensorLayout
from reshard.regions import Region, gc_paused, intersect, map_into, num_elements
from reshard.topology import Device, Topology

__all__ = ["KINDS", "Bundle", "Plan", "Slice", "Transfer", "check_compatible", "plan_reshard"]

KINDS = ("local", "intra", "inter")
"""Route kinds: same device (local copy), same node, across nodes."""
LOCAL, INTRA, INTER = range(3)


@dataclass(frozen=True, kw_only=True, slots=True)
class Slice:
    """A box of one canonical tensor inside one source box and one destination shard."""

    tensor: str
    """Canonical tensor name."""
    region: Region
    """The box (canonical coordinates)."""
    sources: tuple[Shard, ...]
    """Source shards with exactly the enclosing box (one per copy: tied embeddings have two)."""
    destination: Shard
    """The destination shard it is part of."""
    nbytes: int
    """Bytes of the box."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bundle:
    """Slices held by the same source ranks and needed by the same destination ranks."""

    holders: tuple[int, ...]
    """Source ranks holding every slice (candidate sources), ascending."""
    needers: tuple[int, ...]
    """Destination ranks needing every slice, ascending."""
    slices: tuple[Slice, ...]
    """The slices, in canonical-tensor order."""
    nbytes: int
    """Bytes of all slices (what one route of this bundle moves)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One box from one source rank's parameter into one destination rank's parameter."""

    src_rank: int
    """Source (Megatron) rank."""
    dst_rank: int
    """Destination (SGLang) rank."""
    tensor: str
    """Canonical tensor name."""
    region: Region
    """The box in canonical coordinates."""
    src_param: str
    """Source parameter it is read from."""
    src_region: Region
    """Box inside ``src_param``."""
    dst_param: str
    """Destination parameter it is written to."""
    dst_region: Region
    """Box inside ``dst_param``."""
    nbytes: int
    """Bytes moved."""
    kind: str
    """``local`` (same device), ``intra`` (same node) or ``inter`` (across nodes)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Plan:
    """A reshard plan: bundles of slices and the routes that deliver each bundle to each needer."""

    source: TensorLayout
    """Source side."""
    destination: TensorLayout
    """Destination side."""
    topology: Topology
    """Devices of both sides."""
    bundles: tuple[Bundle, ...]
    """All bundles; routes refer to them by index."""
    route_src: np.ndarray
    """Source rank of each route (int64)."""
    route_dst: np.ndarray
    """Destination rank of each route (int64)."""
    route_kind: np.ndarray
    """Kind of each route: index into ``KINDS`` (int8)."""
    route_bundle: np.ndarray
    """Bundle index of each route (int64)."""

    @property
    def num_routes(self) -> int:
        """Routes (source rank, destination rank, bundle)."""
        return len(self.route_src)

    def route_nbytes(self) -> np.ndarray:
        """Bytes of each route (int64)."""
        sizes = np.fromiter((b.nbytes for b in self.bundles), np.int64, len(self.bundles))
        return sizes[self.route_bundle]

    def num_transfers(self) -> int:
        """Transfers the routes expand to (exact, without expanding them)."""
        counts = np.fromiter((len(b.slices) for b in self.bundles), np.int64, len(self.bundles))
        return int(counts[self.route_bundle].sum())

    def transfers(self) -> Iterator[Transfer]:
        """Every transfer, route by route (lazily: a large plan has millions)."""
        return self._expand(np.arange(self.num_routes))

    def transfers_for(self, rank: int, *, side: str) -> Iterator[Transfer]:
        """Transfers one rank takes part in: ``side="source"`` (it sends) or ``"destination"``."""
        column = {"source": self.route_src, "destination": self.route_dst}[side]
        return self._expand(np.flatnonzero(column == rank))

    def _expand(self, routes: np.ndarray) -> Iterator[Transfer]:
        for i in routes.tolist():
            src, dst = int(self.route_src[i]), int(self.route_dst[i])
            kind = KINDS[self.route_kind[i]]
            for s in self.bundles[self.route_bundle[i]].slices:
                yield _transfer(s, src, dst, kind)


def _transfer(s: Slice, src: int, dst: int, kind: str) -> Transfer:
    shard = next(c for c in s.sources if src in c.ranks)
    d = s.destination
    return Transfer(
        src_rank=src, dst_rank=dst, tensor=s.tensor, region=s.region,
        src_param=shard.param, src_region=map_into(s.region, shard.region, shard.param_region),
        dst_param=d.param, dst_region=map_into(s.region, d.region, d.param_region),
        nbytes=s.nbytes, kind=kind,
    )


# ------------------------------------------------------------------------ checking


def check_compatible(source: TensorLayout, destination: TensorLayout) -> None:
    """Raise ValueError unless both sides describe the same model, tensors and dtypes."""
    for f in dataclasses.fields(source.model):
        a, b = getattr(source.model, f.name), getattr(destination.model, f.name)
        if a != b:
            raise ValueError(
                f"model configs differ between the two sides: model.{f.name} is {a!r} on the "
                f"source ({source.side}) and {b!r} on the destination ({destination.side}); "
                f"both must be built from the same ModelConfig"
            )
    if source.dtype != destination.dtype:
        raise ValueError(
            f"dtype differs: source {source.dtype}, destination {destination.dtype}; the planner "
            f"moves bytes and does not cast: build both layouts with the same dtype"
        )
    if list(source.tensors) != list(destination.tensors):
        missing = set(source.tensors) ^ set(destination.tensors)
        raise ValueError(f"the two sides have different canonical tensors: {sorted(missing)[:5]}")


# ---------------------------------------------------------------------- intersecting


@dataclass(frozen=True, kw_only=True, slots=True)
class _SourceBox:
    region: Region
    copies: tuple[Shard, ...]
    holders: tuple[int, ...]


def _source_boxes(shards: tuple[Shard, ...], interned: dict) -> list[_SourceBox]:
    """Source shards grouped by box: copies of the same box (tied embedding) merged."""
    by_region: dict[Region, list[Shard]] = {}
    for s in shards:
        by_region.setdefault(s.region, []).append(s)
    boxes = []
    for region, copies in by_region.items():
        holders = copies[0].ranks if len(copies) == 1 else _union(copies, interned)
        boxes.append(_SourceBox(region=region, copies=tuple(copies), holders=holders))
    return boxes


def _union(copies: list[Shard], interned: dict) -> tuple[int, ...]:
    key = tuple(sorted({r for c in copies for r in c.ranks}))
    return interned.setdefault(key, key)


def _slices(name: str, itemsize: int, boxes: list[_SourceBox], dst: Shard) -> list[tuple]:
    """(holders, slice) for each part of ``dst`` inside a source box."""
    out = []
    covered, needed = 0, num_elements(dst.region)
    for box in boxes:
        region = intersect(dst.region, box.region)
        if region is None:
            continue
        n = needed if region is dst.region else num_elements(region)
        covered += n
        out.append((box.holders, Slice(tensor=name, region=region, sources=box.copies,
                                       destination=dst, nbytes=n * itemsize)))
    if covered != needed:
        raise ValueError(
            f"{name}: the source layout does not hold all of {dst.region} that destination "
            f"ranks {dst.ranks[:4]}... need ({covered} of {needed} elements)"
        )
    return out


def _bundles(source: TensorLayout, destination: TensorLayout) -> list[Bundle]:
    """Slices of every tensor, grouped by (holders, needers) in first-appearance order."""
    groups: dict[tuple[int, int], tuple[tuple, tuple, list[Slice]]] = {}
    interned: dict = {}
    for name, tensor in destination.tensors.items():
        boxes = _source_boxes(source.shards[name], interned)
        itemsize = DTYPE_BYTES[tensor.dtype]
        for dst in destination.shards[name]:
            for holders, s in _slices(name, itemsize, boxes, dst):
                # rank tuples are interned by the layout builders: ids identify them
                key = (id(holders), id(dst.ranks))
                if key not in groups:
                    groups[key] = (holders, dst.ranks, [])
                groups[key][2].append(s)
    return [
        Bundle(holders=h, needers=n, slices=tuple(s), nbytes=sum(x.nbytes for x in s))
        for h, n, s in groups.values()
    ]


# ---------------------------------------------------------------------- choosing


class _Chooser:
    """Picks the source of each (bundle, destination rank): device, then node, then load."""

    def __init__(self, topology: Topology, num_source: int) -> None:
        self.src_dev = topology.source
        self.dst_dev = topology.destination
        self.load = [0] * num_source
        self._candidates: dict[int, tuple[dict[Device, int], dict[int, list[int]]]] = {}

    def _index(self, holders: tuple[int, ...]) -> tuple[dict[Device, int], dict[int, list[int]]]:
        key = id(holders)
        if key not in self._candidates:
            by_device: dict[Device, int] = {}
            by_node: dict[int, list[int]] = {}
            for r in holders:  # ascending: setdefault keeps the lowest rank per device
                dev = self.src_dev[r]
                by_device.setdefault(dev, r)
                by_node.setdefault(dev.node, []).append(r)
            self._candidates[key] = (by_device, by_node)
        return self._candidates[key]

    def choose(self, holders: tuple[int, ...], dst: int, nbytes: int) -> tuple[int, int]:
        """(source rank, kind) for one route; updates the bytes-sent load of the source."""
        by_device, by_node = self._index(holders)
        dev = self.dst_dev[dst]
        src = by_device.get(dev)
        if src is not None:
            return src, LOCAL
        same_node = by_node.get(dev.node)
        kind = INTRA if same_node else INTER
        src = min(same_node or holders, key=self.load.__getitem__)  # first minimum = lowest rank
        self.load[src] += nbytes
        return src, kind


def plan_reshard(source: TensorLayout, destination: TensorLayout, topology: Topology) -> Plan:
    """The plan moving every box ``destination`` needs out of ``source`` (pure, deterministic)."""
    check_compatible(source, destination)
    topology.check(source.num_ranks, destination.num_ranks)
    with gc_paused():
        return _plan(source, destination, topology)


def _plan(source: TensorLayout, destination: TensorLayout, topology: Topology) -> Plan:
    bundles = _bundles(source, destination)
    # largest bundles first: greedy least-loaded balancing does best placing big items early
    order = sorted(range(len(bundles)), key=lambda i: (-bundles[i].nbytes, i))
    bundles = [bundles[i] for i in order]
    chooser = _Chooser(topology, source.num_ranks)
    src, dst, kind, which = [], [], [], []
    for b_index, b in enumerate(bundles):
        for d in b.needers:
            s, k = chooser.choose(b.holders, d, b.nbytes)
            src.append(s)
            dst.append(d)
            kind.append(k)
            which.append(b_index)
    return Plan(
        source=source, destination=destination, topology=topology, bundles=tuple(bundles),
        route_src=np.array(src, np.int64), route_dst=np.array(dst, np.int64),
        route_kind=np.array(kind, np.int8), route_bundle=np.array(which, np.int64),
    )

