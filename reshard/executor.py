"""Run a reshard plan over torch.distributed point-to-point, in bounded-memory buckets.

```
Plan (same on every process)  +  ProcessMap (side rank -> torch.distributed rank)
        |
        v  routes ordered by (hop, sender process, receiver process); same process -> local copies
        v  messages: consecutive pieces of one (hop, sender, receiver), packed up to bucket_bytes
        |            (a piece: a transfer's box cut along its first dimension to fit a bucket)
        v  rounds: each message, as it is packed, into the first round where its sender sends
        |          and its receiver receives <= bucket_bytes, after the round that brought its
        |          relayed pieces to the sender (multi-hop routes pipelined bucket by bucket)
        v  per round: pack the sends (cast to the wire dtype) while the previous round is on
        |            the wire, land it (unpack), pack what forwards it, post this round's
        |            sends and receives in one batch
        v  optional verification: per-piece float64 checksums sent beside each message and
                                  compared with the written destination boxes
```

Each process derives its own part of the schedule (``schedule(..., process=me)``): the job's
messages and rounds come from piece sizes, looked up once per bundle, and only its own routes
are expanded into transfers and pieces. Every process orders and places the job's messages
the same way, so sender and receiver agree on each message's round and tag and no metadata
travels. For DeepSeek-V3 on 1,024 GPUs a process's part costs 21 CPU s at 64 MiB buckets and
6 s at 256 MiB (``benchmarks/reshard_plan.py``), where deriving the whole job's schedule on
every process would have cost about 150 s and over 10 GB. Extra memory per process during a
push: two send buckets (one in flight, one packed) and one receive bucket. Source parameters
and destination buffers are plain dicts of tensors named as the plan's layouts name them (a
Megatron rank's parameters; an SGLang rank's parameters). This module imports torch; the
planner modules beside it do not.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from reshard.planner import Plan, Transfer
from reshard.regions import Region
from reshard.transport import GroupLink, Link

__all__ = ["ExecutionReport", "ProcessMap", "execute", "fill_rank", "schedule"]

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fill_rank(layout, tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s parameters of ``layout`` (a ``TensorLayout``) filled box by box from whole
    canonical tensors in this process, zeros where no box lands: what ``execute`` leaves in that
    rank's buffers, without a plan (tests and benchmarks compare engines' loaders with it)."""
    some = next(iter(tensors.values()))
    out = {name: torch.zeros(shape, dtype=some.dtype) for name, shape in layout.param_shapes(rank).items()}
    for held in layout.holdings(rank).holdings:
        into = out[held.param][tuple(slice(a, b) for a, b in held.param_region)]
        into.copy_(tensors[held.tensor][tuple(slice(a, b) for a, b in held.region)].reshape(into.shape))
    return out


@dataclass(frozen=True, kw_only=True)
class ProcessMap:
    """Which torch.distributed rank plays each side's rank."""

    source: tuple[int, ...]
    """Process of each source (Megatron) rank."""
    destination: tuple[int, ...]
    """Process of each destination (SGLang) rank."""

    def roles(self, process: int) -> tuple[int | None, int | None]:
        """(source rank, destination rank) this process plays, None where it plays none."""
        return _only(self.source, process, "source"), _only(self.destination, process, "destination")


def _only(ranks: tuple[int, ...], process: int, side: str) -> int | None:
    mine = [rank for rank, p in enumerate(ranks) if p == process]
    if len(mine) > 1:
        raise ValueError(f"process {process} plays {side} ranks {mine}; one per process is supported")
    return mine[0] if mine else None


@dataclass(frozen=True)
class Piece:
    """A box of one transfer small enough for a bucket."""

    transfer: Transfer
    region: Region
    """The piece's box in canonical coordinates (with the tensor: its identity for relays)."""
    src_region: Region
    dst_region: Region
    also: tuple[tuple[str, Region], ...]
    """Further places on the receiver that take the piece (``Transfer.also``, split alike)."""
    numel: int


@dataclass(frozen=True)
class Message:
    """Pieces sent from one process to another in one buffer."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int
    tag: int = 0
    """Unique in the schedule: messages of two rounds between one pair never match up wrong."""
    fresh: bool = False
    """A relayed piece of it reached the sender in the round just before: packed only once that
    round has landed (the others are packed while it is still in flight)."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What one process does: its local copies and its messages in each round of the job."""

    process: int
    """The torch.distributed rank it is for."""
    local: tuple[Piece, ...]
    """Copies inside this process (a box it holds as a source rank and needs as a destination)."""
    rounds: tuple[tuple[Message, ...], ...]
    """One entry per round of the whole job (empty where this process has no message in it)."""
    bucket_bytes: int


