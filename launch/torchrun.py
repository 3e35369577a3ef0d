"""Start ``hybridflow train`` under torchrun on this machine.

    hybridflow train CONFIG [k=v ...]
      │  checks first, in the calling process (hybridflow.preflight)
      └─ python -m torch.distributed.run --standalone --nproc-per-node N
             -m hybridflow.runtime.worker CONFIG [k=v ...]      (N = the actor layout's ranks [+ engine ranks])

One process per rank of the actor's layout (colocated: the replica drivers among them drive the
engines, whose own scheduler processes SGLang starts), and with rollout.placement=separate one
more per engine rank (rollout.tp x num_replicas), numbered after the actor's. On a machine
without a GPU every rank runs one OpenMP thread (several ranks share few cores; more threads only
oversubscribe them) and uses gloo.

``run_job`` is how both launchers run torchrun: a signal stops every process of the job within
a bound (``launch.reaper``), and a failed rank's error is the launcher's last line and the run
directory's ``error.txt`` (``launch.failures``).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hfschema.layout import ParallelLayout
from launch import oom
from launch.failures import ERROR_DIR_ENV, ERROR_FILE, RUN_ERROR_DIR_ENV, RUN_ERRORS, report_failure
from launch.reaper import REQUEST_FILE, TORCHRUN_SHUTDOWN_S, run_reaped
from launch.run_lock import hold_run_directory
from launch.torchrun_entry import TORCHRUN

__all__ = ["launch_train", "run_job", "train_command"]

logger = logging.getLogger(__name__)


def train_command(nproc: int, config_path: str, overrides: Sequence[str]) -> list[str]:
    """The torchrun command line of a single-node run of ``nproc`` ranks."""
    return [
        sys.executable,
        "-m",
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--shutdown-timeout={TORCHRUN_SHUTDOWN_S}",
        "-m",
        "hybridflow.runtime.worker",
        config_path,
        *overrides,
    ]


def run_job(
    cmd: Sequence[str], env: Mapping[str, str], *, command: str, output_dir: str | None, lock: bool = True
) -> int:
    """Run torchrun's ``cmd`` under the reaper; returns the exit status (128 + N after signal N).

    With ``lock`` the job holds ``output_dir``'s run lock (``launch.run_lock``) from before it
    touches the directory until it ends: a second start into a directory whose run is going is
    refused (RunDirectoryBusy, a ValueError) before anything is changed. On failure the first
    failing rank's error is printed last (``command: rank R failed: ...``) and written to
    ``<output_dir>/error.txt``. An error file or checkpoint request left by an earlier start is
    removed first (a stale request would stop this start after one step)."""
    held = hold_run_directory(output_dir) if lock and output_dir is not None else contextlib.nullcontext()
    with held:
        return _run_job(cmd, env, command=command, output_dir=output_dir)


JOB_TMP_PREFIX = "hybridflow-job-"
"""Each job's temporary directory under the user's TMPDIR: ``<prefix><launcher pid>-<random>``."""


def _sweep_stale_job_dirs() -> None:
    """Remove the temporary directories of jobs whose launcher is gone (killed with SIGKILL,
    which no ``finally`` survives): each name carries its launcher's pid."""
    for stale in Path(tempfile.gettempdir()).glob(f"{JOB_TMP_PREFIX}*"):
        pid = stale.name[len(JOB_TMP_PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _keep_compile_cache(job_tmp: str) -> None:
    """torch inductor keeps its cache, precompiled headers included, in
    ``<TMPDIR>/torchinductor_<user>``: under the job's own TMPDIR every start compiled SGLang's
    ``torch.compile``d functions again (15-19 s of g++ in the first generate, on this CPU). A link
    of that name to the user's own cache lets every job reuse it; removing the job's directory
    removes the link alone."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry and no USER
        user = f"uid_{os.getuid()}"
    name = f"torchinductor_{user}"
    kept = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(kept, exist_ok=True)
    os.symlink(kept, os.path.join(job_tmp, name))


SOCKET_PATH_MAX = 107
"""The longest Unix socket path (``sockaddr_un.sun_path`` less its NUL): SGLang's IPC sockets
live in the job's directory, ``<TMPDIR>/hybridflow-job-<pid>-<8>/tmp<8>``."""


def _refuse_a_long_tmpdir() -> None:
    base = tempfile.gettempdir()
    longest = len(os.path.join(base, f"{JOB_TMP_PREFIX}{'9' * 7}-{'x' * 8}", "x" * 11))
    if longest > SOCKET_PATH_MAX:
        raise ValueError(
            f"TMPDIR={base} is too long: the engines' socket files under it would take {longest} characters,"
            f" more than a Unix socket's {SOCKET_PATH_MAX}; set TMPDIR to a shorter directory (e.g. /tmp)"
        )


@contextlib.contextmanager
def _job_tmpdir():
    """A temporary directory for the whole job, named TMPDIR for every process it starts, removed
    when the job ends however it ends: what torch elastic (``torchelastic_*``), SGLang (IPC socket
    names) and the libraries below make in TMPDIR goes with it instead of piling up. It stays
    under the user's TMPDIR (not the run directory): Unix socket paths must stay short."""
    _refuse_a_long_tmpdir()
    _sweep_stale_job_dirs()
    path = tempfile.mkdtemp(prefix=f"{JOB_TMP_PREFIX}{os.getpid()}-")
    try:
        _keep_compile_cache(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run_job(cmd: Sequence[str], env: Mapping[str, str], *, command: str, output_dir: str | None) -> int:
    if output_dir is not None:
        for stale in (ERROR_FILE, REQUEST_FILE):
            Path(output_dir, stale).unlink(missing_ok=True)
    started, shared = time.time(), _run_errors(output_dir)
    memory = oom.snapshot()
    with _job_tmpdir() as tmp:
        errors = os.path.join(tmp, "errors")
        os.mkdir(errors)
        temp = {"TMPDIR": tmp, "TMP": tmp, "TEMP": tmp}
        result = run_reaped(cmd, {**env, **temp, ERROR_DIR_ENV: errors, **shared})
        if result.signum is not None:
            line = f"{command}: stopped by {signal.Signals(result.signum).name}; exit status {result.returncode}"
        elif result.returncode != 0:
            killed = oom.killed_since(memory)
            line = report_failure(
                errors, output_dir, command=command, returncode=result.returncode, since=started, killed=killed
            )
        else:
            return 0
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return result.returncode


def _run_errors(output_dir: str | None) -> dict[str, str]:
    """The run directory's error records, where the ranks of every node write theirs (created here)."""
    if output_dir is None:
        return {}
    shared = Path(output_dir) / RUN_ERRORS
    shared.mkdir(parents=True, exist_ok=True)
    return {RUN_ERROR_DIR_ENV: str(shared)}


def launch_train(
    layout: ParallelLayout,
    config_path: str,
    overrides: Sequence[str],
    *,
    rollout: str,
    trainer: str | None = None,
    more_ranks: int = 0,
    output_dir: str | None = None,
) -> int:
    """Run the job to completion, one rank per rank of the actor's ``layout`` and ``more_ranks``
    more (the separate engines' and the frozen models' own ranks, after the actor's), after the caller's
    checks (``hybridflow.preflight``); ``rollout`` describes the engines in the start line, and
    ``trainer`` the actor's trainer (default: the layout);
    ``output_dir`` (the config's ``run.output_dir``) receives ``error.txt`` on failure.
    Returns the exit status (``run_job``)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    nproc = layout.world_size + more_ranks
    cmd = train_command(nproc, config_path, overrides)
    engines = f" + {more_ranks} rank(s) of their own" if more_ranks else ""
    trainer = trainer or layout.describe()
    sys.stdout.write(f"hybridflow train: {nproc} process(es) ({trainer}{engines}), rollout {rollout}\n")
    sys.stdout.flush()
    return run_job(cmd, env, command="hybridflow train", output_dir=output_dir)
