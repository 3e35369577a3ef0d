"""One run per run directory (``launch/run_lock.py``): a second holder is refused naming the first,
and a holder that dies, however it dies, leaves no stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow.cli import main
from launch.failures import ERROR_FILE
from launch.reaper import REQUEST_FILE
from launch.run_lock import LOCK_FILE, RunDirectoryBusy, hold_run_directory

ROOT = Path(__file__).resolve().parents[2]

HOLD = textwrap.dedent("""
    import sys, time
    from launch.run_lock import hold_run_directory
    with hold_run_directory(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
""")


def _holder(directory: Path) -> subprocess.Popen:
    job = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert job.stdout.readline().strip() == "held"
    return job


@pytest.mark.claim("one-run-per-directory")
def test_a_second_holder_is_refused_naming_the_first_and_a_killed_holder_leaves_no_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _holder(run_dir)
    try:
        with pytest.raises(
            RunDirectoryBusy,
            match=rf"run.output_dir={run_dir} is in use by a run that is still going "
            rf"\(host \S+, pid {first.pid}, started .*\); .*set run.output_dir",
        ):
            with hold_run_directory(run_dir):
                pass
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
        first.wait()
    with hold_run_directory(run_dir):
        assert f'"pid": {os.getpid()}' in (run_dir / LOCK_FILE).read_text()
    with hold_run_directory(run_dir):  # released at the block's end too
        pass


def test_train_into_a_busy_directory_is_refused_before_any_rank_starts(tmp_path: Path, capsys) -> None:
    """The whole command: one line, exit status 2, the directory's files untouched (the error file
    and checkpoint request a start removes are still there)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in (ERROR_FILE, REQUEST_FILE):
        (run_dir / name).write_text("the first run's\n")
    first = _holder(run_dir)
    try:
        code = main(["train", str(ROOT / "configs" / "quickstart_cpu.yaml"), f"run.output_dir={run_dir}"])
    finally:
        first.kill()
        first.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert (
        err[-1].startswith(f"hybridflow train: error: run.output_dir={run_dir} is in use")
        and f"pid {first.pid}" in err[-1]
    )
    assert all((run_dir / name).read_text() == "the first run's\n" for name in (ERROR_FILE, REQUEST_FILE))


@pytest.mark.parametrize(
    ("where", "says"), [("a_file", "is a file, not a directory"), ("/sys/hybridflow_run", "cannot be written")]
)
def test_a_run_directory_that_cannot_be_one_is_named_in_one_line(tmp_path: Path, where: str, says: str) -> None:
    path = tmp_path / where if not where.startswith("/") else Path(where)
    if where == "a_file":
        path.write_text("keep me\n")
    with pytest.raises(ValueError, match=rf"^run.output_dir={path} {says}.*; set run.output_dir to a directory"):
        with hold_run_directory(path):
            pass
    if where == "a_file":
        assert path.read_text() == "keep me\n"
