"""``<run.output_dir>/progress.json``: where the run is, for programs that watch it.

The driver rank rewrites it (atomically) when the RL loop starts and after every RL step:
``{"phase": "rl", "done": 3, "total": 10, "pid": 4242, "restart": 0, "time": 1733367600.0}``:
steps done of the run's total, the driver's process id and torchrun's restart count (a new start
of the workers writes a new pid), and the wall-clock time of the write. A dashboard, a Slurm
epilogue or the fault-injection harness (``hybridflow.faults``) reads this instead of the
terminal's progress bar.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hfschema.files import write_atomic

__all__ = ["PROGRESS_FILE", "read_progress", "write_progress"]

PROGRESS_FILE = "progress.json"


def write_progress(out_dir: str | os.PathLike, *, phase: str, done: int, total: int) -> None:
    """Record ``done`` of ``total`` steps of ``phase`` (the driver rank only)."""
    write_atomic(
        Path(out_dir) / PROGRESS_FILE,
        json.dumps(
            {
                "phase": phase,
                "done": done,
                "total": total,
                "pid": os.getpid(),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "time": time.time(),
            }
        ),
    )


def read_progress(out_dir: str | os.PathLike) -> dict | None:
    """The run's last recorded progress, None before the first (or if unreadable)."""
    try:
        return json.loads((Path(out_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
