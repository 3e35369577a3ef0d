"""Lost rollout engines replaced mid-run, up to ``rollout.max_engine_restarts``.

```
replicas.generate: the drivers' reports       EngineSync.push: each driver's "lost" flag
   gathered on every process of the channel (colocated: the actor ranks; separate: the actor
   ranks and the engine ranks), so every process sees the same engines lost (EngineLost: a
   process died, or a call outran generate_timeout_s)
      │  EngineRestarts.replace(lost), every process together, the same decision everywhere
      ├─ past max_engine_restarts, or separate engines spanning nodes: ReplicaFailed, one line
      │  naming the replica, the cause and the setting to raise
      ├─ each lost replica's driver (an actor rank colocated, an engine rank separate): shut
      │  the old engine down (every process of it killed and reaped), start a new one as the
      │  run did (start_engine: load_format=dummy, empty) into the process's EngineClient,
      │  where EngineSync reads it
      ├─ every process: the reshard plan's weight push again (actor ranks send, engine ranks
      │  receive; no "push" announcement: the engine ranks are already in the same call), so
      │  the new engine holds the actor's current weights before it serves
      └─ generate: the call runs again, same chunks, same seeds, same samples
         push: the push runs again, as the lost one would have (refit checks included)
```

A fresh engine holds all its memory, which is what generation needs: the colocated GPUs stay
in the ``generate`` mode they were in. A colocated engine lost in a push comes back holding its
KV cache too, in the ``sync`` mode, which may not have room for it (checked on CPUs only so
far). The budget counts the restarts of this process (a resumed run starts with the whole
budget again); every process counts every restart, so the budget's answer is the same on all
of them.

An engine spanning nodes is replaced whole: the first rank of each of its nodes shuts its part
down and starts a new one, and the parts meet at the driver's new address (``respawn``, the
worker's ``_respawn``), as at the run's start.

Not covered, each refused by name: engines spanning nodes with separate placement
(``check_restart``), and batches that asynchronous RL started ahead (``replicas.collect``):
the engine ranks generate those while the actor ranks train, so no one could push the new
engine the batch's weights.
"""

from __future__ import annotations

import logging
from typing import Callable

from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.replicas import ReplicaFailed, engine_nodes
from hybridflow.runtime.session import start_engine

__all__ = ["EngineRestarts", "check_restart"]

logger = logging.getLogger(__name__)

METRIC = "rollout/engine_restarts"
"""Restarts in the step (a step metric) and over the run (the summary's ``engine_restarts``)."""


def check_restart(cfg, lost: list[tuple[int, int, str]], used: int, *, spanning: bool = False) -> None:
    """ReplicaFailed (one line) unless the engines ``lost`` ([(driver rank, replica, cause)]) can
    be restarted after ``used`` restarts so far; ``spanning``: engines spanning nodes can be
    (every node's part restarts, colocated placement)."""
    rank, replica, cause = lost[0]
    where = f"rollout replica {replica} (driven by rank {rank}) lost its engine: {cause}"
    limit = cfg.rollout.max_engine_restarts
    if engine_nodes(cfg) > 1 and not spanning:  # separate placement: the engine ranks start whole engines only
        raise ReplicaFailed(
            f"{where}; engine restarts are not supported for engines spanning nodes with "
            "rollout.placement=separate yet: rerun the same command to resume from the newest checkpoint"
        )
    if used + len(lost) > limit:
        raise ReplicaFailed(
            f"{where}; {used} of rollout.max_engine_restarts={limit} restarts used: "
            "raise rollout.max_engine_restarts to survive more engine failures"
        )


class EngineRestarts:
    """One process's part in replacing lost engines (every process of the channel holds one).

    ``engines``: where this process keeps its replica's engine and its weight push.
    ``respawn(replicas)``: replaces every node's part of those replicas' engines when engines
    span nodes (collective: each part's rank starts its new part, and they meet at the driver's
    new address); None: such engines are refused."""

    def __init__(self, engines: EngineClient, *, respawn: Callable[[set[int]], None] | None = None) -> None:
        self.holder = engines
        self.respawn = respawn
        self.used = 0
        """Restarts so far in this process (the loop reports each step's share as ``METRIC``)."""

    def replace(self, lost: list[tuple[int, int, str]]) -> None:
        """Replace the engines of ``lost`` ([(driver rank, replica, cause)]) with new, empty ones
        (every process together: each checks the same budget; the lost replicas' drivers act)."""
        h = self.holder
        spanning = engine_nodes(h.cfg) > 1
        check_restart(h.cfg, lost, self.used, spanning=self.respawn is not None)
        self.used += len(lost)
        if h.engine is not None and h.replica in {replica for _, replica, _ in lost}:
            cause = next(c for _, replica, c in lost if replica == h.replica)
            logger.warning(
                "rollout replica %d lost its engine (%s): restarting it (restart %d of %d)",
                h.replica,
                cause,
                self.used,
                h.cfg.rollout.max_engine_restarts,
            )
            if not spanning:
                h.engine.shutdown()  # kills and reaps whatever of it is left
                h.engine = start_engine(h.cfg, h.model_dir)
        if spanning:  # every rank: the parts on other nodes restart with the driver's
            self.respawn({replica for _, replica, _ in lost})
        h.sync.engines_replaced()

    def restart(self, lost: list[tuple[int, int, str]]):
        """``replace`` the engines of ``lost``, then push them the current weights (collective;
        a push that loses an engine restarts it too); returns this process's engine, new or not."""
        self.replace(lost)
        self.holder.sync.push(counted=False, announce=False)  # the weights the failed call generated with
        return self.holder.engine