@dataclass(kw_only=True)
class ExecutionReport:
    """What this process moved."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    bytes_relayed: int = 0
    rounds: int = 0
    peak_buffer_bytes: int = 0
    verified_pieces: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _split(region: Region, dim: int, start: int, stop: int) -> Region:
    (lo, _), out = region[dim], list(region)
    out[dim] = (lo + start, lo + stop)
    return tuple(out)


def _cut(region: Region, max_elements: int, tensor: str) -> tuple[int, int, int] | None:
    """(dim, rows, step): ``region`` cut along its first dim with extent > 1 into blocks of
    ``step`` rows of at most ``max_elements``; None when it fits whole."""
    numel = math.prod(b - a for a, b in region)
    if numel <= max_elements:
        return None
    dim = next(i for i, (a, b) in enumerate(region) if b - a > 1)
    rows = region[dim][1] - region[dim][0]
    step = max_elements // (numel // rows)
    if step == 0:
        raise ValueError(
            f"the bucket of {max_elements} elements is smaller than one row ({numel // rows} elements) "
            f"of {tensor}: raise bucket_bytes (rollout.reshard_bucket_mb) to hold one row"
        )
    return dim, rows, step


def _sizes(region: Region, max_elements: int, tensor: str) -> list[int]:
    """Elements of each piece ``_pieces`` cuts a transfer of ``region`` into."""
    numel = math.prod(b - a for a, b in region)
    cut = _cut(region, max_elements, tensor)
    if cut is None:
        return [numel]
    _, rows, step = cut
    per_row = numel // rows
    return [per_row * (min(r + step, rows) - r) for r in range(0, rows, step)]


def _pieces(t: Transfer, max_elements: int) -> list[Piece]:
    """Split ``t`` along the first canonical dim with extent > 1 into bucket-sized pieces (of
    ``_sizes``' elements: every process counts another's pieces with it)."""
    sizes = _sizes(t.region, max_elements, t.tensor)
    if len(sizes) == 1:
        return [Piece(t, t.region, t.src_region, t.dst_region, t.also, sizes[0])]
    dim, rows, step = _cut(t.region, max_elements, t.tensor)

    def part(region: Region, r: int) -> Region:
        return _split(region, dim + len(region) - len(t.region), r, min(r + step, rows))

    return [
        Piece(
            t,
            part(t.region, r),
            part(t.src_region, r),
            part(t.dst_region, r),
            tuple((param, part(box, r)) for param, box in t.also),
            numel,
        )
        for r, numel in zip(range(0, rows, step), sizes)
    ]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def schedule(plan: Plan, processes: ProcessMap, *, bucket_bytes: int, process: int) -> Schedule:
    """``process``'s part of the job's deterministic execution schedule, derived once per
    (plan, processes, bucket, process) and kept while the plan lives. Every process derives the
    same rounds and tags for a message it shares with another, so no metadata travels."""
    per_plan = _CACHE.setdefault(plan, {})
    key = (processes, bucket_bytes, process)
    if key not in per_plan:
        per_plan[key] = _schedule(plan, processes, bucket_bytes, process)
    return per_plan[key]


def _schedule(plan: Plan, processes: ProcessMap, bucket_bytes: int, me: int) -> Schedule:
    """The job's messages in order (hop, sender, receiver, route), each placed first-fit as it
    is packed; only ``me``'s routes are expanded into transfers and pieces. Every other route
    costs its bundle's piece sizes, looked up once per bundle: a process pays for its own
    part in full and for the rest of the job only with sizes and rounds."""
    itemsize = torch.empty((), dtype=WIRE_DTYPES[plan.destination.dtype]).element_size()
    if bucket_bytes < itemsize:
        raise ValueError(f"bucket_bytes is {bucket_bytes}; give at least one row of the largest tensor")
    max_elements = bucket_bytes // itemsize
    sizes = [[n for s in b.slices for n in _sizes(s.region, max_elements, s.tensor)] for b in plan.bundles]
    senders, receivers = _route_processes(plan, processes)
    local = tuple(
        p
        for r in np.flatnonzero((senders == receivers) & (senders == me)).tolist()
        for t in plan.route_transfers(r)
        for p in _pieces(t, max_elements)
    )
    packer = _Packer(plan, sizes, senders, receivers, me, max_elements, itemsize, bucket_bytes)
    moving = np.flatnonzero(senders != receivers)
    order = moving[np.lexsort((moving, receivers[moving], senders[moving], plan.route_hop[moving]))]
    keys = np.stack([plan.route_hop[order], senders[order], receivers[order]])
    bounds = [0, *(np.flatnonzero((np.diff(keys, axis=1) != 0).any(axis=0)) + 1).tolist(), len(order)]
    order = order.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if a < b:  # no moving route at all: one empty span
            packer.pair(order[a:b])
    rounds = [[] for _ in range(packer.loads.count)]
    for i, m in packer.mine:
        rounds[i].append(m)
    return Schedule(process=me, local=local, rounds=tuple(map(tuple, rounds)), bucket_bytes=bucket_bytes)


def _route_processes(plan: Plan, processes: ProcessMap) -> tuple[np.ndarray, np.ndarray]:
    """The sending and the receiving process of every route."""
    source, destination = np.asarray(processes.source), np.asarray(processes.destination)
    senders = np.empty(plan.num_routes, np.int64)
    relay = plan.route_relay
    senders[relay] = destination[plan.route_src[relay]]
    senders[~relay] = source[plan.route_src[~relay]]
    return senders, destination[plan.route_dst]


class _Packer:
    """Packs the routes of one (hop, sender, receiver) into messages of consecutive pieces up
    to the bucket, and places each in the first round where its sender and receiver have room,
    after the rounds that bring its relayed pieces to the sender (a relay forwards piece k
    while piece k + 1 is still coming in: multi-hop routes run pipelined)."""

    def __init__(self, plan, sizes, senders, receivers, me, max_elements, itemsize, bucket_bytes) -> None:
        self.plan, self.sizes, self.me = plan, sizes, me
        self.senders, self.receivers = senders.tolist(), receivers.tolist()
        self.bundle = plan.route_bundle.tolist()
        self.relay = plan.route_relay.tolist()
        self.max_elements, self.itemsize = max_elements, itemsize
        self.loads = _Loads(bucket_bytes)
        self.tag = 0
        self.mine: list[tuple[int, Message]] = []
        nb = len(plan.bundles)
        self.nb = nb
        # where each relaying process got each piece of the bundles it forwards, by round
        relayed = np.flatnonzero(plan.route_relay)
        self.forwards = set((senders[relayed] * nb + plan.route_bundle[relayed]).tolist())
        self.arrived: dict[int, list[int]] = {}

    def pair(self, routes: list[int]) -> None:
        plan, me, bundle, sizes, cap = self.plan, self.me, self.bundle, self.sizes, self.max_elements
        src, dst = self.senders[routes[0]], self.receivers[routes[0]]
        own = me in (src, dst)
        full = {r: [p for t in plan.route_transfers(r) for p in _pieces(t, cap)] for r in routes} if own else None
        parts, size = [], 0
        for r in routes:
            start = 0
            for j, n in enumerate(sizes[bundle[r]]):
                if size and size + n > cap:
                    if j > start:
                        parts.append((r, start, j))
                    self._emit(src, dst, parts, size, full)
                    parts, size, start = [], 0, j
                size += n
            parts.append((r, start, len(sizes[bundle[r]])))
        self._emit(src, dst, parts, size, full)

    def _emit(self, src: int, dst: int, parts: list[tuple[int, int, int]], size: int, full) -> None:
        nb, bundle, arrived = self.nb, self.bundle, self.arrived
        ready = -1
        for r, a, b in parts:
            if self.relay[r]:
                got = arrived.get(src * nb + bundle[r])  # None: a local copy brought it (before round 0)
                if got is not None:
                    ready = max(ready, max(got[a:b]))
        nbytes = size * self.itemsize
        i = self.loads.place(src, dst, nbytes, ready)
        for r, a, b in parts:
            key = dst * nb + bundle[r]
            if key in self.forwards:
                got = arrived.setdefault(key, [-1] * len(self.sizes[bundle[r]]))
                got[a:b] = [i] * (b - a)
        if full is not None:
            pieces = tuple(p for r, a, b in parts for p in full[r][a:b])
            self.mine.append((i, Message(src, dst, pieces, nbytes, tag=self.tag, fresh=ready == i - 1)))
        self.tag += 1


class _Loads:
    """Bytes each process sends and receives in each round, with two bit masks per process and
    direction: the rounds it uses at all and the rounds it has (nearly) filled. A message of a
    whole bucket fits only where both ends are unused: the lowest clear bit of the two masks'
    union, one integer operation where a scan walked thousands of busy rounds (the 1,024-GPU
    DeepSeek-V3 schedule: 180 of its 250 CPU s under the profiler). A smaller one may also fit a used round that
    neither end has filled: the first few such rounds are checked one by one (checking all of
    them cost 5x the CPU for 0.4% fewer rounds)."""

    def __init__(self, bucket_bytes: int) -> None:
        self.cap = bucket_bytes
        self.send: dict[int, _Side] = defaultdict(_Side)
        self.recv: dict[int, _Side] = defaultdict(_Side)
        self.count = 0

    def place(self, src: int, dst: int, nbytes: int, ready: int) -> int:
        """The first round after ``ready`` with room for ``nbytes`` out of ``src`` and into ``dst``
        (a round either end has filled, or past the candidates checked, is passed over)."""
        cap, send, recv = self.cap, self.send[src], self.recv[dst]
        start = ready + 1
        used = (send.used | recv.used) >> start
        i = start + (~used & (used + 1)).bit_length() - 1  # both unused from here on
        if nbytes < cap and i > start:
            open_both = (used & ~((send.full | recv.full) >> start)) & ((1 << (i - start)) - 1)
            for _ in range(_CANDIDATES):
                if not open_both:
                    break
                k = start + (open_both & -open_both).bit_length() - 1
                if send.load.get(k, 0) + nbytes <= cap and recv.load.get(k, 0) + nbytes <= cap:
                    i = k
                    break
                open_both &= open_both - 1
        send.add(i, nbytes, cap)
        recv.add(i, nbytes, cap)
        self.count = max(self.count, i + 1)
        return i


_CANDIDATES = 8
"""Used rounds a message smaller than the bucket tries before the first unused one."""


class _Side:
    """One process's loads in one direction: bytes by round, and the masks of used and filled rounds."""

    __slots__ = ("full", "load", "used")

    def __init__(self) -> None:
        self.load: dict[int, int] = {}
        self.used = 0
        self.full = 0

    def add(self, i: int, nbytes: int, cap: int) -> None:
        load = self.load[i] = self.load.get(i, 0) + nbytes
        self.used |= 1 << i
        if load > cap - cap // 8:  # filled: what room is left would take a small piece at most
            self.full |= 1 << i


