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

__all__ = ["launch_train", "train_command"]

logger = logging.getLogger(__name__)


def train_command(cfg: HybridflowConfig, config_path: str, overrides: Sequence[str]) -> list[str]:
    """The torchrun command line of a single-node run."""
    nproc = cfg.actor.parallel.world_size
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "hybridflow.runtime.worker", config_path, *overrides]


def launch_train(cfg: HybridflowConfig, config_path: str, overrides: Sequence[str]) -> int:
    """Run the job to completion; returns torchrun's exit status.

    What can be checked in this process is, before any rank starts: the algorithm's graph
    against the enabled roles, and ``run.resume`` against the run directory."""
    from hybridflow.algorithms.recipes import build_graph
    from hybridflow.runtime.state import resume_point

    build_graph(cfg)
    resume_from = resume_point(cfg.run.output_dir, cfg.run.resume)
    if resume_from is not None:
        sys.stdout.write(f"hybridflow train: resuming from {resume_from}\n")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = train_command(cfg, config_path, overrides)
    sys.stdout.write(f"hybridflow train: {cfg.actor.parallel.world_size} process(es) "
                     f"({cfg.actor.parallel.describe()}), rollout {cfg.rollout.describe()}\n")
    sys.stdout.flush()
    return subprocess.run(cmd, env=env).returncode
