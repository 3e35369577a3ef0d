"""Actor -> rollout weight sync at run time: the reshard plan executed on live parameters.

```
every actor rank                                   process of engine rank r (colocated: r)
  global_named_parameters(actor)  ──execute(plan)──►  buffers shaped as SGLang rank r's tensors
                                                       │ (only the plan's share of rank r)
                                         gather to the process driving the engine
                                                       ▼
                                   engine.push_weights([rank 0 tensors, rank 1 tensors, ...])
```

The plan is ``hybridflow.weight_sync.plan_weight_sync(cfg)`` — the same one ``hybridflow plan``
prints — computed once from shapes. On a GPU each engine rank's buffer stays on its own device
and travels as an IPC handle; SGLang's CPU engine has no such handles, so on CPU the buffers are
gathered to the driving process (rank 0) and handed to the engine from there. That hop costs a
copy, not correctness: what each engine rank receives is still only its own share.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from hybridflow.config import HybridflowConfig
from hybridflow.weight_sync import plan_weight_sync
from reshard.executor import WIRE_DTYPES, ProcessMap, execute
from reshard.megatron import megatron_layout
from reshard.sglang import sglang_layout

__all__ = ["EngineSync"]

logger = logging.getLogger(__name__)

DRIVER = 0
"""The process that drives the rollout engine."""


class EngineSync:
    """Moves one actor's weights into the engine; every actor rank calls ``push`` together."""

    def __init__(self, cfg: HybridflowConfig, *, source_params, engine=None) -> None:
        if cfg.rollout.num_replicas != 1:
            raise ValueError(f"rollout.num_replicas={cfg.rollout.num_replicas}: the runtime drives one engine "
                             "replica per run in this version; set rollout.num_replicas=1")
        self.plan, self.stats = plan_weight_sync(cfg)
        dtype = cfg.rollout.dtype
        self.destination = sglang_layout(cfg.model, cfg.rollout.sglang_settings(), dtype=dtype)
        self.source = megatron_layout(cfg.model, cfg.actor.parallel, dtype=dtype)
        world = cfg.actor.parallel.world_size
        ranks = cfg.rollout.num_ranks
        # colocated: engine rank r shares actor rank r's device (the config checked ranks <= world)
        self.processes = ProcessMap(source=tuple(range(world)), destination=tuple(range(ranks)))
        self.dtype = WIRE_DTYPES[dtype]
        self.source_params = source_params
        self.engine = engine
        self.pushes = 0

    def _buffers(self, me: int) -> dict[str, torch.Tensor]:
        if me >= len(self.processes.destination):
            return {}
        return {name: torch.zeros(shape, dtype=self.dtype) for name, shape in self.destination.param_shapes(me).items()}

    def push(self) -> dict[str, float]:
        """Execute the plan, hand every engine rank its tensors, flush the engine's cache."""
        started = time.perf_counter()
        me = dist.get_rank()
        buffers = self._buffers(me)
        report = execute(self.plan, self.processes, sources=self.source_params(), destinations=buffers)
        moved = torch.tensor([float(report.bytes_received + report.bytes_copied_locally)])
        dist.all_reduce(moved)
        gathered = [None] * dist.get_world_size() if me == DRIVER else None
        dist.gather_object(buffers, gathered, dst=DRIVER)
        pushed = 0.0
        if me == DRIVER:
            per_rank = gathered[: self.destination_ranks]
            result = self.engine.push_weights(per_rank, route="sliced")
            self.engine.flush_cache()
            pushed = float(sum(result.bytes_per_rank))
        self.pushes += 1
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/plan_bytes": float(moved.item()), "sync/engine_bytes": pushed}

    @property
    def destination_ranks(self) -> int:
        """Engine ranks receiving weights."""
        return len(self.processes.destination)
