"""A liveness watch over one SGLang engine's processes while a call into it runs.

```
SGLang's own answer to a dead child          this watch's
  its watchdog thread sees the child gone      a thread polls the engine's own processes
  -> SIGQUIT to this process                   (psutil) and the call's deadline while the
  -> running-phase handler: kill this whole    call runs in this thread; on a dead process,
     process tree, the actor rank included      a SIGQUIT or the deadline it stops the engine's
                                               event loop, so the call returns, and raises
                                               EngineLost naming the cause
```

SGLang's watchdog is stopped and its SIGQUIT handler replaced (``take_over``), so a dying
scheduler no longer takes the caller down with it; a scheduler killed outright (SIGKILL) sends
nothing at all, and its peers wait for it forever: only the poll finds it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from hybridflow.rollout.base import EngineLost

__all__ = ["ProcessWatch"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
POLL_S = 0.25
"""How often the watch looks at the engine's processes during a call."""


class ProcessWatch:
    """Watches ``processes`` (the engine's own: schedulers, detokenizer) during ``call``s that run
    ``loop`` (the engine's asyncio loop, driven from this thread)."""

    def __init__(self, processes: list[psutil.Process], loop: Any) -> None:
        self._processes = processes
        self._names = {p.pid: _name(p) for p in processes}
        self._loop = loop
        self._active = False
        self._what = "a call"
        self.cause: str | None = None
        """Why the engine stopped serving (first cause seen), or None while it serves."""

    @property
    def active(self) -> bool:
        """Whether a watched call is running now."""
        return self._active

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def schedulers(self) -> list[int]:
        """The pids of the engine's scheduler processes (SGLang names them ``sglang::scheduler*``)."""
        return [pid for pid, name in self._names.items() if "scheduler" in name]

    def take_over(self, manager: Any) -> None:
        """Stop SGLang's subprocess watchdog and handle SIGQUIT here instead of SGLang's handler
        (which kills this process); only from the main thread, where SGLang installs its own."""
        if manager._subprocess_watchdog is not None:
            manager._subprocess_watchdog.stop()
        if threading.current_thread() is not threading.main_thread():
            return
        # SGLang's handler goes in with the manager's loop tasks, at its first request, inside the
        # running loop (outside one, SGLang would make a new loop): install it now, then replace it
        self._loop.run_until_complete(_called(manager.auto_create_handle_loop))
        self._loop.remove_signal_handler(signal.SIGQUIT)
        self._loop.add_signal_handler(signal.SIGQUIT, self._signalled)

    def call(self, fn: Callable[[], T], *, timeout_s: float | None, what: str) -> T:
        """``fn()``, stopped and turned into ``EngineLost`` when an engine process dies, one
        signals a failure, or ``timeout_s`` (None: no bound) passes."""
        self.check(what)
        done = threading.Event()
        poller = threading.Thread(
            target=self._poll, args=(done, timeout_s, what), daemon=True, name="hybridflow-engine-watch"
        )
        self._active, self._what = True, what
        poller.start()
        try:
            result = fn()
        except Exception as error:
            if self.cause is not None:
                raise EngineLost(self.cause) from error
            raise
        finally:
            self._active = False
            done.set()
            poller.join()
        self.check(what)  # a process that died as the call returned: the engine is gone all the same
        return result

    def check(self, what: str) -> None:
        """EngineLost if the engine already stopped serving (or a process of it is gone now)."""
        if self.cause is None and (dead := self.dead()) is not None:
            self.cause = f"{dead} before {what}"
        if self.cause is not None:
            raise EngineLost(self.cause)

    def dead(self) -> str | None:
        """'process PID (NAME) exited with code C' for the first engine process gone, or None."""
        for process in self._processes:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    continue
            return f"process {process.pid} ({self._names[process.pid]}) {_exit_of(process)}"
        return None

    def _poll(self, done: threading.Event, timeout_s: float | None, what: str) -> None:
        started = time.monotonic()
        while not done.wait(POLL_S):
            if (dead := self.dead()) is not None:
                cause = f"{dead} during {what}"
            elif timeout_s is not None and time.monotonic() - started > timeout_s:
                cause = f"{what} hung: no answer within rollout.generate_timeout_s={timeout_s:g} s"
            else:
                continue
            self._loop.call_soon_threadsafe(self._lost, cause)
            return

    def _signalled(self) -> None:
        """SIGQUIT: a scheduler that failed (often a peer of one that died: that one is named)."""
        dead = self.dead()
        self._lost(
            f"{dead} during {self._what}"
            if dead is not None
            else f"an SGLang process reported a failure (SIGQUIT) during {self._what}"
        )

    def _lost(self, cause: str) -> None:
        """In the loop's thread: record ``cause`` and stop the loop if a call is running on it."""
        if self.cause is None:
            self.cause = cause
            logger.error("SGLang engine lost: %s", cause)
        if self._active:
            self._loop.stop()  # run_until_complete then raises in the caller's frame


async def _called(fn: Callable[[], Any]) -> None:
    fn()


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"


def _exit_of(process: psutil.Process) -> str:
    """How a gone process ended, reaping it when it is this process's child."""
    try:
        code = process.wait(timeout=1)
    except (psutil.TimeoutExpired, psutil.Error):
        return "exited"
    if code is None:
        return "exited"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
