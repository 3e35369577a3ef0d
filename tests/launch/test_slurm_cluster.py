"""``hybridflow slurm --submit`` against a real Slurm: a one-node cluster on this machine.

``scripts/slurm_single_node.sh start`` brings up munged, slurmctld and slurmd (root, no cgroups;
Debian's slurm-wlm and munge). The short CPU quickstart, as the suite's uninterrupted run
(``full_run``) is configured, is submitted and requeued (``scontrol requeue``, as a preemption
would) once its first RL checkpoint exists; it must resume from that checkpoint in the same run
directory, its launcher taking the run lock over from the killed one, end COMPLETED in
``sacct``, and end with the uninterrupted run's metrics. Skipped only where Slurm is not installed
(``sbatch`` not on PATH), and there not under ``HYBRIDFLOW_REQUIRE_SLURM=1`` (``.ci/run`` sets
it): then the skip is an error (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.faults import final_metrics
from launch.run_lock import LOCK_FILE, hold_run_directory
from tests.test_train import FULL_RUN, SHORT

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")
JOB_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(
        shutil.which("sbatch") is None,
        reason="Slurm is not installed (no sbatch on PATH); apt-get install -y slurm-wlm munge",
    ),
]


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_single_node.sh"), "start"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"the one-node Slurm cluster did not start:\n{done.stdout}\n{done.stderr}"
    conf = re.search(r"^SLURM_CONF=(\S+)$", done.stdout, flags=re.M).group(1)
    return {**os.environ, "SLURM_CONF": conf}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _submit(env: dict[str, str], out: Path) -> str:
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "slurm",
        CONFIG,
        *SHORT,
        *FULL_RUN,
        f"run.output_dir={out}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--rdzv-port",
        str(_free_port()),
        "--submit",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return re.search(r"^# submitted batch job (\d+);", done.stdout, flags=re.M).group(1)


def _slurm(env: dict[str, str], *args: str) -> str:
    return subprocess.run(args, env=env, capture_output=True, text=True, check=True, timeout=60).stdout


def _wait_until_gone(env: dict[str, str], job: str, log: Path) -> str:
    """Wait for the job to leave the queue; returns its last state in sacct (job completion records)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while _slurm(env, "squeue", "-h", "-j", job).strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still queued after {JOB_TIMEOUT_S} s; log tail:\n{_tail(log)}")
        time.sleep(2)
    states = _slurm(env, "sacct", "--completion", "-j", job, "-n", "-P", "-o", "jobid,state").split()
    return states[-1].split("|")[1] if states else "(no record)"


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.is_file() else f"({log} missing)"


@pytest.mark.claim("slurm-requeue-resumes", "one-run-per-directory")
def test_a_submitted_quickstart_requeued_mid_run_resumes_and_completes(slurm_env, full_run: Path, tmp_path: Path):
    out = tmp_path / "requeued"
    job = _submit(slurm_env, out)
    log = out / "logs" / f"slurm-{job}.out"
    checkpoint = out / "checkpoints" / "step_000002"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not checkpoint.is_dir():
        assert time.monotonic() < deadline and _slurm(slurm_env, "squeue", "-h", "-j", job).strip(), _tail(log)
        time.sleep(0.2)
    holder = json.loads((out / LOCK_FILE).read_text())  # the first start's launcher holds the run lock
    _slurm(slurm_env, "scontrol", "requeue", job)  # as a preemption or node failure would
    # Slurm holds a requeued job back (BeginTime) for a while; let it start again at once
    deadline = time.monotonic() + 120
    while "PENDING" not in _slurm(slurm_env, "squeue", "-h", "-j", job, "-o", "%T"):
        assert time.monotonic() < deadline, _tail(log)
        time.sleep(0.5)
    _slurm(slurm_env, "scontrol", "update", f"JobId={job}", "StartTime=now")
    state = _wait_until_gone(slurm_env, job, log)
    text = _tail(log) if state != "COMPLETED" else log.read_text(errors="replace")
    assert state == "COMPLETED", f"sacct says {state}; log tail:\n{text}"
    script = (out / "hybridflow.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "--gpus" not in script
    assert "hybridflow: job" in text and "requeued 1 times" in text
    assert f"hybridflow launch: resuming from {checkpoint}" in text, text[-4000:]
    assert "hybridflow train: quickstart_cpu" in text  # the run's summary screen
    assert (out / "summary.json").is_file()
    assert final_metrics(out) == final_metrics(full_run)
    # the requeued job's launcher took the lock over from the killed one, and let it go at the end
    assert json.loads((out / LOCK_FILE).read_text())["pid"] != holder["pid"]
    with hold_run_directory(out):
        pass
