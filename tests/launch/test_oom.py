"""A rank the kernel's out-of-memory killer ends is named as such, with the memory and the fix.

The job runs in a memory cgroup of its own with a small limit (as Slurm gives each job one), and
one rank allocates past it: the kernel kills it by SIGKILL, which leaves no error record.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from launch import oom

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1536 << 20  # well above torchrun's own agent (torch imported): the greedy rank is the biggest

GREEDY_RANK = """
import os, time
if os.environ["RANK"] == "1":
    hoard = []
    while True:
        hoard.append(bytearray(32 << 20))  # touched: the pages count
else:
    time.sleep(60)
"""

JOB = """
import os, sys
from launch.torchrun import run_job
from launch.torchrun_entry import TORCHRUN
cmd = [sys.executable, "-m", TORCHRUN, "--standalone", "--nproc-per-node=2", sys.argv[1]]
sys.exit(run_job(cmd, dict(os.environ), command="hybridflow train", output_dir=sys.argv[2]))
"""


def _memory_cgroup(limit: int) -> Path:
    """A child of this process's memory cgroup with ``limit`` bytes (v1 or v2)."""
    mine = oom.memory_cgroup()
    assert mine is not None, "no memory cgroup readable on this machine"
    child = mine.path / f"hybridflow-oom-{uuid.uuid4().hex[:8]}"
    child.mkdir()
    (child / ("memory.max" if mine.events == "memory.events" else "memory.limit_in_bytes")).write_text(str(limit))
    return child


@pytest.mark.claim("oom-kill-named")
def test_a_rank_killed_by_the_out_of_memory_killer_is_named_with_its_memory(tmp_path) -> None:
    script, job = tmp_path / "greedy.py", tmp_path / "job.py"
    script.write_text(GREEDY_RANK)
    job.write_text(JOB)
    cgroup = _memory_cgroup(LIMIT)
    enter = f"echo $$ > {cgroup / 'cgroup.procs'} && exec {sys.executable} {job} {script} {tmp_path}"
    try:
        done = subprocess.run(
            ["sh", "-c", enter],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        cgroup.rmdir()
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0
    assert "torchrun: rank 1 (local rank 1" in done.stderr and "was killed by SIGKILL" in done.stderr
    assert last.startswith(
        "hybridflow train: a process of the job was killed by the kernel's out-of-memory killer in the job's "
    )
    assert f"of its {LIMIT / (1 << 30):.1f} GiB limit" in last and "rollout.max_total_tokens" in last
    assert (tmp_path / "error.txt").read_text().strip() == last


def test_counters_are_read_from_either_cgroup_version(tmp_path, monkeypatch) -> None:
    v2 = tmp_path / "job"
    v2.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (v2 / "memory.peak").write_text(str(3 << 30))
    (v2 / "memory.max").write_text("max\n")
    monkeypatch.setattr(oom, "_ROOT", tmp_path)
    found = oom.memory_cgroup("0::/job\n")
    assert found is not None and found.path == v2 and found.oom_kills() == 1 and found.bytes("memory.max") is None
    before = oom.snapshot("0::/job\n")
    assert oom.killed_since(before) is None  # nothing new
    (v2 / "memory.events").write_text("oom_kill 2\n")
    line = oom.killed_since(before)
    assert line.startswith(
        f"a process of the job was killed by the kernel's out-of-memory killer in the job's memory cgroup ({v2}); "
    )
    assert "it peaked at 3.0 GiB:" in line  # no limit to name
