"""What ``hybridflow train | launch | slurm`` check in this process, before any rank starts.

    load_config(CONFIG, overrides)
      └─ preflight(cfg, command=...)
           lower(cfg, with_reshard=False)   the graph against the enabled roles and placement
           check_runtime_support(cfg)       what ``hybridflow plan`` accepts but the runtime does not run yet
           routing replay vs this machine   (not for slurm: a login node may have no GPU)
           check_node_gpus(cfg, ...)        train only: the actor's layout fits this node's GPUs
           run.resume vs the run directory  prints the checkpoint a start resumes from
      └─ launch.torchrun | launch.multinode | launch.slurm, with plain values (the actor's layout,
         the config path and overrides): they start processes and never read the config

Every refusal is a ``ValueError`` naming the key and the fix; the CLI prints it and exits 2.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from hybridflow.config import HybridflowConfig
from hybridflow.lowering import lower
from hybridflow.runtime.state import resume_point

if TYPE_CHECKING:
    from launch.slurm import SlurmJob

__all__ = ["check_node_gpus", "check_runtime_support", "check_slurm_run", "preflight"]


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


def check_slurm_run(cfg: HybridflowConfig, job: SlurmJob) -> None:
    """Check the run as ``hybridflow launch`` would, before ``launch.slurm`` renders its script:
    a requeued job must resume, and the allocation must start exactly the actor's ranks."""
    if cfg.run.resume != "auto":
        raise ValueError(f"run.resume={cfg.run.resume}: a Slurm job must be able to resume after a requeue; "
                         "use run.resume=auto (the default) and a new run.output_dir for a fresh run")
    job.check_layout(cfg.actor.parallel)
    preflight(cfg, command="slurm")
