"""The actor -> rollout weight sync of a run, planned from its config (shapes only).

    cfg.model + cfg.actor.parallel  --> SOURCE_LAYOUTS[actor.backend]  (who holds what)  --+
    cfg.model + cfg.rollout         --> sglang_layout()    (who needs what)  --+--> plan_reshard()
    cfg.rollout.placement           --> Topology (device of every rank)      --+        |
                                                       plan_stats(), when asked <--+

Nothing here allocates a weight: a 671B model's sync is planned from shapes on one core
(``benchmarks/reshard_plan.py`` times it); the runtime's ranks build the plan, and only
``hybridflow plan`` and the benchmarks compute its statistics. An hf rollout replica loads
every tensor whole, which is what an SGLang tp=1 engine needs, so it is planned as one.

``route="full"`` plans the baseline push instead: every tensor whole, under its Hugging Face
name, on the process driving the engine (``reshard.hf.hf_layout``).
"""

import dataclasses
import functools
import logging
import time

from hybridflow.config import HybridflowConfig
from reshard.fsdp import fsdp_layout
from reshard.hf import hf_layout
from reshard.layouts import TensorLayout
from reshard.megatron import megatron_layout
from reshard.planner import Plan, plan_reshard
from reshard.sglang import sglang_layout
from reshard.stats import Bandwidth, PlanStats, plan_stats
from reshard.topology import Topology
from reshard.vllm import vllm_layout

__all__ = [
    "DESTINATION_LAYOUTS",
    "SOURCE_LAYOUTS",
    "WeightSyncPlan",
    "describe_weight_sync",
    "plan_weight_sync",
    "weight_sync_topology",
]

SOURCE_LAYOUTS = {"megatron": megatron_layout, "fsdp2": fsdp_layout}
"""Where each trainer backend (``actor.backend``) holds the actor's weights: the sync's source."""

DESTINATION_LAYOUTS = {
    "sglang": lambda cfg, dtype: sglang_layout(cfg.model, cfg.rollout.parallel_split(), dtype=dtype),
    "vllm": lambda cfg, dtype: vllm_layout(cfg.model, cfg.rollout.parallel_split(), dtype=dtype),
}
"""Where each engine that takes sliced pushes (``hfschema.engines``) holds the weights on its
ranks: the sliced route's destination (the full route's is ``reshard.hf.hf_layout``, any engine)."""

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WeightSyncPlan:
    """A run's weight sync: both layouts, the plan between them and (on demand) its stats."""

    source: TensorLayout
    destination: TensorLayout
    plan: Plan
    bandwidth: Bandwidth

    @functools.cached_property
    def stats(self) -> PlanStats:
        """Bytes, bounds and simulated time (``hybridflow plan``, the benchmarks). Computed when
        asked, not at start: the runtime's ranks never read them (for DeepSeek-V3 on 1,024 GPUs
        they cost 3.5-3.7 CPU s beside the plan's 2.9-3.4)."""
        return plan_stats(self.plan, bandwidth=self.bandwidth)


def weight_sync_topology(cfg: HybridflowConfig, *, num_destination: int | None = None) -> Topology:
    """Devices of the actor's ranks and the rollout engines' ranks under ``rollout.placement``
    (``num_destination`` overrides the engine rank count: 1 for the full route's driver)."""
    rollout = cfg.rollout
    num_source = cfg.actor.parallel.world_size
    num_destination = rollout.num_ranks if num_destination is None else num_destination
    if rollout.placement == "colocated":
        # engine rank i shares actor GPU i; the config checked that the engines fit
        return Topology.colocated(num_source, gpus_per_node=rollout.gpus_per_node, num_destination=num_destination)
    return Topology.separate(num_source, num_destination, gpus_per_node=rollout.gpus_per_node)


def plan_weight_sync(cfg: HybridflowConfig, *, route: str | None = None) -> WeightSyncPlan:
    """The reshard plan moving the actor's weights into the rollout engines (``sliced``: each
    engine rank its share; ``full``: whole HF tensors on the driver; default
    ``rollout.sync_route``), and its stats."""
    route = cfg.rollout.sync_route if route is None else route
    dtype = cfg.rollout.dtype  # the actor casts to the wire dtype before sending
    source = SOURCE_LAYOUTS[cfg.actor.backend](cfg.model, cfg.actor.parallel, dtype=dtype)
    if route == "sliced":
        destination = DESTINATION_LAYOUTS[cfg.rollout.engine](cfg, dtype)
    elif route == "full":
        destination = hf_layout(cfg.model, dtype=dtype, copies=cfg.rollout.num_replicas)
    else:
        raise ValueError(f"weight sync route={route!r}: choose sliced or full")
    plan = plan_reshard(source, destination, weight_sync_topology(cfg, num_destination=destination.num_ranks))
    return WeightSyncPlan(source=source, destination=destination, plan=plan, bandwidth=cfg.rollout.bandwidth())


def describe_weight_sync(cfg: HybridflowConfig) -> list[str]:
    """A few lines for ``hybridflow plan``: planning time, then ``PlanStats.describe()``."""
    start = time.perf_counter()
    stats = plan_weight_sync(cfg).stats
    seconds = time.perf_counter() - start
    logger.debug("planned the actor -> rollout weight sync in %.3f s", seconds)
    bandwidth = cfg.rollout.bandwidth()
    header = (
        f"weight sync actor -> rollout, planned from shapes in {seconds:.2f} s (time at "
        f"{bandwidth.intra_node_gbps:g} GB/s intra-, {bandwidth.inter_node_gbps:g} GB/s "
        f"inter-node per rank):"
    )
    return [header, *stats.describe().splitlines()]
