"""Run a reshard plan over torch.distributed point-to-point, in bounded-memory buckets.

```
Plan (same on every process)  +  ProcessMap (side rank -> torch.distributed rank)
        |
        v  pieces: each transfer, split along its first dimension so no piece exceeds the bucket
        v  messages: consecutive pieces of one (source process, destination process) pair,
        |            packed up to bucket_bytes; same process -> local copies, no message
        v  rounds: first-fit, so each process sends <= bucket_bytes and receives <= bucket_bytes
        |          per round (its extra memory: one send and one receive bucket at most)
        v  per round: pack sends (cast to the wire dtype), batch_isend_irecv, unpack receives
        v  optional verification: per-piece float64 checksums sent beside each message and
                                  compared with the written destination boxes
```

Every process derives the same pieces, messages and rounds from the plan, so no metadata
travels. Source parameters and destination buffers are plain dicts of tensors named as the
plan's layouts name them (a Megatron rank's parameters; an SGLang rank's parameters). This
module imports torch; the planner modules beside it do not.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

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
    src_region: Region
    dst_region: Region
    numel: int


@dataclass(frozen=True)
class Message:
    """Pieces sent from one process to another in one buffer."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What every process will do: local copies and rounds of messages."""

    local: tuple[Piece, ...]
    rounds: tuple[tuple[Message, ...], ...]
    bucket_bytes: int


@dataclass(kw_only=True)
class ExecutionReport:
    """What this process moved."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
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
        return [Piece(t, t.src_region, t.dst_region, numel)]
    dim = next(i for i, (a, b) in enumerate(t.region) if b - a > 1)
    rows = t.region[dim][1] - t.region[dim][0]
    per_row = numel // rows
    step = max_elements // per_row
    if step == 0:
        raise ValueError(f"bucket of {max_elements} elements is smaller than one row ({per_row}) of {t.tensor}")
    src_dim = dim + len(t.src_region) - len(t.region)
    dst_dim = dim + len(t.dst_region) - len(t.region)
    return [
        Piece(t, _split(t.src_region, src_dim, r, min(r + step, rows)),
              _split(t.dst_region, dst_dim, r, min(r + step, rows)), per_row * (min(r + step, rows) - r))
        for r in range(0, rows, step)
    ]


def schedule(plan: Plan, processes: ProcessMap, *, bucket_bytes: int) -> Schedule:
    """The deterministic execution schedule of ``plan`` (identical on every process)."""
    itemsize = torch.empty((), dtype=WIRE_DTYPES[plan.destination.dtype]).element_size()
    max_elements = bucket_bytes // itemsize
    local: list[Piece] = []
    per_pair: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for t in plan.transfers():
        src, dst = processes.source[t.src_rank], processes.destination[t.dst_rank]
        pieces = _pieces(t, max_elements)
        (local if src == dst else per_pair[(src, dst)]).extend(pieces)
    messages = [m for pair in sorted(per_pair) for m in _pack(pair, per_pair[pair], max_elements, itemsize)]
    return Schedule(local=tuple(local), rounds=_rounds(messages, bucket_bytes), bucket_bytes=bucket_bytes)


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


def _rounds(messages: list[Message], bucket_bytes: int) -> tuple[tuple[Message, ...], ...]:
    """First-fit: a message joins the first round where its sender and receiver have room."""
    rounds: list[list[Message]] = []
    send_load: list[dict[int, int]] = []
    recv_load: list[dict[int, int]] = []
    for m in messages:
        for i, members in enumerate(rounds):
            if send_load[i].get(m.src, 0) + m.nbytes <= bucket_bytes and recv_load[i].get(m.dst, 0) + m.nbytes <= bucket_bytes:
                break
        else:
            rounds.append([])
            send_load.append({})
            recv_load.append({})
            i = len(rounds) - 1
        rounds[i].append(m)
        send_load[i][m.src] = send_load[i].get(m.src, 0) + m.nbytes
        recv_load[i][m.dst] = recv_load[i].get(m.dst, 0) + m.nbytes
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
    processes are ranks of ``link``, the default group when None)."""
    link = link or GroupLink()
    me = link.rank()
    plan.topology.check(plan.source.num_ranks, plan.destination.num_ranks)
    steps = schedule(plan, processes, bucket_bytes=bucket_bytes)
    wire = WIRE_DTYPES[plan.destination.dtype]
    report = ExecutionReport(rounds=len(steps.rounds))
    for piece in steps.local:
        if processes.source[piece.transfer.src_rank] == me:
            _copy(piece, sources, destinations)
            report.bytes_copied_locally += piece.numel * wire.itemsize
    for messages in steps.rounds:
        _run_round(messages, me, sources, destinations, wire, verify, link, report)
    return report


def _copy(piece: Piece, sources, destinations) -> None:
    src = _view(sources, piece.transfer.src_param, piece.src_region)
    dst = _view(destinations, piece.transfer.dst_param, piece.dst_region)
    dst.copy_(src.reshape(dst.shape))


def _run_round(messages, me, sources, destinations, wire, verify, link: Link, report) -> None:
    sends, receives, inbox, outbox = [], [], [], []
    for tag, m in enumerate(messages):
        if m.src == me:
            buffer = torch.cat([_view(sources, p.transfer.src_param, p.src_region).reshape(-1).to(wire) for p in m.pieces])
            outbox.append(buffer)
            sends.append((buffer, m.dst, 2 * tag))
            if verify:
                sums = torch.stack([_checksum(_view(sources, p.transfer.src_param, p.src_region).to(wire)) for p in m.pieces])
                outbox.append(sums)
                sends.append((sums, m.dst, 2 * tag + 1))
            report.bytes_sent += m.nbytes
        elif m.dst == me:
            device = destinations[m.pieces[0].transfer.dst_param].device  # NCCL receives on the GPU
            buffer = torch.empty(sum(p.numel for p in m.pieces), dtype=wire, device=device)
            sums = torch.empty(len(m.pieces), 2, dtype=torch.float64, device=device) if verify else None
            inbox.append((m, buffer, sums))
            receives.append((buffer, m.src, 2 * tag))
            if verify:
                receives.append((sums, m.src, 2 * tag + 1))
            report.bytes_received += m.nbytes
    report.peak_buffer_bytes = max(
        report.peak_buffer_bytes,
        sum(b.numel() * b.element_size() for b in outbox) + sum(b.numel() * b.element_size() for _, b, _ in inbox),
    )
    link.exchange(sends, receives)
    for m, buffer, sums in inbox:
        _unpack(m, buffer, sums, destinations, report)


def _unpack(message: Message, buffer: torch.Tensor, sums, destinations, report) -> None:
    offset = 0
    for index, p in enumerate(message.pieces):
        dst = _view(destinations, p.transfer.dst_param, p.dst_region)
        chunk = buffer[offset : offset + p.numel]
        dst.copy_(chunk.reshape(dst.shape))
        offset += p.numel
        if sums is not None:
            got = _checksum(dst.to(buffer.dtype))
            if not torch.equal(got, sums[index]):
                raise RuntimeError(
                    f"checksum mismatch for {p.transfer.tensor} {p.transfer.region} into "
                    f"{p.transfer.dst_param} {p.dst_region} from process {message.src}"
                )
            report.verified_pieces += 1