def _view(params: Mapping[str, torch.Tensor], name: str, region: Region) -> torch.Tensor:
    try:
        tensor = params[name]
    except KeyError:
        raise KeyError(f"parameter {name!r} is not among this rank's {len(params)} tensors") from None
    return tensor[tuple(slice(a, b) for a, b in region)]


def _checksum(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), (flat * weights).sum()])


def execute(
    plan: Plan,
    processes: ProcessMap,
    *,
    sources: Mapping[str, torch.Tensor] | None,
    destinations: Mapping[str, torch.Tensor] | None,
    bucket_bytes: int,
    verify: bool = False,
    link: Link | None = None,
) -> ExecutionReport:
    """Run ``plan`` on this process (collective: every process of ``processes`` calls it; the
    processes are ranks of ``link``, the default group when None).

    Round i + 1's sends are packed while round i is on the wire; only the messages forwarding
    what round i brought are packed after it lands. A round's sends and receives are posted in
    one batch: NCCL runs separate batches one after the other on its stream, so a receive
    posted apart from the sends would wait for a peer whose send waits behind its own receive.
    The local copies run while round 0 is on the wire, unless round 0 forwards what they bring."""
    link = link or GroupLink()
    me = link.rank()
    plan.topology.check(plan.source.num_ranks, plan.destination.num_ranks)
    steps = schedule(plan, processes, bucket_bytes=bucket_bytes, process=me)
    io = _Io(sources, destinations, WIRE_DTYPES[plan.destination.dtype], verify)
    report = ExecutionReport(rounds=len(steps.rounds))
    local = steps.local
    flight = None
    for i, messages in enumerate(steps.rounds):
        early = [io.pack(m) for m in messages if m.src == me and not m.fresh]
        if flight is not None:
            report.peak_buffer_bytes = max(report.peak_buffer_bytes, flight.nbytes + _size(early))
            flight.land(io, report)
        fresh = [m for m in messages if m.src == me and m.fresh]
        if i == 0 and fresh:  # round 0 forwards what the local copies bring
            _copy_local(local, io, report)
        flight = _Flight.post(messages, me, early + [io.pack(m) for m in fresh], io, link, report)
        if i == 0 and not fresh:
            _copy_local(local, io, report)
        report.peak_buffer_bytes = max(report.peak_buffer_bytes, flight.nbytes)
    if flight is None:
        _copy_local(local, io, report)
    else:
        flight.land(io, report)
    return report


