"""``hybridflow slurm --submit`` against a real Slurm: a one-node cluster on this machine.

``scripts/slurm_single_node.sh start`` brings up munged, slurmctld and slurmd (root, no cgroups;
Debian's slurm-wlm and munge). The short CPU quickstart is submitted and must end COMPLETED in
``sacct``; a second submission is requeued (``scontrol requeue``) once its first RL checkpoint
exists, and must resume from that checkpoint in the same run directory and end with the first
job's metrics, its launcher having taken the run lock over from the killed one. Skipped only
where Slurm is not installed (``sbatch`` not on PATH), and there not under
``HYBRIDFLOW_REQUIRE_SLURM=1`` (``.ci/run`` sets it): then the skip is an error
(``tests/conftest.py``).
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

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")
SHORT = [
    "run.steps=4",
    "sft.steps=4",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=3",
    "run.heldout_prompts=16",
    "run.prompts_per_step=8",
    "rollout.n=4",
]
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


@pytest.fixture(scope="module")
def completed_run(slurm_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slurm") / "completed"
    job = _submit(slurm_env, out)
    log = out / "logs" / f"slurm-{job}.out"
    state = _wait_until_gone(slurm_env, job, log)
    assert state == "COMPLETED", f"sacct says {state}; log tail:\n{_tail(log)}"
    return out


@pytest.mark.claim("slurm-requeue-resumes")
def test_submitted_quickstart_completes(completed_run: Path):
    script = (completed_run / "hybridflow.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "--gpus" not in script
    assert (completed_run / "summary.json").is_file()
    (log,) = (completed_run / "logs").glob("slurm-*.out")
    text = log.read_text(errors="replace")
    assert "hybridflow: job" in text and "requeued 0 times" in text
    assert "hybridflow train: quickstart_cpu" in text  # the run's summary screen


@pytest.mark.claim("slurm-requeue-resumes", "one-run-per-directory")
def test_requeued_job_resumes_from_its_checkpoint(slurm_env, completed_run: Path, tmp_path: Path):
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
    assert "requeued 1 times" in text
    assert f"hybridflow launch: resuming from {checkpoint}" in text, text[-4000:]
    assert final_metrics(out) == final_metrics(completed_run)
    # the requeued job's launcher took the lock over from the killed one, and let it go at the end
    assert json.loads((out / LOCK_FILE).read_text())["pid"] != holder["pid"]
    with hold_run_directory(out):
        pass
