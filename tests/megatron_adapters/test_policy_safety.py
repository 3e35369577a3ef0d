"""A NaN step never reaches the weights; offloading for colocated generation changes nothing; a
rollback to a snapshot undoes updates exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("policy_worker.py")


@pytest.mark.claim("skipped-step-rolled-back")
def test_nan_steps_are_not_applied_and_offloading_is_exact() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        "nan",
        "offload",
        "rollback",
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for name in ("nan", "offload", "rollback"):
        for rank in (0, 1):
            assert f"OK {name} rank {rank}\n" in result.stdout