def _copy_local(pieces: list[Piece], io: _Io, report: ExecutionReport) -> None:
    for piece in pieces:
        io.write(piece, io.read(piece))
        report.bytes_copied_locally += piece.numel * io.wire.itemsize


def _size(packed) -> int:
    return sum(t.numel() * t.element_size() for _, tensors in packed for t in tensors)


@dataclass
class _Io:
    """Where pieces are read (a source rank's parameters, or a relay's own buffers) and written."""

    sources: Mapping[str, torch.Tensor] | None
    destinations: Mapping[str, torch.Tensor] | None
    wire: torch.dtype
    verify: bool

    def read(self, p: Piece) -> torch.Tensor:
        params = self.destinations if p.transfer.relay else self.sources
        return _view(params, p.transfer.src_param, p.src_region).to(self.wire)

    def write(self, p: Piece, values: torch.Tensor) -> None:
        for param, region in ((p.transfer.dst_param, p.dst_region), *p.also):
            dst = _view(self.destinations, param, region)
            dst.copy_(values.reshape(dst.shape))

    def pack(self, m: Message) -> tuple[Message, list[torch.Tensor]]:
        """(message, [buffer] or [buffer, checksums]) ready to send: each box copied (and cast)
        once, straight into its place in the buffer."""
        first = m.pieces[0].transfer
        params = self.destinations if first.relay else self.sources  # hop 0: sources; later: relays
        buffer = torch.empty(sum(p.numel for p in m.pieces), dtype=self.wire, device=params[first.src_param].device)
        offset, sums = 0, []
        for p in m.pieces:
            box = _view(params, p.transfer.src_param, p.src_region)
            chunk = buffer[offset : offset + p.numel].view(box.shape)
            chunk.copy_(box)
            offset += p.numel
            if self.verify:
                sums.append(_checksum(chunk))
        return m, [buffer, torch.stack(sums)] if self.verify else [buffer]


