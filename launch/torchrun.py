"""Start ``hybridflow train`` under torchrun on this machine.

    hybridflow train CONFIG [k=v ...]
      │  checks first, in the calling process (hybridflow.preflight)
      └─ python -m torch.distributed.run --standalone --nproc-per-node N
             -m hybridflow.runtime.worker CONFIG [k=v ...]      (N = the actor layout's ranks)

One process per rank of the actor's layout; rank 0 also drives the rollout engine, whose own
scheduler processes SGLang starts. On a machine without a GPU every rank runs one OpenMP thread
(several ranks share few cores; more threads only oversubscribe them) and uses gloo.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from hfschema.layout import ParallelLayout
from launch.reaper import run_reaped

__all__ = ["launch_train", "train_command"]

logger = logging.getLogger(__name__)


def train_command(nproc: int, config_path: str, overrides: Sequence[str]) -> list[str]:
    """The torchrun command line of a single-node run of ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "hybridflow.runtime.worker", config_path, *overrides]


def launch_train(layout: ParallelLayout, config_path: str, overrides: Sequence[str], *, rollout: str) -> int:
    """Run the job to completion, one rank per rank of the actor's ``layout``, after the caller's
    checks (``hybridflow.preflight``); ``rollout`` describes the engines in the start line.
    Returns torchrun's exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = train_command(layout.world_size, config_path, overrides)
    sys.stdout.write(f"hybridflow train: {layout.world_size} process(es) ({layout.describe()}), rollout {rollout}\n")
    sys.stdout.flush()
    return run_reaped(cmd, env)
