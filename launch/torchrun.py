"""Start ``hybridflow train`` under torchrun on this machine.

    hybridflow train CONFIG [k=v ...]
      │  checks first, in the calling process (hybridflow.preflight)
      └─ python -m torch.distributed.run --standalone --nproc-per-node N
             -m hybridflow.runtime.worker CONFIG [k=v ...]      (N = the actor layout's ranks [+ engine ranks])

One process per rank of the actor's layout (colocated: the replica drivers among them drive the
engines, whose own scheduler processes SGLang starts), and with rollout.placement=separate one
more per engine rank (rollout.tp x num_replicas), numbered after the actor's. On a machine without a GPU every rank runs one OpenMP thread
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


def launch_train(layout: ParallelLayout, config_path: str, overrides: Sequence[str], *, rollout: str,
                 engine_ranks: int = 0) -> int:
    """Run the job to completion, one rank per rank of the actor's ``layout`` and ``engine_ranks``
    more (separate placement: the engines' own ranks, after the actor's), after the caller's
    checks (``hybridflow.preflight``); ``rollout`` describes the engines in the start line.
    Returns torchrun's exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    nproc = layout.world_size + engine_ranks
    cmd = train_command(nproc, config_path, overrides)
    engines = f" + {engine_ranks} engine rank(s)" if engine_ranks else ""
    sys.stdout.write(f"hybridflow train: {nproc} process(es) ({layout.describe()}{engines}), rollout {rollout}\n")
    sys.stdout.flush()
    return run_reaped(cmd, env)
