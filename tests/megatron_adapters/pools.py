"""Starting a torchrun pool of test workers (``task_pool.run_tasks`` on their side)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_pool(worker: Path, nproc: int, tasks: list[dict], workdir: Path, label: str, *, timeout: int) -> None:
    """``worker`` on ``nproc`` ranks over ``tasks`` (written to ``<label>.json``); its output goes
    to ``<label>.log``, whose tail a failure quotes."""
    plan = workdir / f"{label}.json"
    plan.write_text(json.dumps(tasks))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(worker),
        str(plan),
    ]
    log = workdir / f"{label}.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {label} failed ({proc.returncode}); tail of {log}:\n" + log.read_text()[-4000:])
