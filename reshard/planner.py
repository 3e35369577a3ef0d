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
     bundle slices by their (holding ranks, needing ranks) pair, in parts <= part_bytes
                              v
     per bundle, largest first; per node of its needing ranks, nodes ascending:
         a holder on the needer's device -> local (copy, no link bytes)
         else a holder on the node        -> intra from it  (the node's holders, NVLink least loaded)
         else the bundle enters the node ONCE:
              inter into the needer whose NIC received least, from the holder -- or a
              destination rank of an earlier node that has it (a relay, <= max_relays
              nodes deep) -- whose NIC sent least;
              then intra fan-out from the node's ranks that have it  (NVLink least loaded)
                              v
     Plan: bundles (shared slice lists) + routes (sender, needer, kind, bundle, relay, hop)
           .transfers() / .transfers_for(rank) expand routes into Transfer values

Every destination element is covered exactly once: the source boxes of a tensor partition it,
so the slices of one destination shard partition the shard, and each (bundle, needing rank)
gets exactly one route. A relay route's sender is a destination rank that needs the same
bundle and gets it on an earlier route (its ``hop`` is one more), so it forwards exactly what
it received, from its own buffer. Each element crosses into each destination node at most once:
the network carries the node-level bound exactly. Loads are counted per device, so colocated
ranks of the two sides share their device's NIC and NVLink.
No torch, no process groups, no weights: a 671B plan is shapes only.
Routes are compact on purpose: a 1,024-rank DeepSeek-V3 plan has millions of transfers but
0.86 million routes; statistics are computed from the routes exactly. "Least loaded" is a heap
per bundle (and per node for the fan-out), not a scan, and bundles hold up to 256 MiB
(``PART_BYTES``): that plan costs under 3 CPU s (``benchmarks/reshard_plan.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
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
PART_BYTES = 256 << 20
"""The most one bundle holds by default. A bundle takes one route per needer, so the part size
sets the plan's size: at 64 MiB the 1,024-GPU DeepSeek-V3 plan had 3.3 million routes and took
7.6 CPU s; at 256 MiB it has 0.86 million and takes about 3 s, and every benchmark case stays
within 1.05 of the time bound (each NIC still carries hundreds of parts, enough to balance them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Slice:
    """A box of one canonical tensor inside one source box and one destination shard."""

    tensor: str
    """Canonical tensor name."""
    region: Region
    """The box (canonical coordinates)."""
    sources: tuple[Shard, ...]
    """Source shards with exactly the enclosing box (one per copy: tied embeddings have two)."""
    destinations: tuple[Shard, ...]
    """Destination shards with exactly the enclosing box (one per copy: a redundant EPLB expert
    sits in other slots on other ranks); the bundle's needers are their ranks."""
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
    relay: bool = False
    """``src_rank`` is a destination rank forwarding what it received (read from its
    ``src_param`` buffer, which is the same destination parameter as ``dst_param``)."""
    hop: int = 0
    """Routes the box took before this one (0: straight from a source rank)."""
    also: tuple[tuple[str, Region], ...] = ()
    """Further (parameter, box) places on the destination rank that take the same box (a rank
    holding one expert in two EPLB slots): one transfer, written into each."""


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
    route_relay: np.ndarray
    """True where the route's sender (``route_src``) is a destination rank (bool)."""
    route_hop: np.ndarray
    """Routes the bundle took before this one to reach the sender (int16; 0: a source rank)."""

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

    @property
    def max_hop(self) -> int:
        """Deepest route (0: no route forwards)."""
        return int(self.route_hop.max(initial=0))

    def transfers_for(self, rank: int, *, side: str) -> Iterator[Transfer]:
        """Transfers one rank takes part in: ``side="source"`` (a source rank sends),
        ``"relay"`` (a destination rank forwards) or ``"destination"`` (it receives)."""
        if side == "destination":
            mask = self.route_dst == rank
        else:
            mask = (self.route_src == rank) & (self.route_relay == (side == "relay"))
        return self._expand(np.flatnonzero(mask))

    def route_transfers(self, route: int) -> list[Transfer]:
        """The transfers of one route, one per slice of its bundle, in the bundle's order."""
        return list(self._expand([route]))

    def _expand(self, routes) -> Iterator[Transfer]:
        for i in np.asarray(routes).tolist():
            src, dst = int(self.route_src[i]), int(self.route_dst[i])
            kind, relay, hop = KINDS[self.route_kind[i]], bool(self.route_relay[i]), int(self.route_hop[i])
            for s in self.bundles[self.route_bundle[i]].slices:
                yield _transfer(s, src, dst, kind, relay, hop)


def _transfer(s: Slice, src: int, dst: int, kind: str, relay: bool, hop: int) -> Transfer:
    # a relay needs the same box: it forwards it from where its own buffer holds it
    (src_param, src_region), *_ = _places(s.destinations if relay else s.sources, src, s.region)
    (dst_param, dst_region), *also = _places(s.destinations, dst, s.region)
    return Transfer(
        src_rank=src,
        dst_rank=dst,
        tensor=s.tensor,
        region=s.region,
        src_param=src_param,
        src_region=src_region,
        dst_param=dst_param,
        dst_region=dst_region,
        nbytes=s.nbytes,
        kind=kind,
        relay=relay,
        hop=hop,
        also=tuple(also),
    )


def _places(copies: tuple[Shard, ...], rank: int, region: Region) -> list[tuple[str, Region]]:
    """(parameter, box in it) of every copy ``rank`` holds ``region`` in."""
    return [(c.param, map_into(region, c.region, c.param_region)) for c in copies if rank in c.ranks]


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
class _Box:
    region: Region
    copies: tuple[Shard, ...]
    ranks: tuple[int, ...]


def _boxes(shards: tuple[Shard, ...], interned: dict) -> list[_Box]:
    """Shards grouped by box: copies of the same box (a tied embedding's source, a redundant
    expert's destination) merged, their ranks united."""
    by_region: dict[Region, list[Shard]] = {}
    for s in shards:
        by_region.setdefault(s.region, []).append(s)
    boxes = []
    for region, copies in by_region.items():
        ranks = copies[0].ranks if len(copies) == 1 else _union(copies, interned)
        boxes.append(_Box(region=region, copies=tuple(copies), ranks=ranks))
    return boxes


def _union(copies: list[Shard], interned: dict) -> tuple[int, ...]:
    key = tuple(sorted({r for c in copies for r in c.ranks}))
    return interned.setdefault(key, key)


def _slices(name: str, itemsize: int, boxes: list[_Box], dst: _Box) -> list[tuple]:
    """(holders, slice) for each part of the destination box ``dst`` inside a source box."""
    out = []
    covered, needed = 0, num_elements(dst.region)
    for box in boxes:
        region = intersect(dst.region, box.region)
        if region is None:
            continue
        n = needed if region is dst.region else num_elements(region)
        covered += n
        out.append(
            (
                box.ranks,
                Slice(tensor=name, region=region, sources=box.copies, destinations=dst.copies, nbytes=n * itemsize),
            )
        )
    if covered != needed:
        raise ValueError(
            f"{name}: the source layout does not hold all of {dst.region} that destination "
            f"ranks {dst.ranks[:4]}... need ({covered} of {needed} elements)"
        )
    return out


def _bundles(source: TensorLayout, destination: TensorLayout, part_bytes: int) -> list[Bundle]:
    """Slices of every tensor, grouped by (holders, needers) in first-appearance order, each
    group cut into bundles of at most ``part_bytes``."""
    groups: dict[tuple[int, int], tuple[tuple, tuple, list[Slice]]] = {}
    interned: dict = {}
    for name, tensor in destination.tensors.items():
        boxes = _boxes(source.shards[name], interned)
        itemsize = DTYPE_BYTES[tensor.dtype]
        for dst in _boxes(destination.shards[name], interned):
            for holders, s in _slices(name, itemsize, boxes, dst):
                # rank tuples are interned by the layout builders: ids identify them
                key = (id(holders), id(dst.ranks))
                if key not in groups:
                    groups[key] = (holders, dst.ranks, [])
                groups[key][2].append(s)
    return [b for h, n, s in groups.values() for b in _parts(h, n, s, part_bytes)]


def _parts(holders: tuple, needers: tuple, slices: list[Slice], part_bytes: int) -> list[Bundle]:
    """Consecutive slices packed into bundles of at most ``part_bytes`` (a larger slice cut into
    row blocks first). Whole models replicated on both sides would otherwise be one bundle, and
    one bundle takes one route per needer: one NIC each side, however many are idle."""
    out: list[Bundle] = []
    current: list[Slice] = []
    size = 0
    for whole in slices:
        for s in _cut(whole, part_bytes):
            if current and size + s.nbytes > part_bytes:
                out.append(Bundle(holders=holders, needers=needers, slices=tuple(current), nbytes=size))
                current, size = [], 0
            current.append(s)
            size += s.nbytes
    if current:
        out.append(Bundle(holders=holders, needers=needers, slices=tuple(current), nbytes=size))
    return out


def _cut(s: Slice, part_bytes: int) -> list[Slice]:
    """``s`` in blocks of whole rows along its first dim longer than 1, each <= part_bytes
    (one row at least)."""
    if s.nbytes <= part_bytes:
        return [s]
    dim = next((i for i, (a, b) in enumerate(s.region) if b - a > 1), None)
    if dim is None:
        return [s]
    lo, hi = s.region[dim]
    row = s.nbytes // (hi - lo)
    step = max(1, part_bytes // row)
    return [
        dataclasses.replace(
            s,
            region=s.region[:dim] + ((a, min(a + step, hi)),) + s.region[dim + 1 :],
            nbytes=row * (min(a + step, hi) - a),
        )
        for a in range(lo, hi, step)
    ]


# ---------------------------------------------------------------------- choosing


class _Links:
    """Bytes each device's links carry so far: NIC both ways, NVLink out. Colocated ranks of the
    two sides share a device, so they share its links."""

    def __init__(self, topology: Topology) -> None:
        devices = sorted(set(topology.source) | set(topology.destination))
        index = {dev: i for i, dev in enumerate(devices)}
        self.src = [index[d] for d in topology.source]
        self.dst = [index[d] for d in topology.destination]
        self.nic_out = [0] * len(devices)
        self.nic_in = [0] * len(devices)
        self.nv_out = [0] * len(devices)  # NVLink receives need no balancing: each needer takes its own


class _Chooser:
    """Routes one bundle to its needers, node by node (see the module docstring):

    a holder on the needer's device -> local; a holder on its node -> intra from the holder
    whose NVLink has sent least; else the bundle enters the node once (inter, into the needer
    whose NIC has received least, from the holder or earlier receiver on another node whose NIC
    has sent least: a relay when that is a destination rank), then fans out inside the node
    (intra from the node's receiver whose NVLink has sent least)."""

    def __init__(self, topology: Topology, *, max_relays: int) -> None:
        self.src_dev = topology.source
        self.dst_dev = topology.destination
        self.links = _Links(topology)
        self.max_relays = max_relays
        self.ahead = [0] * len(self.links.nic_out)
        """Per device: the NIC sends a previous pass made for the bundles not routed yet."""
        self._holders: dict[int, tuple[dict[Device, int], dict[int, list[int]]]] = {}
        self._needers: dict[int, dict[int, list[int]]] = {}
        self._layouts: dict[tuple[int, int], list[tuple]] = {}

    def _index(self, holders: tuple[int, ...]) -> tuple[dict[int, int], dict[int, list[int]]]:
        """A holder set's lowest rank per device (by device index) and its ranks per node."""
        key = id(holders)
        if key not in self._holders:
            by_device: dict[int, int] = {}
            by_node: dict[int, list[int]] = {}
            for r in holders:  # ascending: setdefault keeps the lowest rank per device
                by_device.setdefault(self.links.src[r], r)
                by_node.setdefault(self.src_dev[r].node, []).append(r)
            self._holders[key] = (by_device, by_node)
        return self._holders[key]

    def _by_node(self, needers: tuple[int, ...]) -> dict[int, list[int]]:
        key = id(needers)
        if key not in self._needers:
            out: dict[int, list[int]] = {}
            for d in needers:
                out.setdefault(self.dst_dev[d].node, []).append(d)
            self._needers[key] = dict(sorted(out.items()))
        return self._needers[key]

    def _nodes(self, holders: tuple[int, ...], needers: tuple[int, ...]) -> list[tuple]:
        """Per node of ``needers`` (ascending), what does not depend on the loads: the local
        routes, the node's holders, the needers left to route. Bundles of one (holders,
        needers) pair share it, and so do both passes."""
        key = (id(holders), id(needers))
        if key not in self._layouts:
            by_device, by_node = self._index(holders)
            dst, out = self.links.dst, []
            for node, ranks in self._by_node(needers).items():
                local = [(by_device[dst[d]], False, d, LOCAL, 0) for d in ranks if dst[d] in by_device]
                todo = [d for d in ranks if dst[d] not in by_device]
                out.append((local, tuple(by_node.get(node, ())), todo))
            self._layouts[key] = out
        return self._layouts[key]

    def route(self, holders: tuple[int, ...], needers: tuple[int, ...], nbytes: int) -> list[tuple]:
        """(sender, relay, needer, kind, hop) for every needer of one bundle, parents first."""
        src, dst, nic_in, sent = self.links.src, self.links.dst, self.links.nic_in, self.links.nic_out
        ahead, max_relays, heapreplace, heappush = self.ahead, self.max_relays, heapq.heapreplace, heapq.heappush
        routes: list[tuple] = []
        senders: list[tuple] | None = None  # the inter candidates' heap, made at the first inter route
        for local, node_holders, todo in self._nodes(holders, needers):
            routes += local
            if not todo:
                continue
            if node_holders:
                # where the node holds the bundle, its holders send it (their sends are owed
                # anyway, and balanced over them); only a bundle that came in over the network
                # is forwarded inside the node by the ranks that got it
                self._fan_out(routes, [(r, False, 0) for r in node_holders], todo, nbytes, relays=False)
                continue
            entry = todo[0] if len(todo) == 1 else min(todo, key=lambda d: nic_in[dst[d]])
            if senders is None:
                senders = self._senders(holders)
            # the candidate whose NIC has sent least (see _senders for the order); loads only
            # grow while a bundle is routed, so a key in the heap is at most its candidate's
            # load: the top is the choice once its key is current, else it goes back with it
            while True:
                load, hop, relay, sender, passed = senders[0]
                device = dst[sender] if relay else src[sender]
                now = sent[device] + ahead[device]
                if now == load:
                    break
                heapreplace(senders, (now, hop, relay, sender, passed))
            sent[device] += nbytes
            into = dst[entry]
            nic_in[into] += nbytes
            heapreplace(senders, (load + nbytes, hop, relay, sender, passed))
            if passed < max_relays:  # the entry may forward the bundle to later nodes
                heappush(senders, (sent[into] + ahead[into], hop + 1, True, entry, passed + 1))
            routes.append((sender, relay, entry, INTER, hop))
            if len(todo) > 1:
                rest = [d for d in todo if d != entry]
                self._fan_out(routes, [(entry, True, hop + 1)], rest, nbytes, relays=True)
        return routes

    def _fan_out(self, routes: list, have: list[tuple], todo: list[int], nbytes: int, *, relays: bool) -> None:
        """Intra routes to ``todo`` from the node's ranks in ``have`` (rank, relay, hop) whose
        NVLink sent least, then fewer hops, relays last, the lower rank (with ``relays``, each
        receiver joins them). A heap, kept current lazily as the inter one is."""
        sent, src, dst = self.links.nv_out, self.links.src, self.links.dst
        heap = [(sent[dst[r] if relay else src[r]], hop, relay, r) for r, relay, hop in have]
        heapq.heapify(heap)
        for d in todo:
            while True:
                load, hop, relay, sender = heap[0]
                device = dst[sender] if relay else src[sender]
                if sent[device] == load:
                    break
                heapq.heapreplace(heap, (sent[device], hop, relay, sender))
            sent[device] += nbytes
            heapq.heapreplace(heap, (load + nbytes, hop, relay, sender))
            routes.append((sender, relay, d, INTRA, hop))
            if relays:
                heapq.heappush(heap, (sent[dst[d]], hop + 1, True, d))

    def _device(self, rank: int, relay: bool) -> int:
        return self.links.dst[rank] if relay else self.links.src[rank]

    def _senders(self, holders: tuple[int, ...]) -> list[tuple]:
        """A bundle's first inter candidates, its holders, as a heap of (load, hop, relay, rank,
        nodes passed): the order in which one is preferred (least sent, then fewer hops, then
        holders, then the lower rank). Each entry rank joins it once it has the bundle. One heap
        per bundle, not a scan of every holder and entry per node: the scan cost 96 CPU s for the
        1,024-GPU DeepSeek-V3 plan."""
        sent, ahead, src = self.links.nic_out, self.ahead, self.links.src
        heap = [(sent[src[r]] + ahead[src[r]], 0, False, r, 0) for r in holders]
        heapq.heapify(heap)
        return heap

    def forget(self, routes: list[tuple], nbytes: int) -> None:
        """Drop a previous pass's NIC sends of one bundle from ``ahead`` (it is being routed)."""
        for sender, relay, _, kind, _ in routes:
            if kind == INTER:
                self.ahead[self._device(sender, relay)] -= nbytes


def plan_reshard(
    source: TensorLayout,
    destination: TensorLayout,
    topology: Topology,
    *,
    max_relays: int = 8,
    part_bytes: int = PART_BYTES,
) -> Plan:
    """The plan moving every box ``destination`` needs out of ``source`` (pure, deterministic).

    ``max_relays``: how many destination nodes a bundle may pass through before it enters a
    node (0: every bundle enters every node straight from a source rank; fan-out inside a
    node is always on). The executor pipelines relays bucket by bucket, so each node passed
    adds about one bucket's transfer time, not a whole bundle's. ``part_bytes``: the most one
    bundle holds, so large shared needs spread over several NICs."""
    if max_relays < 0:
        raise ValueError(f"max_relays is {max_relays}; give 0 (no relays between nodes) or more")
    if part_bytes < 1:
        raise ValueError(f"part_bytes is {part_bytes}; give a positive byte count")
    check_compatible(source, destination)
    topology.check(source.num_ranks, destination.num_ranks)
    with gc_paused():
        return _plan(source, destination, topology, max_relays, part_bytes)


def _plan(
    source: TensorLayout, destination: TensorLayout, topology: Topology, max_relays: int, part_bytes: int
) -> Plan:
    bundles = _bundles(source, destination, part_bytes)
    # largest bundles first: greedy least-loaded balancing does best placing big items early
    order = sorted(range(len(bundles)), key=lambda i: (-bundles[i].nbytes, i))
    bundles = [bundles[i] for i in order]
    # two greedy passes: the second knows, per device, the NIC sends the first made for the
    # bundles still to come (a device whose own shards must leave it later is spared now).
    # One pass would halve the CPU but missed the time bound by 16% with 64 MiB parts
    # (Mixtral-8x22B TP8 PP4 EP8 -> TP8 x 8, colocated: 1.165x; 1.036x with both)
    rough = _Chooser(topology, max_relays=max_relays)
    first = [rough.route(b.holders, b.needers, b.nbytes) for b in bundles]
    chooser = _Chooser(topology, max_relays=max_relays)
    chooser.ahead = list(rough.links.nic_out)
    columns: list[list] = [[], [], [], [], [], []]
    for b_index, b in enumerate(bundles):
        chooser.forget(first[b_index], b.nbytes)
        first[b_index] = None  # the first pass's routes are not needed past here
        routes = chooser.route(b.holders, b.needers, b.nbytes)
        for column, values in zip(columns, (*zip(*routes), [b_index] * len(routes))):
            column.extend(values)
    src, relay, dst, kind, hop, which = columns
    return Plan(
        source=source,
        destination=destination,
        topology=topology,
        bundles=tuple(bundles),
        route_src=np.array(src, np.int64),
        route_dst=np.array(dst, np.int64),
        route_kind=np.array(kind, np.int8),
        route_bundle=np.array(which, np.int64),
        route_relay=np.array(relay, bool),
        route_hop=np.array(hop, np.int16),
    )
