"""Rollout samples from the replica drivers to the data-parallel ranks that train on them.

```
driver d: samples ──meta (ids' lengths, a few ints each)──all-gather──► every rank: the global
   │                                                                    order and who owns what
   └──for each rank r: the samples r's DP rank owns, packed as two flat tensors
        (int32: prompt ids, response ids, a trajectory's loss mask, routed experts; float32: log-probs)
        ──point-to-point (NCCL on GPUs, gloo on CPU)──► rank r unpacks them, in global order
```

Each rank receives its own DP rank's share and nothing else: a DP rank of D receives about
1 / D of the batch (its TP / PP peers receive the same rows), where an all-gather of the samples
would hand every rank all of them. Only the per-sample metadata goes everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from hybridflow.rollout.base import RolloutSample
from reshard.transport import GroupLink, Link

__all__ = ["Delivery", "SampleMeta", "deliver", "meta_of", "pack", "unpack"]


@dataclasses.dataclass(frozen=True)
class SampleMeta:
    """What every rank learns of every sample (a few ints)."""

    prompt_index: int
    sample_index: int
    prompt_len: int
    response_len: int
    finish_reason: str
    routes_shape: tuple[int, ...] | None
    segments: tuple[tuple[int, int], ...] = ()
    """``RolloutSample.segments``: a few pairs, so they travel with the metadata."""
    masked: bool = False
    """The sample has a loss mask (a multi-turn trajectory): it travels after the ids."""
    turn_stats: tuple[int, ...] = ()
    """``RolloutSample.turn_stats``: every rank sums them into the step's metrics."""

    @property
    def num_ints(self) -> int:
        routes = 0 if self.routes_shape is None else int(torch.Size(self.routes_shape).numel())
        return self.prompt_len + self.response_len * (2 if self.masked else 1) + routes


def meta_of(x: RolloutSample) -> SampleMeta:
    routes = None if x.routed_experts is None else tuple(torch.as_tensor(x.routed_experts).shape)
    return SampleMeta(
        prompt_index=x.prompt_index,
        sample_index=x.sample_index,
        prompt_len=len(x.prompt_ids),
        response_len=len(x.response_ids),
        finish_reason=x.finish_reason,
        routes_shape=routes,
        segments=tuple(x.segments),
        masked=bool(x.loss_mask),
        turn_stats=tuple(x.turn_stats),
    )


def pack(samples: Sequence[RolloutSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 ids and routes, float32 log-probs) of ``samples``, flat, on the host."""
    ints, floats = [], []
    for x in samples:
        ints.append(torch.tensor((*x.prompt_ids, *x.response_ids, *x.loss_mask), dtype=torch.int32))
        if x.routed_experts is not None:
            ints.append(torch.as_tensor(x.routed_experts).to(torch.int32).flatten())
        floats.append(torch.tensor(x.logprobs, dtype=torch.float32))
    return (
        torch.cat(ints) if ints else torch.zeros(0, dtype=torch.int32),
        torch.cat(floats) if floats else torch.zeros(0, dtype=torch.float32),
    )


def unpack(metas: Sequence[SampleMeta], ints: torch.Tensor, floats: torch.Tensor) -> list[RolloutSample]:
    """The samples ``pack`` flattened, given their metadata."""
    out, i, f = [], 0, 0
    ints_list, floats_list = ints.tolist(), floats.tolist()  # one conversion, then plain slices
    for m in metas:
        ids = ints_list[i : i + m.prompt_len + m.response_len]
        i += len(ids)
        mask = ints_list[i : i + m.response_len] if m.masked else []
        i += len(mask)
        routes = None
        if m.routes_shape is not None:
            count = m.num_ints - len(ids) - len(mask)
            routes = ints[i : i + count].to(torch.long).reshape(m.routes_shape)
            i += count
        out.append(
            RolloutSample(
                prompt_index=m.prompt_index,
                sample_index=m.sample_index,
                prompt_ids=tuple(ids[: m.prompt_len]),
                response_ids=tuple(ids[m.prompt_len :]),
                logprobs=tuple(floats_list[f : f + m.response_len]),
                finish_reason=m.finish_reason,
                routed_experts=routes,
                segments=m.segments,
                loss_mask=tuple(mask),
                turn_stats=m.turn_stats,
            )
        )
        f += m.response_len
    return out


@dataclasses.dataclass(frozen=True)
class Delivery:
    """What one rank holds after ``deliver``."""

    samples: tuple[RolloutSample, ...]
    """This rank's DP rank's samples, in global order."""
    positions: tuple[int, ...]
    """Each of them's position in the global (prompt, sample) order."""
    metas: tuple[SampleMeta, ...]
    """Every sample's metadata, in global order."""
    received_bytes: int
    """Bytes this rank received point to point (its own samples not counted)."""


def deliver(
    mine: Sequence[RolloutSample],
    metas_by_rank: Sequence[Sequence[SampleMeta]],
    dp_of_rank: Sequence[int | None],
    owner_of: Callable[[SampleMeta], int],
    *,
    device: torch.device,
    link: Link | None = None,
) -> Delivery:
    """Move every sample to the ranks of the DP rank that owns it (a collective over ``link``,
    the default group when None: every rank calls it with the same metadata).

    ``mine``: the samples this rank holds (``metas_by_rank[rank]`` describes them);
    ``dp_of_rank[r]``: rank r's data-parallel rank (None: an engine process, which trains on
    nothing); ``owner_of(meta)``: the owning DP rank."""
    link = link or GroupLink()
    rank = link.rank()
    me = dp_of_rank[rank]
    sends, receives, inbox = [], [], []
    for peer, metas in enumerate(metas_by_rank):
        if peer == rank:
            continue
        out = [mine[j] for j, m in enumerate(metas_by_rank[rank]) if owner_of(m) == dp_of_rank[peer]]
        if out:
            sends += [(t.to(device), peer, tag) for tag, t in enumerate(pack(out))]
        wanted = [m for m in metas if owner_of(m) == me]
        if wanted:
            ints = torch.empty(sum(m.num_ints for m in wanted), dtype=torch.int32, device=device)
            floats = torch.empty(sum(m.response_len for m in wanted), dtype=torch.float32, device=device)
            receives += [(ints, peer, 0), (floats, peer, 1)]
            inbox.append((wanted, ints, floats))
    link.exchange(sends, receives)
    received = [x for x, m in zip(mine, metas_by_rank[rank]) if owner_of(m) == me]
    nbytes = 0
    for wanted, ints, floats in inbox:
        received += unpack(wanted, ints.cpu(), floats.cpu())
        nbytes += ints.numel() * 4 + floats.numel() * 4
    order = sorted(((m.prompt_index, m.sample_index), m) for metas in metas_by_rank for m in metas)
    position = {key: i for i, (key, _) in enumerate(order)}
    received.sort(key=lambda x: (x.prompt_index, x.sample_index))
    return Delivery(
        samples=tuple(received),
        positions=tuple(position[(x.prompt_index, x.sample_index)] for x in received),
        metas=tuple(m for _, m in order),
        received_bytes=nbytes,
    )
