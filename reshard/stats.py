"""Plan statistics: bytes moved, the lower bound, the gather-and-broadcast baseline, and time.

    Plan --> per-route bytes (bundle sizes) --> local / intra / inter totals,
                                                bytes sent and received per rank,
                                                simulated seconds (model below)
    source, destination, topology --> lower bound  (computed from the layouts, not the plan)
    destination --------------------> baseline     (computed from the layouts, not the plan)

Definitions:

- ``bytes``: bytes crossing from one device to another (intra + inter node); local copies
  (source and destination rank on the same device) are counted apart in ``local_bytes``.
- ``lower_bound_bytes``: for every destination rank, the bytes of everything it needs, minus
  what a source rank on its own device already holds; summed over destination ranks. No plan
  that delivers every needed element can move fewer bytes between devices.
- ``baseline_bytes``: the gather-and-broadcast scheme of verl / slime / OpenRLHF
  (``update_weights_from_tensor`` with full HF tensors): every destination rank receives every
  canonical tensor of the model whole, and its loader keeps only its part. Baseline = number of
  destination ranks x bytes of the whole (unpadded) model. It ignores the trainer-side gather.
- ``simulated_seconds``: every device has one NVLink port at ``intra_node_gbps`` and one NIC at
  ``inter_node_gbps`` (GB/s = 1e9 bytes/s) per direction; ranks of the two sides on one device
  share them; all links run at once, full duplex; the network core never congests; relays are
  pipelined bucket by bucket, so a forwarded route costs its links' bytes (the pipeline fill,
  one bucket per hop, is not counted); local copies are free. Time = the busiest link's bytes
  over its bandwidth.
- ``time_lower_bound_seconds``: the least time of any plan whose network carries only the
  node-level bound (what each node lacks, once; the plans this planner makes): the larger of
  (a) each destination node's ``node_lower_bound_bytes`` through the NICs of all the node's
  devices at once; (b) per destination rank, what its node holds beyond its device through its
  NVLink port, and all it needs beyond its device through its NVLink and NIC at once.
  Source-side sending is not counted, so the bound is optimistic where trainer NICs are the
  bottleneck.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from reshard.families import DTYPE_BYTES
from reshard.layouts import TensorLayout
from reshard.planner import INTER, INTRA, LOCAL, Plan, _boxes
from reshard.regions import Region, intersect, num_elements
from reshard.topology import Device, Topology

__all__ = ["Bandwidth", "PlanStats", "baseline_bytes", "lower_bound_bytes", "plan_stats"]


@dataclass(frozen=True, kw_only=True)
class Bandwidth:
    """Per-rank link speeds of the time model, in GB/s (1e9 bytes per second)."""

    intra_node_gbps: float
    """One rank's intra-node (NVLink) bandwidth per direction (a run's: ``rollout.intra_node_gbps``)."""
    inter_node_gbps: float
    """One rank's network (NIC) bandwidth per direction (a run's: ``rollout.inter_node_gbps``)."""


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """What a plan moves, against the lower bound and the gather baseline."""

    bytes: int
    """Bytes moved between devices (intra + inter node)."""
    local_bytes: int
    """Bytes copied on the same device."""
    intra_node_bytes: int
    """Bytes moved between devices of one node."""
    inter_node_bytes: int
    """Bytes moved between nodes."""
    max_sent_bytes: int
    """Most bytes one source rank sends to other devices."""
    max_received_bytes: int
    """Most bytes one destination rank receives from other devices."""
    lower_bound_bytes: int
    """Bytes destinations need that are not on their own device (see module docstring)."""
    baseline_bytes: int
    """Bytes the gather-and-broadcast scheme moves (see module docstring)."""
    simulated_seconds: float
    """Time under the bandwidth model (see module docstring)."""
    node_lower_bound_bytes: int
    """Bytes that must enter destination nodes over the network, each element once per node
    (``node_lower_bound_bytes``)."""
    relay_bytes: int
    """Bytes on routes a destination rank forwards (inside a node or to another node)."""
    max_hop: int
    """Deepest route: how many routes a box took before its last one (0: all direct)."""
    time_lower_bound_seconds: float
    """Seconds no plan can beat under the bandwidth model (``time_lower_bound_seconds``)."""
    num_routes: int
    """(source rank, destination rank, bundle) routes."""
    num_transfers: int
    """Transfers (single boxes) the routes expand to."""

    @property
    def ratio_to_lower_bound(self) -> float:
        """bytes / lower bound (1.0 is optimal); 1.0 when both are 0."""
        return self.bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    @property
    def node_ratio(self) -> float:
        """inter-node bytes / the node-level bound (1.0: each element enters each node once)."""
        return self.inter_node_bytes / self.node_lower_bound_bytes if self.node_lower_bound_bytes else 1.0

    @property
    def time_ratio(self) -> float:
        """simulated seconds / the time bound (1.0: the plan runs at the links' limit)."""
        return self.simulated_seconds / self.time_lower_bound_seconds if self.time_lower_bound_seconds else 1.0

    @property
    def baseline_ratio(self) -> float:
        """baseline / bytes: how many times more the gather scheme moves."""
        return self.baseline_bytes / self.bytes if self.bytes else float("inf")

    def as_dict(self) -> dict:
        """All fields plus the two ratios (JSON-ready)."""
        return {
            **asdict(self),
            "ratio_to_lower_bound": self.ratio_to_lower_bound,
            "baseline_ratio": self.baseline_ratio,
            "node_ratio": self.node_ratio,
            "time_ratio": self.time_ratio,
        }

    def describe(self) -> str:
        """A few lines for a terminal (``hybridflow plan``)."""
        b = format_bytes
        return "\n".join(
            [
                f"reshard: {b(self.bytes)} across devices ({b(self.intra_node_bytes)} intra-node, "
                f"{b(self.inter_node_bytes)} inter-node), {b(self.local_bytes)} local copies",
                f"  lower bound {b(self.lower_bound_bytes)} (ratio {self.ratio_to_lower_bound:.3f}); "
                f"gather-and-broadcast baseline {b(self.baseline_bytes)} "
                f"({self.baseline_ratio:.2f}x the plan)",
                f"  max per rank: sent {b(self.max_sent_bytes)}, received "
                f"{b(self.max_received_bytes)}; simulated {self.simulated_seconds:.3g} s; "
                f"{self.num_routes} routes, {self.num_transfers} transfers",
                f"  network: {b(self.inter_node_bytes)} into nodes, node-level bound "
                f"{b(self.node_lower_bound_bytes)} (ratio {self.node_ratio:.2f}); time bound "
                f"{self.time_lower_bound_seconds:.3g} s (simulated {self.time_ratio:.2f}x it)",
                f"  relays: {b(self.relay_bytes)} forwarded by rollout ranks, up to {self.max_hop} hops deep",
            ]
        )


def format_bytes(n: float) -> str:
    """Bytes in decimal units with three significant digits (``1.94 TB``, ``98.3 kB``)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def _per_rank(ranks: np.ndarray, nbytes: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, np.int64)
    np.add.at(out, ranks[mask], nbytes[mask])
    return out


def _route_devices(plan: Plan) -> tuple[np.ndarray, np.ndarray, int]:
    """Device index of every route's sender and receiver, and the number of devices."""
    topo = plan.topology
    devices = sorted(set(topo.source) | set(topo.destination))
    index = {dev: i for i, dev in enumerate(devices)}
    src = np.array([index[d] for d in topo.source], np.int64)
    dst = np.array([index[d] for d in topo.destination], np.int64)
    relay = plan.route_relay
    sender = np.empty(plan.num_routes, np.int64)
    sender[relay] = dst[plan.route_src[relay]]  # a relay's sender is a destination rank
    sender[~relay] = src[plan.route_src[~relay]]
    return sender, dst[plan.route_dst], len(devices)


def _simulated_seconds(plan: Plan, nbytes: np.ndarray, bw: Bandwidth) -> float:
    """The busiest link's bytes over its bandwidth (module docstring)."""
    sender, receiver, n = _route_devices(plan)
    seconds = 0.0
    for kind, gbps in ((INTRA, bw.intra_node_gbps), (INTER, bw.inter_node_gbps)):
        mask = plan.route_kind == kind
        for ends in (sender, receiver):
            seconds = max(seconds, float(_per_rank(ends, nbytes, mask, n).max(initial=0)) / (gbps * 1e9))
    return seconds


def plan_stats(plan: Plan, *, bandwidth: Bandwidth) -> PlanStats:
    """Exact statistics of ``plan`` (bounds computed from its layouts, independently)."""
    nbytes = plan.route_nbytes()
    kind = plan.route_kind
    moved = kind != LOCAL
    per_rank = _remote_need_per_rank(plan.source, plan.destination, plan.topology)
    missing = node_missing_bytes(plan.source, plan.destination, plan.topology)
    return PlanStats(
        bytes=int(nbytes[moved].sum()),
        local_bytes=int(nbytes[kind == LOCAL].sum()),
        intra_node_bytes=int(nbytes[kind == INTRA].sum()),
        inter_node_bytes=int(nbytes[kind == INTER].sum()),
        max_sent_bytes=int(
            _per_rank(plan.route_src, nbytes, moved & ~plan.route_relay, plan.source.num_ranks).max(initial=0)
        ),
        max_received_bytes=int(_per_rank(plan.route_dst, nbytes, moved, plan.destination.num_ranks).max(initial=0)),
        lower_bound_bytes=int(per_rank.sum()),
        baseline_bytes=baseline_bytes(plan.destination),
        simulated_seconds=_simulated_seconds(plan, nbytes, bandwidth),
        node_lower_bound_bytes=sum(missing.values()),
        relay_bytes=int(nbytes[plan.route_relay].sum()),
        max_hop=plan.max_hop,
        time_lower_bound_seconds=_time_bound(
            per_rank, _rank_missing(plan.source, plan.destination, plan.topology), missing, plan.topology, bandwidth
        ),
        num_routes=plan.num_routes,
        num_transfers=plan.num_transfers(),
    )


def baseline_bytes(destination: TensorLayout) -> int:
    """Every destination rank receives the whole model (see module docstring)."""
    model = sum(
        num_elements(tuple((0, n) for n in t.shape)) * DTYPE_BYTES[t.dtype] for t in destination.tensors.values()
    )
    return destination.num_ranks * model


def _device_holdings(source: TensorLayout, devices: set[Device], topology: Topology) -> dict[Device, dict[str, set]]:
    """Per device that also hosts a destination rank: tensor -> source boxes held there."""
    held: dict[Device, dict[str, set]] = {}
    for name, shards in source.shards.items():
        for s in shards:
            for r in s.ranks:
                dev = topology.source[r]
                if dev in devices:
                    held.setdefault(dev, {}).setdefault(name, set()).add(s.region)
    return held


def lower_bound_bytes(source: TensorLayout, destination: TensorLayout, topology: Topology) -> int:
    """Bytes destination ranks need minus what colocated source ranks already hold.

    Computed from the two layouts and the topology only (not from a plan). Boxes of one source
    tensor are disjoint (copies repeat the same box), so summing overlaps does not double count.
    """
    return int(_remote_need_per_rank(source, destination, topology).sum())


def _remote_need_per_rank(source: TensorLayout, destination: TensorLayout, topology: Topology) -> np.ndarray:
    """Per destination rank: the bytes it needs that no source rank on its own device holds."""
    topology.check(source.num_ranks, destination.num_ranks)
    boxes = {name: _needed_boxes(shards) for name, shards in destination.shards.items()}
    by_ranks: dict[int, list] = {}  # layouts share rank tuples across tensors: add per tuple once
    for name, needed in boxes.items():
        itemsize = DTYPE_BYTES[destination.tensors[name].dtype]
        for region, ranks in needed:
            entry = by_ranks.setdefault(id(ranks), [ranks, 0])
            entry[1] += num_elements(region) * itemsize
    need = np.zeros(destination.num_ranks, np.int64)
    for ranks, nbytes in by_ranks.values():
        need[list(ranks)] += nbytes
    held = _device_holdings(source, set(topology.destination), topology)
    members: dict[int, frozenset] = {}
    for d, dev in enumerate(topology.destination):
        for name, regions in held.get(dev, {}).items():
            itemsize = DTYPE_BYTES[destination.tensors[name].dtype]
            for box, ranks in boxes[name]:
                if d not in members.setdefault(id(ranks), frozenset(ranks)):
                    continue
                for region in regions:
                    overlap = intersect(region, box)
                    if overlap is not None:
                        need[d] -= num_elements(overlap) * itemsize
    return need


def _needed_boxes(shards) -> list[tuple[Region, tuple[int, ...]]]:
    """(box, ranks needing it) per distinct box, as the planner groups them (``planner._boxes``):
    a rank holding one box in two places (an expert in two EPLB slots) needs its bytes once."""
    return [(box.region, box.ranks) for box in _boxes(shards, {})]


def time_lower_bound_seconds(
    source: TensorLayout, destination: TensorLayout, topology: Topology, bandwidth: Bandwidth
) -> float:
    """Seconds no plan can beat under the bandwidth model (module docstring)."""
    return _time_bound(
        _remote_need_per_rank(source, destination, topology),
        _rank_missing(source, destination, topology),
        node_missing_bytes(source, destination, topology),
        topology,
        bandwidth,
    )


def _time_bound(
    per_rank: np.ndarray, rank_missing: np.ndarray, missing: dict[int, int], topology: Topology, bandwidth: Bandwidth
) -> float:
    # one destination rank per device (Topology.check). What its node holds comes over its
    # NVLink (the network carries only what the node lacks); the rest over NVLink or its NIC
    intra, both = bandwidth.intra_node_gbps * 1e9, (bandwidth.intra_node_gbps + bandwidth.inter_node_gbps) * 1e9
    on_node = per_rank - rank_missing
    receive = float(np.maximum(on_node / intra, per_rank / both).max(initial=0))
    nics: dict[int, int] = {}
    for dev in set(topology.source) | set(topology.destination):  # any device of the node can ingest
        nics[dev.node] = nics.get(dev.node, 0) + 1
    network = max((m / (nics[node] * bandwidth.inter_node_gbps * 1e9) for node, m in missing.items()), default=0.0)
    return max(receive, network)


def _rank_missing(source: TensorLayout, destination: TensorLayout, topology: Topology) -> np.ndarray:
    """Per destination rank: the bytes it needs that no source rank on its node holds."""
    held_on = _nodes_of(topology.source)
    per_tensor: dict[tuple, list[tuple[int, int]]] = {}  # alike tensors' (group, elements lacking)
    groups: list[list[int]] = []  # destination ranks of one rank tuple on one node

    def grouped(ranks: tuple[int, ...]) -> range:
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(topology.destination[r].node, []).append(r)
        groups.extend(by_node.values())
        return range(len(groups) - len(by_node), len(groups))

    groups_of = _by_ranks(grouped)
    lacking_bytes: dict[int, int] = {}
    for name, shards in destination.shards.items():
        key = _alike(shards, source.shards.get(name, ()))
        if key not in per_tensor:
            held = {
                node: list(dict.fromkeys(boxes))
                for node, boxes in _boxes_by_node(source.shards.get(name, ()), held_on).items()
            }
            found = per_tensor[key] = []
            for region, ranks in _needed_boxes(shards):
                for group in groups_of(ranks):
                    node = topology.destination[groups[group][0]].node
                    lacking = _box_missing(region, held.get(node, ()))
                    if lacking:
                        found.append((group, lacking))
        itemsize = DTYPE_BYTES[destination.tensors[name].dtype]
        for group, lacking in per_tensor[key]:
            lacking_bytes[group] = lacking_bytes.get(group, 0) + lacking * itemsize
    out = np.zeros(destination.num_ranks, np.int64)
    for group, nbytes in lacking_bytes.items():  # once per group of ranks, not per box
        out[groups[group]] += nbytes
    return out


def _alike(needed_shards, held_shards) -> tuple:
    """What the per-tensor work of the bounds depends on: the boxes and the (interned) rank
    tuples of both sides. Tensors of one shape and sharding (every layer's, every expert's) have
    the same, so each such work is done once per kind of tensor, not per tensor."""
    return (
        tuple((s.region, id(s.ranks)) for s in needed_shards),
        tuple((s.region, id(s.ranks)) for s in held_shards),
    )


def _box_missing(region: Region, held) -> int:
    """Elements of ``region`` no ``held`` box covers; the grid only when boxes partly overlap."""
    overlapping = []
    for box in held:
        if all(a <= c and d <= b for (a, b), (c, d) in zip(box, region)):
            return 0  # one held box contains it (the usual case)
        if intersect(box, region) is not None:
            overlapping.append(box)
    return _missing_elements([region], overlapping) if overlapping else num_elements(region)


def _covered_cells(boxes: list[Region], edges: list[list[int]]) -> np.ndarray:
    """Boolean grid over the cells cut by ``edges`` (per dim): True where any box covers the cell."""
    grid = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for box in boxes:
        index = tuple(slice(e.index(lo), e.index(hi)) for (lo, hi), e in zip(box, edges))
        grid[index] = True
    return grid


def _cell_volumes(edges: list[list[int]]) -> np.ndarray:
    volume = np.ones([len(e) - 1 for e in edges], dtype=np.int64)
    for dim, e in enumerate(edges):
        shape = [1] * len(edges)
        shape[dim] = len(e) - 1
        volume = volume * np.diff(np.asarray(e, dtype=np.int64)).reshape(shape)
    return volume


def _missing_elements(needed: list[Region], held: list[Region]) -> int:
    """Elements in the union of ``needed`` boxes that no ``held`` box covers (exact box algebra on
    the grid their edges cut, so overlaps count once)."""
    needed = list(dict.fromkeys(needed))  # replicated shards repeat one box
    held = [box for box in dict.fromkeys(held) if any(intersect(box, n) is not None for n in needed)]
    if not needed:
        return 0
    if len(needed) == 1 and not held:  # the common case, without building a grid
        return num_elements(needed[0])
    rank = len(needed[0])
    edges = [sorted({x for box in needed + held for x in box[dim]}) for dim in range(rank)]
    missing = _covered_cells(needed, edges) & ~_covered_cells(held, edges)
    return int(_cell_volumes(edges)[missing].sum())


def node_lower_bound_bytes(source: TensorLayout, destination: TensorLayout, topology: Topology) -> int:
    """Bytes that must cross into destination nodes over the network: for each node hosting
    destination ranks, what its ranks need (each element once per node, however many of its
    ranks need it) that no source rank on that node holds. A plan that sends each such element
    into the node once and fans it out inside reaches it; one that sends it to every rank moves
    more across the nodes' NICs."""
    return sum(node_missing_bytes(source, destination, topology).values())


def node_missing_bytes(source: TensorLayout, destination: TensorLayout, topology: Topology) -> dict[int, int]:
    """Per destination node, the bytes of ``node_lower_bound_bytes``."""
    topology.check(source.num_ranks, destination.num_ranks)
    dst_nodes = _nodes_of(topology.destination)
    src_nodes = _nodes_of(topology.source)
    missing: dict[int, int] = {}
    per_tensor: dict[tuple, dict[int, int]] = {}  # alike tensors' elements missing per node
    for name, shards in destination.shards.items():
        key = _alike(shards, source.shards.get(name, ()))
        if key not in per_tensor:
            needed = _boxes_by_node(shards, dst_nodes)
            held = _boxes_by_node(source.shards.get(name, ()), src_nodes)
            per_tensor[key] = {node: _missing_elements(boxes, held.get(node, [])) for node, boxes in needed.items()}
        itemsize = DTYPE_BYTES[destination.tensors[name].dtype]
        for node, elements in per_tensor[key].items():
            missing[node] = missing.get(node, 0) + elements * itemsize
    return missing


def _by_ranks(fn):
    """``fn(ranks)`` memoised on the rank tuple's identity: layouts intern their rank tuples and
    share them across tensors. The tuple is kept with its value and checked, since a union of
    EPLB copies (``planner._boxes``) is a new tuple each time and its id may be reused once freed."""
    cache: dict[int, tuple[tuple[int, ...], object]] = {}

    def memoised(ranks: tuple[int, ...]):
        hit = cache.get(id(ranks))
        if hit is None or hit[0] is not ranks:
            hit = cache[id(ranks)] = (ranks, fn(ranks))
        return hit[1]

    return memoised


def _nodes_of(devices: tuple[Device, ...]):
    """ranks tuple -> the nodes they sit on."""
    return _by_ranks(lambda ranks: frozenset(devices[r].node for r in ranks))


def _boxes_by_node(shards, nodes_of) -> dict[int, list[Region]]:
    out: dict[int, list[Region]] = {}
    for shard in shards:
        for node in nodes_of(shard.ranks):
            out.setdefault(node, []).append(shard.region)
    return out
