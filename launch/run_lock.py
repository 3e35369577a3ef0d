"""One run per run directory: the launcher holds an exclusive lock on ``run.output_dir``.

A second ``hybridflow train`` (or ``launch``) into a directory whose run is still going would
resume from the first run's checkpoints and write beside it, into the same MLflow run. The
launcher that starts the job (the single node's, or the node hosting the rendezvous) takes an
exclusive ``flock`` on ``<run.output_dir>/run.lock`` before it touches anything there, and keeps
it until the job ends. The kernel drops the lock when the process dies, however it dies, so a
crash or a Slurm requeue never leaves a stale lock behind: the next start simply takes it. The
file's text (host, pid, start time) is only for the message a refused start prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from hfschema.files import writable_directory_problem

__all__ = ["LOCK_FILE", "RunDirectoryBusy", "hold_run_directory"]

LOCK_FILE = "run.lock"


class RunDirectoryBusy(ValueError):
    """Another live run holds the run directory's lock."""


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):  # the holder has not written its line yet
        return "another process"


def _open(directory: Path) -> int:
    """The lock file's descriptor; one-line errors for a directory that cannot hold it."""
    problem = writable_directory_problem(directory)
    try:
        if problem is None:
            directory.mkdir(parents=True, exist_ok=True)
            return os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        problem = f"cannot be written ({error.strerror})"
    raise ValueError(
        f"run.output_dir={directory} {problem}; set run.output_dir to a directory this user can "
        "write, on a file system mounted read-write"
    )


@contextlib.contextmanager
def hold_run_directory(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``output_dir``'s run lock for the block; RunDirectoryBusy (one line naming the holder
    and the fix) when a live run holds it."""
    directory = Path(output_dir)
    fd = _open(directory)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(
                f"run.output_dir={directory} is in use by a run that is still going ({_holder(fd)}); wait for "
                "it to end or stop it, or set run.output_dir to another directory"
            ) from None
        line = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, line.encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)  # releases the lock (the kernel would at exit anyway)
