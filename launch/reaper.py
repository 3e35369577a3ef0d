"""Run torchrun so that nothing a crashed rank started outlives the job.

A rank that dies abruptly (SIGKILL, ``os._exit``, a node fault) leaves its own children
behind: rank 0's SGLang scheduler processes are reparented to init and keep running, holding
memory, ports and the launcher's output pipes (a caller waiting for EOF then waits forever).
The launcher makes itself a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so such
orphans are reparented to it instead of init; when torchrun returns, whatever is left under
the launcher is terminated, then killed.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence

import psutil

__all__ = ["become_subreaper", "reap_children", "run_reaped"]

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


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
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    if running:
        logger.warning("stopped %d process(es) left behind by the job: %s", len(running), ", ".join(names))
    return [p.pid for p in running]


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({' '.join(proc.cmdline())[:120]})"
    except psutil.Error:
        return str(proc.pid)


def run_reaped(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """``subprocess.run(cmd)``, then reap what the job left behind; returns the exit status."""
    become_subreaper()
    try:
        return subprocess.run(list(cmd), env=dict(env)).returncode
    finally:
        reap_children()
