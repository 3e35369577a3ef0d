"""Start ``hybridflow train`` under torchrun on this machine.

    hybridflow train CONFIG [k=v ...]
      └─ python -m torch.distributed.run --standalone --nproc-per-node N
             -m hybridflow.runtime.worker CONFIG [k=v ...]      (N = the actor layout's ranks)

One process per rank of the actor's layout; rank 0 also drives the rollout engine, whose own
scheduler processes SGLang starts. On a machine without a GPU every rank runs one OpenMP thread
(several ranks share few cores; more threads only oversubscribe them) and uses gloo.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence

from hybridflow.config import HybridflowConfig
from launch.reaper import run_reaped

__all__ = ["launch_train", "preflight", "train_command"]

logger = logging.getLogger(__name__)


def train_command(cfg: HybridflowConfig, config_path: str, overrides: Sequence[str]) -> list[str]:
    """The torchrun command line of a single-node run."""
    nproc = cfg.actor.parallel.world_size
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "hybridflow.runtime.worker", config_path, *overrides]


def check_runtime_support(cfg: HybridflowConfig) -> None:
    """What ``hybridflow plan`` accepts but this version's runtime does not run (yet)."""
    if cfg.reference.enabled and cfg.reference.parallel != cfg.actor.parallel:
        raise ValueError("reference.parallel differs from actor.parallel: the runtime builds the reference on the "
                         "actor's ranks under the actor's layout; set reference.parallel=${actor.parallel}")
    if cfg.critic.enabled and cfg.critic.parallel != cfg.actor.parallel:
        raise ValueError("critic.parallel differs from actor.parallel: the runtime builds the critic on the "
                         "actor's ranks under the actor's layout; set critic.parallel=${actor.parallel}")
    if cfg.rollout.num_replicas != 1 and cfg.rollout.sync_route == "full":
        raise ValueError(f"rollout.num_replicas={cfg.rollout.num_replicas} with rollout.sync_route=full: the full "
                         "route gathers whole tensors on one driver in this version; set rollout.sync_route=sliced "
                         "(SGLang) or rollout.num_replicas=1")
    tp, per_node = cfg.rollout.tp, cfg.rollout.gpus_per_node
    if tp > per_node and tp % per_node:
        raise ValueError(f"rollout.tp={tp} does not fill whole nodes of rollout.gpus_per_node={per_node}: an engine "
                         f"spanning nodes takes all GPUs of each; set rollout.tp to a multiple of {per_node}")
    if cfg.rollout.placement != "colocated":
        raise ValueError("rollout.placement=separate: the runtime drives colocated engines only in this version; "
                         "set rollout.placement=colocated")


def check_node_gpus(cfg: HybridflowConfig, available: int) -> None:
    """``hybridflow train`` starts one rank per GPU of this node: the layout must fit them."""
    world = cfg.actor.parallel.world_size
    if world > available:
        raise ValueError(f"actor.parallel needs {world} GPUs ({cfg.actor.parallel.describe()}) but this node has "
                         f"{available}: lower actor.parallel.dp (or tp / pp / ep), or run on more nodes with "
                         "hybridflow launch or hybridflow slurm")


def preflight(cfg: HybridflowConfig, *, command: str = "train") -> None:
    """What can be checked in this process before any rank starts: the algorithm's graph
    against the enabled roles and placement, and ``run.resume`` against the run directory."""
    from hybridflow.lowering import lower
    from hybridflow.runtime.state import resume_point

    lower(cfg, with_reshard=False)  # graph, roles, placement: every check that needs no process
    check_runtime_support(cfg)
    if command != "slurm":  # this machine runs the ranks (a Slurm login node may have no GPU)
        import torch

        from moe.routes import check_replay_device

        check_replay_device(cfg.moe.routing_replay, on_gpu=torch.cuda.is_available())
    if command == "train" and torch.cuda.is_available():
        check_node_gpus(cfg, torch.cuda.device_count())
    resume_from = resume_point(cfg.run.output_dir, cfg.run.resume)
    if resume_from is not None:
        sys.stdout.write(f"hybridflow {command}: resuming from {resume_from}\n")


def launch_train(cfg: HybridflowConfig, config_path: str, overrides: Sequence[str]) -> int:
    """Run the job to completion after ``preflight``; returns torchrun's exit status."""
    preflight(cfg)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = train_command(cfg, config_path, overrides)
    sys.stdout.write(f"hybridflow train: {cfg.actor.parallel.world_size} process(es) "
                     f"({cfg.actor.parallel.describe()}), rollout {cfg.rollout.describe()}\n")
    sys.stdout.flush()
    return run_reaped(cmd, env)
