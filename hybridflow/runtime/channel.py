"""The processes a rollout call and a weight push span, and how they talk.

```
colocated:  every process is an actor rank; the engines' drivers are actor ranks too
            Channel over the default group (torch.distributed's own collectives)

separate:   torchrun starts A actor ranks + E engine ranks (rollout.tp x num_replicas), one world
   ranks 0 .. A-1     default group "actor/" (megatron-core's groups, checkpoints: as colocated)
   ranks A .. A+E-1   default group "engine/" (the engine ranks' own: handles to each driver)
   all A + E          a joint process group over the same store, made directly (torch.distributed
                      knows only one default group per process): rollout requests, samples and
                      the reshard plan's point-to-point weight routes
```

frozen models on GPUs of their own (``reward_model.gpus``, ``distillation.gpus``): F more ranks
each, after the engines', default group "<role>/", and a joint gloo group "<role>-objects/" of
the A actor ranks and its F (joint ranks A .. A+F-1): the token ids of a step's samples go in,
the scores or log-probs come out (``frozen_ranks``)

The joint group is gloo on CPU. On GPUs the weights and samples take an NCCL group over the
same store and ranks, and the small pickled messages a gloo one (NCCL moves device tensors
only). Joint rank 0 is actor rank 0: it announces each request (``announce``) and the engine
ranks, which wait in ``serve``, follow.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from reshard.transport import GroupLink, Link, ProcessGroupLink

__all__ = ["Channel", "Joined", "colocated", "join"]


@dataclasses.dataclass(frozen=True)
class Channel:
    """Rank, store and collectives of the processes a rollout spans."""

    link: Link
    """Point-to-point (samples, weights)."""
    store: Any
    """The shared key-value store (replica drivers' chunk counter)."""
    actors: int
    """Actor ranks: joint ranks 0 .. actors-1; engine ranks follow."""
    objects: Any = None
    """The joint gloo group for pickled messages, or None: the default group."""

    @property
    def rank(self) -> int:
        return self.link.rank()

    @property
    def size(self) -> int:
        return self.link.size()

    @property
    def separate(self) -> bool:
        return self.objects is not None

    def gather(self, value: Any) -> list:
        """Every process's ``value``, in rank order (on every process)."""
        if self.objects is None:
            out: list = [None] * dist.get_world_size()
            dist.all_gather_object(out, value)
            return out
        return _gather_objects(self.objects, value)

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """``src``'s ``value`` on every process."""
        if self.objects is None:
            box = [value]
            dist.broadcast_object_list(box, src=src)
            return box[0]
        return _gather_objects(self.objects, value if self.rank == src else None)[src]

    def announce(self, request: Any) -> None:
        """Actor rank 0 tells the engine ranks what comes next (a no-op when colocated)."""
        if self.separate:
            self.broadcast(request if self.rank == 0 else None)

    def barrier(self) -> None:
        if self.objects is None:
            dist.barrier()
        else:
            self.objects.barrier().wait()


def colocated() -> Channel:
    """Every process is an actor rank (the default group)."""
    return Channel(link=GroupLink(), store=dist.distributed_c10d._get_default_store(), actors=dist.get_world_size())


@dataclasses.dataclass(frozen=True)
class Joined:
    """This process's place in a job of several worlds (``join``)."""

    world: str
    """Its own world: ``actor``, ``engine``, or a frozen model's role (``reward_model``, ``teacher``)."""
    rank: int
    """Its rank in its own world (its default group)."""
    size: int
    """Its own world's size."""
    store: Any
    """The job's store; the default group starts on ``PrefixStore(world + "/", store)``."""
    engines: Channel | None
    """The actor ranks' joint channel with the separate engine ranks (on both), else None."""
    frozen: dict[str, Channel]
    """Each frozen model's joint channel with the actor ranks: every one on an actor rank, its
    own on a frozen model's rank."""


def join(worlds: dict[str, int], *, timeout_minutes: int) -> Joined:
    """A torchrun job of several worlds, ranks numbered in ``worlds``' order (``actor`` first, then
    ``engine`` when separate, then the frozen models with GPUs of their own): this process's
    world and the joint channels it is part of. Call before the default group exists."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # torchrun's agent hosts the store unless told not to (hybridflow launch turns it off); then
    # rank 0 hosts it, as init_process_group would
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
    )
    starts, first = {}, 0
    for name, size in worlds.items():
        starts[name], first = range(first, first + size), first + size
    mine = next(name for name, ranks in starts.items() if rank in ranks)
    actors = worlds["actor"]
    engines = None
    if "engine" in worlds and mine in ("actor", "engine"):
        engines = _engine_channel(store, rank, actors, actors + worlds["engine"], timeout)
    frozen = {}
    for name, ranks in starts.items():
        if name not in ("actor", "engine") and mine in ("actor", name):  # actor ranks first, then its own
            joint = rank if mine == "actor" else actors + rank - ranks.start
            objects = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{name}-objects/", store), joint, actors + len(ranks), timeout=timeout
            )
            frozen[name] = Channel(link=ProcessGroupLink(objects), store=store, actors=actors, objects=objects)
    own = starts[mine]
    return Joined(world=mine, rank=rank - own.start, size=len(own), store=store, engines=engines, frozen=frozen)


def _engine_channel(store, rank: int, actors: int, size: int, timeout: datetime.timedelta) -> Channel:
    """The joint channel of the actor ranks and the separate engine ranks (joint ranks 0 .. size-1)."""
    objects = dist.ProcessGroupGloo(dist.PrefixStore("joint-objects/", store), rank, size, timeout=timeout)
    data = objects
    if torch.cuda.is_available():  # weights and samples move as device tensors
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        data = dist.ProcessGroupNCCL(dist.PrefixStore("joint-data/", store), rank, size, options)
    return Channel(link=ProcessGroupLink(data), store=store, actors=actors, objects=objects)


def _gather_objects(pg, value: Any) -> list:
    """All-gather of pickled values over a gloo process group object."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(pg.size())]
    pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(pg.size())]
    pg.allgather([parts], [padded]).wait()
    return [pickle.loads(p[: int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]
