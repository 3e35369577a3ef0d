"""``hybridflow train`` of the quickstart's config with overrides, as a user types it (the runs of
the frozen-model tests: reward model, judge, distillation)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"


def train_quickstart(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The run into ``out``; the repository is on the path (a reward function of tests/)."""
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(QUICKSTART), f"run.output_dir={out}", *overrides],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done
