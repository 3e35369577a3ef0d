"""Actor -> rollout weight sync at run time: a reshard plan executed on live parameters.

``rollout.sync_route=sliced`` (the default) moves each engine rank only its own share:

```
every actor rank                                   actor process r (colocated with engine rank r)
  global_named_parameters(actor)  ──execute(plan)──►  buffers shaped as SGLang rank r's tensors
                                                       │ handles.prepare_rank_payload: pad, cast,
                                                       │ share (CUDA-IPC handle / shared memory)
                                 gather the handles (bytes) to every replica's driver
                                                       ▼
             replica k's driver: engine.push_rank_payloads([payload k*tp, ..., payload k*tp+tp-1])
                                   scheduler r maps rank r's tensors from process r and copies
                                   (process r holds its buffers until then: barrier)
```

Every replica receives every push (``sync/replica{k}/engine_bytes``).

``rollout.sync_route=full`` is the baseline: the plan gathers every tensor whole under its
Hugging Face name on the driver, and every engine rank receives every tensor and slices it.

The plans come from ``hybridflow.weight_sync``, the same ones ``hybridflow plan`` prints,
computed once from shapes. The weights themselves cross processes once, in the reshard; what
the driver gathers for a sliced push is a few hundred bytes per tensor.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from hybridflow.config import HybridflowConfig
from hybridflow.runtime.replicas import driver_rank, replica_of
from hybridflow.weight_sync import WeightSyncPlan, plan_weight_sync
from reshard.executor import WIRE_DTYPES, ProcessMap, execute

__all__ = ["EngineSync"]

logger = logging.getLogger(__name__)

DRIVER = 0
"""The process that drives the rollout engine."""


class EngineSync:
    """Moves one actor's weights into the engine; every actor rank calls ``push`` together.

    Construct it on every rank together (it gathers the engines' parameter tables from their
    drivers); ``engine`` is this rank's replica's engine on a replica driver, None elsewhere.
    """

    def __init__(self, cfg: HybridflowConfig, *, source_params, engine=None) -> None:
        self.cfg = cfg
        self.route = cfg.rollout.sync_route
        self.sync: WeightSyncPlan = plan_weight_sync(cfg)
        self.plan, self.stats = self.sync.plan, self.sync.stats
        world = cfg.actor.parallel.world_size
        # colocated: destination rank r shares actor rank r's device (the config checked r < world)
        self.processes = ProcessMap(source=tuple(range(world)),
                                    destination=tuple(range(self.sync.destination.num_ranks)))
        self.dtype = WIRE_DTYPES[cfg.rollout.dtype]
        self.source_params = source_params
        self.engine = engine
        self.pushes = 0
        self.engine_params = self._engine_params() if self.route == "sliced" else None
        self.engine_drops_weights = cfg.rollout.placement == "colocated" and torch.cuda.is_available()
        """Whether the engine's weights are released (and lose their values) after every
        generation, so every step must push, even one that left the actor unchanged."""

    def _engine_params(self) -> list[dict]:
        """Every engine rank's parameter table (engine-major: replica k's ranks at k*tp..), read by
        each replica's driver from its running engine and gathered on every rank."""
        mine = (replica_of(self.cfg, dist.get_rank()), self.engine.rank_params()) if self.engine else (None, [])
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        tables = dict(item for item in gathered if item[0] is not None)
        return [table for replica in sorted(tables) for table in tables[replica]]

    def _buffers(self, me: int, device: torch.device) -> dict[str, torch.Tensor]:
        """This process's destination tensors, on the actor's device (on a GPU they are shared
        with the engine as CUDA-IPC handles, so they must live there)."""
        if me >= len(self.processes.destination):
            return {}
        shapes = self.sync.destination.param_shapes(me)
        return {name: torch.zeros(shape, dtype=self.dtype, device=device) for name, shape in shapes.items()}

    def push(self) -> dict[str, float]:
        """Execute the plan, hand the engine its tensors, flush the engine's cache."""
        started = time.perf_counter()
        me = dist.get_rank()
        sources = self.source_params()
        device = next(iter(sources.values())).device
        buffers = self._buffers(me, device)
        report = execute(self.plan, self.processes, sources=sources, destinations=buffers,
                         bucket_bytes=self.cfg.rollout.reshard_bucket_mb << 20)
        moved = torch.tensor([float(report.bytes_received + report.bytes_copied_locally)], device=device)
        dist.all_reduce(moved)
        # the engine's weights are resident: the plan's switch before sync_weights resumed them
        pushed = self._push_sliced(me, buffers) if self.route == "sliced" else self._push_full(me, buffers)
        self.pushes += 1
        per_replica = self._per_replica(pushed)
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/plan_bytes": float(moved.item()),
                "sync/engine_bytes": float(sum(per_replica)),
                **{f"sync/replica{k}/engine_bytes": b for k, b in enumerate(per_replica)}}

    def _per_replica(self, pushed: float) -> list[float]:
        """The bytes each replica's engine received, on every rank."""
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (replica_of(self.cfg, dist.get_rank()) if self.engine else None, pushed))
        out = [0.0] * self.cfg.rollout.num_replicas
        for replica, value in gathered:
            if replica is not None:
                out[replica] = value
        return out

    def _push_sliced(self, me: int, buffers: dict[str, torch.Tensor]) -> float:
        from hybridflow.rollout.sglang.handles import prepare_rank_payload

        tp = self.cfg.rollout.tp
        # payloads carry the engine-local rank: replica k's rank j is global destination k*tp + j
        payload, kept = prepare_rank_payload(me % tp, buffers, self.engine_params[me]) if buffers else (None, [])
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, payload)  # handles: a few hundred bytes per tensor
        pushed = 0.0
        try:
            if self.engine is not None:
                first = driver_rank(self.cfg, replica_of(self.cfg, me))  # the replica's first engine rank
                result = self.engine.push_rank_payloads(gathered[first : first + tp])
                pushed = float(sum(result.bytes_per_rank))
        finally:
            # each engine read its ranks' tensors straight from their owners: hold them until then
            dist.barrier()
        del kept
        return pushed

    def _push_full(self, me: int, buffers: dict[str, torch.Tensor]) -> float:
        if me != DRIVER:  # one replica (check_runtime_support): its driver is rank 0
            return 0.0
        result = self.engine.push_weights(buffers, route="full")
        self.engine.flush_cache()
        return float(sum(result.bytes_per_rank))

    @property
    def destination_ranks(self) -> int:
        """Ranks of the plan's destination (engine ranks for sliced, the driver for full)."""
        return len(self.processes.destination)
