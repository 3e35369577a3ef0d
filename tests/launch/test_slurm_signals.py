"""The rendered sbatch script under signals, run by bash on this machine with stand-ins for
``srun`` (runs the task here) and ``scontrol`` (names this host, records a requeue).

USR1, which Slurm sends the batch shell ``--signal-lead-s`` before the time limit: the ranks
checkpoint at the end of their step and stop, then the script requeues the job. SIGTERM (as
``scancel`` sends it): every process of the job gone within the bound, exit 143.
"""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.faults import check_checkpoints
from hybridflow.runtime.state import checkpoint_dirs
from launch.reaper import REQUEST_FILE
from launch.slurm import SCRIPT_NAME
from tests.launch.test_signals import CHEAP, ROOT, STOP_BOUND_S, Job

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

_SRUN = """#!/bin/bash
# srun's options, then the task: run it here
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
_SCONTROL = """#!/bin/bash
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$(dirname "$0")/requeued" ;;
esac
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stubs(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755 | stat.S_IXUSR)
    return folder


def _batch_job(tmp_path: Path) -> tuple[Job, Path, Path]:
    out, stubs = tmp_path / "run", _stubs(tmp_path / "bin")
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.cli",
            "slurm",
            "configs/quickstart_cpu.yaml",
            *CHEAP,
            f"run.output_dir={out}",
            "run.steps=50",
            "run.checkpoint_every=0",
            "--nodes",
            "1",
            "--gpus-per-node",
            "0",
            "--rdzv-port",
            str(_free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost"}
    return Job(["bash", str(out / SCRIPT_NAME)], tmp_path / "job.log", env), out, stubs


@pytest.mark.claim("slurm-time-limit")
def test_the_time_limit_signal_checkpoints_then_requeues(tmp_path) -> None:
    job, out, stubs = _batch_job(tmp_path)
    try:
        job.wait_for("rl:")
        job.proc.send_signal(signal.SIGUSR1)
        code = job.proc.wait(timeout=180)
    finally:
        job.kill()
    assert code == 0, job.text()[-3000:]
    assert (stubs / "requeued").read_text() == "requeue 42\n"
    saved = checkpoint_dirs(out)
    assert saved and saved[-1].name != "step_000050", saved  # the step it stopped at, not the end
    assert check_checkpoints(out) == [] and not (out / REQUEST_FILE).exists()
    assert not (out / "summary.json").exists()  # the run is not over: the requeued job goes on


@pytest.mark.claim("slurm-time-limit")
def test_sigterm_to_the_batch_script_stops_the_whole_job(tmp_path) -> None:
    job, out, stubs = _batch_job(tmp_path)
    try:
        job.wait_for("rl:")
        code, gone_s = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    assert code == 128 + signal.SIGTERM, job.text()[-3000:]
    assert gone_s < STOP_BOUND_S, gone_s
    assert not (stubs / "requeued").exists()
