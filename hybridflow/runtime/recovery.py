"""Lost rollout engines replaced mid-run, up to ``rollout.max_engine_restarts``.

```
replicas.generate: the drivers' reports, gathered on every rank
   some report an engine lost (EngineLost: a process died, or a call outran generate_timeout_s)
      │  EngineRestarts.restart(lost), every rank together, the same decision everywhere
      ├─ past max_engine_restarts, or a layout restarts do not cover: ReplicaFailed, one line
      │  naming the replica, the cause and the setting to raise
      ├─ each lost replica's driver: shut the old engine down (every process of it killed
      │  and reaped), start a new one as the run did (start_engine: load_format=dummy, empty)
      ├─ every rank: the reshard plan's weight push (EngineSync.push), so the new engine
      │  holds the actor's current weights before it serves
      └─ replicas.generate runs the call again: same chunks, same seeds, same samples
```

A fresh engine holds all its memory, which is what generation needs: the colocated GPUs stay
in the ``generate`` mode they were in. The budget counts the restarts of this process (a
resumed run starts with the whole budget again).
"""

from __future__ import annotations

import logging

from hybridflow.runtime.replicas import ReplicaFailed, engine_nodes
from hybridflow.runtime.session import Session, start_engine

__all__ = ["EngineRestarts", "check_restart"]

logger = logging.getLogger(__name__)

METRIC = "rollout/engine_restarts"
"""Restarts in the step (a step metric) and over the run (the summary's ``engine_restarts``)."""


def check_restart(cfg, lost: list[tuple[int, int, str]], used: int) -> None:
    """ReplicaFailed (one line) unless the engines ``lost`` ([(driver rank, replica, cause)]) can
    be restarted after ``used`` restarts so far."""
    rank, replica, cause = lost[0]
    where = f"rollout replica {replica} (driven by rank {rank}) lost its engine: {cause}"
    limit = cfg.rollout.max_engine_restarts
    if cfg.rollout.placement == "separate":
        raise ReplicaFailed(f"{where}; engine restarts are not supported with rollout.placement=separate yet: "
                            "rerun the same command to resume from the newest checkpoint")
    if engine_nodes(cfg) > 1:
        raise ReplicaFailed(f"{where}; engine restarts are not supported for engines spanning nodes yet: "
                            "rerun the same command to resume from the newest checkpoint")
    if used + len(lost) > limit:
        raise ReplicaFailed(f"{where}; {used} of rollout.max_engine_restarts={limit} restarts used: "
                            "raise rollout.max_engine_restarts to survive more engine failures")


class EngineRestarts:
    """One rank's part in replacing lost engines (every rank of the run holds one)."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.used = 0
        """Restarts so far in this process."""

    def restart(self, lost: list[tuple[int, int, str]]):
        """Replace the engines of ``lost`` ([(driver rank, replica, cause)]) and push them the
        current weights (collective); returns this rank's engine, new or not."""
        s = self.s
        check_restart(s.cfg, lost, self.used)
        self.used += len(lost)
        s.step_metrics[METRIC] = s.step_metrics.get(METRIC, 0.0) + len(lost)
        if s.engine is not None and s.replica in {replica for _, replica, _ in lost}:
            cause = next(c for _, replica, c in lost if replica == s.replica)
            logger.warning("rollout replica %d lost its engine (%s): restarting it (restart %d of %d)", s.replica,
                           cause, self.used, s.cfg.rollout.max_engine_restarts)
            s.engine.shutdown()  # kills and reaps whatever of it is left
            s.engine = start_engine(s.cfg, s.model_dir)
            s.sync.engine = s.engine
        s.sync.push(counted=False)  # the weights the failed call generated with
        return s.engine
