"""Process groups for a ``ParallelLayout``: torch.distributed + megatron-core parallel state.

``initialize(layout, seed=...)`` joins (or starts) the default process group with gloo on CPU
and NCCL on GPUs, builds megatron-core's TP / PP / CP / EP / ETP / DP groups for the layout, seeds
megatron's RNG tracker and returns the ``ProcessGroupCollection`` that the model builder and
the policy take explicitly. ``teardown()`` undoes the megatron part so another layout can be
initialised in the same process (the tests do this).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from hybridflow.layout import ParallelLayout

from . import cpu_compat

logger = logging.getLogger(__name__)


def backend() -> str:
    """The torch.distributed backend for this machine."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_default_group(timeout_minutes: int = 10) -> None:
    """Start torch.distributed from torchrun's environment (or as one process without it)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend(), timeout=datetime.timedelta(minutes=timeout_minutes)
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize(layout: ParallelLayout, *, seed: int, prefix: str = "parallel") -> ProcessGroupCollection:
    """Build megatron-core's groups for ``layout`` and seed its RNG; returns the groups."""
    cpu_compat.apply()
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


def teardown() -> None:
    """Destroy megatron's model-parallel groups (the default group stays)."""
    parallel_state.destroy_model_parallel()
