"""Run a reshard plan over torch.distributed point-to-point, in bounded-memory buckets.

```
Plan (same on every process)  +  ProcessMap (side rank -> torch.distributed rank)
        |
        v  pieces: each transfer, split along its first dimension so no piece exceeds the bucket
        v  messages: consecutive pieces of one (hop, sender process, receiver process),
        |            packed up to bucket_bytes; same process -> local copies, no message
        v  rounds: first-fit, hop by hop, so each process sends <= bucket_bytes and receives
        |          <= bucket_bytes per round, and a relayed piece goes out the round after it
        |          came in (multi-hop routes pipelined bucket by bucket)
        v  per round: pack the sends (cast to the wire dtype) while the previous round is on
        |            the wire, land it (unpack), pack what forwards it, post this round's
        |            sends and receives in one batch
        v  optional verification: per-piece float64 checksums sent beside each message and
                                  compared with the written destination boxes
```

The schedule is derived once per (plan, process map, bucket) and cached with the plan. Extra
memory per process: two send buckets (one in flight, one packed) and one receive bucket.
Every process derives the same pieces, messages and rounds from the plan, so no metadata
travels. Source parameters and destination buffers are plain dicts of tensors named as the
plan's layouts name them (a Megatron rank's parameters; an SGLang rank's parameters). This
module imports torch; the planner modules beside it do not.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from reshard.planner import Plan, Transfer
from reshard.regions import Region
from reshard.transport import GroupLink, Link

__all__ = ["ExecutionReport", "ProcessMap", "execute", "schedule"]

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """What every process will do: local copies and rounds of messages."""

    local: tuple[Piece, ...]
    rounds: tuple[tuple[Message, ...], ...]
    bucket_bytes: int
    _mine: dict = field(default_factory=dict, compare=False, repr=False)

    def rounds_for(self, process: int) -> list[list[Message]]:
        """The rounds with only the messages ``process`` sends or receives (memoised)."""
        if process not in self._mine:
            self._mine[process] = [[m for m in r if process in (m.src, m.dst)] for r in self.rounds]
        return self._mine[process]


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


def _pieces(t: Transfer, max_elements: int) -> list[Piece]:
    """Split ``t`` along the first canonical dim with extent > 1 into bucket-sized pieces."""
    numel = math.prod(b - a for a, b in t.region)
    if numel <= max_elements:
        return [Piece(t, t.region, t.src_region, t.dst_region, t.also, numel)]
    dim = next(i for i, (a, b) in enumerate(t.region) if b - a > 1)
    rows = t.region[dim][1] - t.region[dim][0]
    per_row = numel // rows
    step = max_elements // per_row
    if step == 0:
        raise ValueError(
            f"the bucket of {max_elements} elements is smaller than one row ({per_row} elements) "
            f"of {t.tensor}: raise bucket_bytes (rollout.reshard_bucket_mb) to hold one row"
        )

    def cut(region: Region, r: int) -> Region:
        return _split(region, dim + len(region) - len(t.region), r, min(r + step, rows))

    return [
        Piece(
            t,
            cut(t.region, r),
            cut(t.src_region, r),
            cut(t.dst_region, r),
            tuple((param, cut(box, r)) for param, box in t.also),
            per_row * (min(r + step, rows) - r),
        )
        for r in range(0, rows, step)
    ]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def schedule(plan: Plan, processes: ProcessMap, *, bucket_bytes: int) -> Schedule:
    """The deterministic execution schedule of ``plan`` (identical on every process), derived
    once per (plan, processes, bucket) and kept while the plan lives."""
    per_plan = _CACHE.setdefault(plan, {})
    key = (processes, bucket_bytes)
    if key not in per_plan:
        per_plan[key] = _schedule(plan, processes, bucket_bytes)
    return per_plan[key]


def _schedule(plan: Plan, processes: ProcessMap, bucket_bytes: int) -> Schedule:
    itemsize = torch.empty((), dtype=WIRE_DTYPES[plan.destination.dtype]).element_size()
    if bucket_bytes < itemsize:
        raise ValueError(f"bucket_bytes is {bucket_bytes}; give at least one row of the largest tensor")
    max_elements = bucket_bytes // itemsize
    local: list[Piece] = []
    per_key: dict[tuple[int, int, int], list[Piece]] = defaultdict(list)
    for t in plan.transfers():
        src = (processes.destination if t.relay else processes.source)[t.src_rank]
        dst = processes.destination[t.dst_rank]
        pieces = _pieces(t, max_elements)
        (local if src == dst else per_key[(t.hop, src, dst)]).extend(pieces)
    # hop-major: a relayed message is placed after the messages that bring its pieces
    messages = [m for key in sorted(per_key) for m in _pack(key[1:], per_key[key], max_elements, itemsize)]
    arrived = {(processes.destination[p.transfer.dst_rank], p.transfer.tensor, p.region): -1 for p in local}
    return Schedule(local=tuple(local), rounds=_rounds(messages, bucket_bytes, arrived), bucket_bytes=bucket_bytes)


def _pack(pair, pieces: list[Piece], max_elements: int, itemsize: int) -> list[Message]:
    out, current, size = [], [], 0
    for piece in pieces:
        if current and size + piece.numel > max_elements:
            out.append(Message(pair[0], pair[1], tuple(current), size * itemsize))
            current, size = [], 0
        current.append(piece)
        size += piece.numel
    if current:
        out.append(Message(pair[0], pair[1], tuple(current), size * itemsize))
    return out


def _rounds(messages: list[Message], bucket_bytes: int, arrived: dict) -> tuple[tuple[Message, ...], ...]:
    """First-fit: a message joins the first round, after the rounds that bring its relayed pieces
    to its sender, where its sender and receiver have room. A relay thus forwards piece k while
    piece k + 1 is still coming in: multi-hop routes run pipelined."""
    rounds: list[list[Message]] = []
    send_load: list[dict[int, int]] = []
    recv_load: list[dict[int, int]] = []
    for tag, m in enumerate(messages):
        ready = max((arrived[(m.src, p.transfer.tensor, p.region)] for p in m.pieces if p.transfer.relay), default=-1)
        i = ready + 1
        while i < len(rounds) and not (
            send_load[i].get(m.src, 0) + m.nbytes <= bucket_bytes
            and recv_load[i].get(m.dst, 0) + m.nbytes <= bucket_bytes
        ):
            i += 1
        while len(rounds) <= i:
            rounds.append([])
            send_load.append({})
            recv_load.append({})
        rounds[i].append(dataclasses.replace(m, tag=tag, fresh=ready == i - 1))
        send_load[i][m.src] = send_load[i].get(m.src, 0) + m.nbytes
        recv_load[i][m.dst] = recv_load[i].get(m.dst, 0) + m.nbytes
        for p in m.pieces:
            arrived[(m.dst, p.transfer.tensor, p.region)] = i
    return tuple(tuple(r) for r in rounds)


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
    steps = schedule(plan, processes, bucket_bytes=bucket_bytes)
    io = _Io(sources, destinations, WIRE_DTYPES[plan.destination.dtype], verify)
    report = ExecutionReport(rounds=len(steps.rounds))
    local = [p for p in steps.local if processes.source[p.transfer.src_rank] == me]
    flight = None
    for i, messages in enumerate(steps.rounds_for(me)):
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
