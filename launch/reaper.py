"""Run torchrun so that nothing of the job outlives it: not a crashed rank's children, and
nothing at all once the launcher is told to stop.

A rank that dies abruptly (SIGKILL, ``os._exit``, a node fault) leaves its own children
behind: rank 0's SGLang scheduler processes are reparented to init and keep running, holding
memory, ports and the launcher's output pipes (a caller waiting for EOF then waits forever).
The launcher makes itself a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so such
orphans are reparented to it instead of init; when torchrun returns, whatever is left under
the launcher is terminated, then killed.

Stopping (SIGINT, SIGTERM, SIGHUP to the launcher)::

    launcher ── the same signal ──► torchrun (own session)  ── killpg(signal) ──► each rank's group
       │                              └─ SIGKILL to the ranks after --shutdown-timeout (TORCHRUN_SHUTDOWN_S)
       └─ STOP_GRACE_S after the signal: SIGKILL to every process still below the launcher
    exit status 128 + signal number (130 for SIGINT)

torchrun runs in a session of its own: a Ctrl-C in the terminal then reaches the launcher only,
and torchrun gets the signal once (a second one while it shuts its workers down ends it before
it has killed them). A second signal to the launcher kills everything at once. A rank that
is writing a checkpoint finishes it if it can within the grace (``hybridflow.runtime.stops``);
one cut short stays a ``.partial`` directory that resume never reads.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

__all__ = [
    "REQUEST_FILE",
    "STOP_GRACE_S",
    "STOP_SIGNALS",
    "TORCHRUN_SHUTDOWN_S",
    "JobResult",
    "become_subreaper",
    "reap_children",
    "run_reaped",
]

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a job cleanly (the launcher forwards them; the ranks handle them)."""
TORCHRUN_SHUTDOWN_S = 10
"""torchrun's ``--shutdown-timeout``: how long it waits for its ranks to exit before SIGKILL."""
STOP_GRACE_S = 15.0
"""How long after a stop signal the launcher waits before it SIGKILLs whatever is left."""
REQUEST_FILE = "checkpoint.request"
"""In the run directory: the ranks checkpoint at their next step boundary and stop
(``hybridflow.runtime.stops``; the Slurm script writes it before the time limit)."""
_POLL_S = 0.2


@dataclass(frozen=True)
class JobResult:
    """How the job ended."""

    returncode: int
    """The launcher's exit status: torchrun's, or 128 + ``signum`` when a signal stopped the job."""
    signum: int | None = None
    """The signal that stopped the job (None: it ended by itself)."""


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _prepare_child() -> None:
    """In the child before exec: SIGTERM when the launcher dies (even by SIGKILL), and the stop
    signals back to their default action. A launcher started with one of them ignored (``nohup``
    ignores SIGHUP; a shell's background job, ``cmd &``, SIGINT) would pass the ignoring on to
    every rank, which exec keeps: the signal the launcher forwards would then stop nothing."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def reap_children(timeout_s: float = 10.0, grace_s: float = 2.0) -> list[int]:
    """Terminate, then kill, every process still below this one; returns their pids.

    Processes that exit on their own within ``grace_s`` (helpers whose parent rank just exited,
    such as multiprocessing's resource tracker or torch's shared-memory manager, which end when
    their parent's pipe closes; zombies waiting to be reaped) are reaped without a warning.
    """
    left = psutil.Process().children(recursive=True)
    _, running = psutil.wait_procs(left, timeout=grace_s)
    names = [_describe(p) for p in running]
    for proc in running:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(running, timeout=timeout_s)
    _kill_all(alive, timeout_s)
    # a process started while the others were stopping (a rank's child on its way up) was not listed
    for _ in range(3):
        late = psutil.Process().children(recursive=True)
        if not late:
            break
        names += [_describe(p) for p in late]
        _kill_all(late, timeout_s)
    if names:
        logger.warning("stopped %d process(es) left behind by the job: %s", len(names), ", ".join(names))
    return [p.pid for p in running]


def _kill_all(procs: list[psutil.Process], timeout_s: float) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({' '.join(proc.cmdline())[:120]})"
    except psutil.Error:
        return str(proc.pid)


class _Stop:
    """The launcher's stop signals: the first is forwarded to torchrun and starts the grace;
    a second, or the end of the grace, kills every process below the launcher."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child, self.signum, self.deadline = child, None, None

    def on_signal(self, signum: int, _frame) -> None:
        if self.signum is not None:
            self.deadline = 0.0  # asked twice: stop waiting
            return
        self.signum, self.deadline = signum, time.monotonic() + STOP_GRACE_S
        name = signal.Signals(signum).name
        sys.stderr.write(f"hybridflow: {name}: stopping the job (SIGKILL in {STOP_GRACE_S:g} s)\n")
        try:
            self.child.send_signal(signum)
        except ProcessLookupError:
            pass

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def _wait(child: subprocess.Popen, stop: _Stop) -> int:
    """torchrun's exit status; SIGKILL to everything below the launcher once ``stop`` is overdue."""
    while True:
        try:
            return child.wait(timeout=_POLL_S)  # polled: a signal's deadline is seen in time
        except subprocess.TimeoutExpired:
            if stop.overdue():
                logger.warning(
                    "the job did not stop within %g s of %s; killing it", STOP_GRACE_S, signal.Signals(stop.signum).name
                )
                _kill_all(psutil.Process().children(recursive=True), timeout_s=5.0)


def run_reaped(cmd: Sequence[str], env: Mapping[str, str]) -> JobResult:
    """Run ``cmd`` (torchrun) to its end or until a stop signal, then reap what the job left
    behind; see the module docstring."""
    become_subreaper()
    child = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True, preexec_fn=_prepare_child)
    stop = _Stop(child)
    previous = {sig: signal.signal(sig, stop.on_signal) for sig in STOP_SIGNALS}
    try:
        code = _wait(child, stop)
    finally:
        if stop.signum is not None:  # within the bound: only a short grace for helpers exiting by themselves
            reap_children(timeout_s=2.0, grace_s=0.5)
        else:
            reap_children()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.signum is not None:
        return JobResult(128 + stop.signum, stop.signum)
    return JobResult(128 - code if code < 0 else code)  # torchrun killed by signal N: 128 + N