@dataclass
class _Flight:
    """One round on the wire: its posted works and the buffers they fill."""

    works: list
    inbox: list
    outbox: list
    """The packed sends, kept alive until the round lands."""
    nbytes: int

    @classmethod
    def post(cls, messages, me, packed, io: _Io, link: Link, report) -> _Flight:
        """Post this round's receives and the sends in ``packed``, in one batch."""
        sends, receives, inbox = [], [], []
        for m, tensors in packed:
            sends += [(t, m.dst, 2 * m.tag + i) for i, t in enumerate(tensors)]
            report.bytes_sent += m.nbytes
            report.bytes_relayed += m.nbytes if m.pieces[0].transfer.relay else 0
        for m in messages:
            if m.dst != me:
                continue
            device = io.destinations[m.pieces[0].transfer.dst_param].device  # NCCL receives on the GPU
            tensors = [torch.empty(sum(p.numel for p in m.pieces), dtype=io.wire, device=device)]
            if io.verify:
                tensors.append(torch.empty(len(m.pieces), 2, dtype=torch.float64, device=device))
            receives += [(t, m.src, 2 * m.tag + i) for i, t in enumerate(tensors)]
            inbox.append((m, tensors))
            report.bytes_received += m.nbytes
        return cls(link.start(sends, receives), inbox, packed, _size(packed) + _size(inbox))

    def land(self, io: _Io, report) -> None:
        for work in self.works:
            work.wait()
        for m, tensors in self.inbox:
            _unpack(m, tensors, io, report)


def _unpack(message: Message, tensors: list[torch.Tensor], io: _Io, report) -> None:
    buffer, sums = tensors[0], (tensors[1] if len(tensors) > 1 else None)
    offset = 0
    for index, p in enumerate(message.pieces):
        io.write(p, buffer[offset : offset + p.numel])
        offset += p.numel
        if sums is not None:
            got = _checksum(_view(io.destinations, p.transfer.dst_param, p.dst_region).to(buffer.dtype))
            if not torch.equal(got, sums[index]):
                raise RuntimeError(
                    f"checksum mismatch for {p.transfer.tensor} {p.region} into "
                    f"{p.transfer.dst_param} {p.dst_region} from process {message.src}"
                )
            report.verified_pieces += 1
