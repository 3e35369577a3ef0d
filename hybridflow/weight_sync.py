"""The actor -> rollout weight sync of a run, planned from its config (shapes only).

    cfg.model + cfg.actor.parallel  --> megatron_layout()  (who holds what)  --+
    cfg.model + cfg.rollout         --> sglang_layout()    (who needs what)  --+--> plan_reshard()
    cfg.rollout.placement           --> Topology (device of every rank)      --+        |
                                                                        plan_stats() <--+

Nothing here allocates a weight, so ``hybridflow plan`` reports the sync of a 671B model in
about a second on one core. An hf rollout replica loads every tensor whole, which is what an
SGLang tp=1 engine needs, so it is planned as one.
"""

import logging
import time

from hybridflow.config import HybridflowConfig
from reshard.megatron import megatron_layout
from reshard.planner import Plan, plan_reshard
from reshard.sglang import sglang_layout
from reshard.stats import Bandwidth, PlanStats, plan_stats
from reshard.topology import Topology

__all__ = ["describe_weight_sync", "plan_weight_sync", "weight_sync_topology"]

logger = logging.getLogger(__name__)


def weight_sync_topology(cfg: HybridflowConfig) -> Topology:
    """Devices of the actor's ranks and the rollout engines' ranks under ``rollout.placement``."""
    rollout = cfg.rollout
    num_source = cfg.actor.parallel.world_size
    if rollout.placement == "colocated":
        # engine rank i shares actor GPU i; the config checked that the engines fit
        return Topology.colocated(num_source, gpus_per_node=rollout.gpus_per_node,
                                  num_destination=rollout.num_ranks)
    return Topology.separate(num_source, rollout.num_ranks, gpus_per_node=rollout.gpus_per_node)


def plan_weight_sync(cfg: HybridflowConfig, *,
                     bandwidth: Bandwidth = Bandwidth()) -> tuple[Plan, PlanStats]:
    """The reshard plan moving the actor's weights into the rollout engines, and its stats."""
    dtype = cfg.rollout.dtype  # the actor casts to the wire dtype before sending
    source = megatron_layout(cfg.model, cfg.actor.parallel, dtype=dtype)
    destination = sglang_layout(cfg.model, cfg.rollout.sglang_settings(), dtype=dtype)
    plan = plan_reshard(source, destination, weight_sync_topology(cfg))
    return plan, plan_stats(plan, bandwidth=bandwidth)


def describe_weight_sync(cfg: HybridflowConfig, *,
                         bandwidth: Bandwidth = Bandwidth()) -> list[str]:
    """A few lines for ``hybridflow plan``: planning time, then ``PlanStats.describe()``."""
    start = time.perf_counter()
    _, stats = plan_weight_sync(cfg, bandwidth=bandwidth)
    seconds = time.perf_counter() - start
    logger.debug("planned the actor -> rollout weight sync in %.3f s", seconds)
    header = (
        f"weight sync actor -> rollout, planned from shapes in {seconds:.2f} s (time at "
        f"{bandwidth.intra_node_gbps:g} GB/s intra-, {bandwidth.inter_node_gbps:g} GB/s "
        f"inter-node per rank):"
    )
    return [header, *stats.describe().splitlines()]
