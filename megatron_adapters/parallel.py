"""Process groups for a ``ParallelLayout``: torch.distributed + megatron-core parallel state.

``initialize(layout, seed=...)`` joins (or starts) the default process group with gloo on CPU
and NCCL on GPUs, builds megatron-core's TP / PP / CP / EP / ETP / DP groups for the layout, seeds
megatron's RNG tracker and returns the ``ProcessGroupCollection`` that the model builder and
the policy take explicitly. ``teardown()`` undoes the megatron part so another layout can be
initialised in the same process (the tests do this).

``layout_groups(layout)`` builds a second set of groups for another layout over the same ranks
without touching megatron's global state: a frozen model (a reward model, a teacher) with a
layout of its own is built and run with them alone (the model builder and the policy read their
groups from the ``ProcessGroupCollection`` they were given; LoRA and routing replay, the
actor's alone, read megatron's global groups).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from hfschema.layout import ParallelLayout
from hfschema.ranks import backend as backend  # re-exported: the rank's default backend and device
from hfschema.ranks import device as device
from hfschema.ranks import init_default_group

from . import cpu_compat, device_guard

logger = logging.getLogger(__name__)


def initialize(layout: ParallelLayout, *, seed: int, prefix: str = "parallel") -> ProcessGroupCollection:
    """Build megatron-core's groups for ``layout`` and seed its RNG; returns the groups."""
    cpu_compat.apply()
    # after cpu_compat (its mode maps .cuda() away) and before megatron makes its groups
    device_guard.install_from_env()
    init_default_group()
    layout.check_world_size(dist.get_world_size(), prefix=prefix)
    if parallel_state.model_parallel_is_initialized():
        teardown()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # Separate gloo groups only matter beside NCCL; on CPU every group is gloo already.
        create_gloo_process_groups=torch.cuda.is_available(),
    )
    # CPU initialisation draws every full weight from the default generator before slicing
    # it, so seeding it makes the initial weights independent of the layout.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    logger.info("rank %d: megatron groups for %s", dist.get_rank(), layout.describe())
    return ProcessGroupCollection.use_mpu_process_groups()


def layout_groups(layout: ParallelLayout, *, prefix: str = "parallel") -> ProcessGroupCollection:
    """The groups of ``layout`` over the default group's ranks, numbered as megatron numbers them
    (order tp-cp-ep-dp-pp, the order the weight loader's rank maps assume). Megatron's global
    groups stay those of ``initialize``. Every rank calls it, in the same order (groups are made
    collectively)."""
    layout.check_world_size(dist.get_world_size(), prefix=prefix)
    order = "tp-cp-ep-dp-pp"
    dense = parallel_state.RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=order)
    expert_dp = dist.get_world_size() // (layout.etp * layout.ep * layout.pp)
    expert = parallel_state.RankGenerator(tp=layout.etp, ep=layout.ep, dp=expert_dp, pp=layout.pp, cp=1, order=order)
    kind = dist.get_backend()

    def group(ranks: list[list[int]]):
        own, _ = dist.new_subgroups_by_enumeration(ranks, backend=kind)
        return own

    pgs = ProcessGroupCollection()
    dense_groups = {"tp": "tp", "cp": "cp", "pp": "pp", "mp": "tp-pp", "tp_cp": "tp-cp", "tp_dp_cp": "tp-dp-cp"}
    for name, token in dense_groups.items():
        setattr(pgs, name, group(dense.get_ranks(token)))
    pgs.dp = group(dense.get_ranks("dp"))
    pgs.dp_cp = pgs.intra_dp_cp = group(dense.get_ranks("dp-cp"))
    stages = dense.get_ranks("pp")
    # tied embeddings: the first and last stage share the word embeddings
    pgs.embd = group([sorted({r[0], r[-1]}) for r in stages])
    pgs.pos_embd = group([[r[0]] for r in stages])
    for name, token in (("ep", "ep"), ("expt_tp", "tp"), ("tp_ep", "tp-ep"), ("tp_ep_pp", "tp-ep-pp")):
        setattr(pgs, name, group(expert.get_ranks(token)))
    pgs.expt_dp = pgs.intra_expt_dp = group(expert.get_ranks("dp"))
    return pgs


def data_coords() -> tuple[int, int, bool]:
    """(data-parallel rank, data-parallel size, whether this rank is the first of its
    model-parallel group, the ranks that hold the same rows)."""
    return (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_model_parallel_group().rank() == 0,
    )


def teardown() -> None:
    """Destroy megatron's model-parallel groups (the default group stays)."""
    parallel_state.destroy_model_parallel()
