"""Actor -> rollout weight sync at run time: a reshard plan executed on live parameters.

``rollout.sync_route=sliced`` (the default) moves each engine rank only its own share:

```
every actor rank                                   actor process r (colocated with engine rank r)
  global_named_parameters(actor)  ──execute(plan)──►  buffers shaped as SGLang rank r's tensors
                                                       │ handles.prepare_rank_payload: pad, cast,
                                                       │ share (CUDA-IPC handle / shared memory)
                                         gather the handles (bytes) to the driver (rank 0)
                                                       ▼
                                   engine.push_rank_payloads([payload 0, payload 1, ...])
                                   scheduler r maps rank r's tensors from process r and copies
                                   (process r holds its buffers until then: barrier)
```

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
from hybridflow.weight_sync import WeightSyncPlan, plan_weight_sync
from reshard.executor import WIRE_DTYPES, ProcessMap, execute

__all__ = ["EngineSync"]

logger = logging.getLogger(__name__)

DRIVER = 0
"""The process that drives the rollout engine."""


class EngineSync:
    """Moves one actor's weights into the engine; every actor rank calls ``push`` together.

    Construct it on every rank together (it broadcasts the engine's parameter table from the
    driver); ``engine`` is the engine handle on the driver and None elsewhere.
    """

    def __init__(self, cfg: HybridflowConfig, *, source_params, engine=None) -> None:
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
        """Every engine rank's parameter table, read on the driver and broadcast to all ranks."""
        table = [self.engine.rank_params() if dist.get_rank() == DRIVER else None]
        dist.broadcast_object_list(table, src=DRIVER)
        return table[0]

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
        report = execute(self.plan, self.processes, sources=sources, destinations=buffers)
        moved = torch.tensor([float(report.bytes_received + report.bytes_copied_locally)], device=device)
        dist.all_reduce(moved)
        if me == DRIVER:  # colocated on a GPU the engine released its weights after generating
            self.engine.resume_memory(("weights",))
        pushed = self._push_sliced(me, buffers) if self.route == "sliced" else self._push_full(me, buffers)
        self.pushes += 1
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/plan_bytes": float(moved.item()), "sync/engine_bytes": pushed}

    def _push_sliced(self, me: int, buffers: dict[str, torch.Tensor]) -> float:
        from hybridflow.rollout.sglang.handles import prepare_rank_payload

        payload, kept = prepare_rank_payload(me, buffers, self.engine_params[me]) if buffers else (None, [])
        gathered = [None] * dist.get_world_size() if me == DRIVER else None
        dist.gather_object(payload, gathered, dst=DRIVER)
        pushed = 0.0
        try:
            if me == DRIVER:
                result = self.engine.push_rank_payloads(gathered[: self.destination_ranks])
                pushed = float(sum(result.bytes_per_rank))
        finally:
            # the engine read every rank's tensors straight from its owner: hold them until then
            dist.barrier()
        del kept
        return pushed

    def _push_full(self, me: int, buffers: dict[str, torch.Tensor]) -> float:
        if me != DRIVER:
            return 0.0
        result = self.engine.push_weights(buffers, route="full")
        self.engine.flush_cache()
        return float(sum(result.bytes_per_rank))

    @property
    def destination_ranks(self) -> int:
        """Ranks of the plan's destination (engine ranks for sliced, the driver for full)."""
        return len(self.processes.destination)
