"""The first failing rank's error, as the launcher's last line and ``<run dir>/error.txt``.

    rank (hybridflow.runtime.worker)            launcher (launch.torchrun, launch.multinode)
    an exception escapes the job  ──►  $HYBRIDFLOW_ERROR_DIR/rank<R>.json   {rank, restart, time, error}
      (written before the rank's clean-up,       and <run dir>/logs/errors/rank<R>.json (every node's
       so a peer's later error cannot beat it)   ranks: the run directory is shared, as checkpoints need)
                                                 │
                                                 └─ torchrun failed: the newest restart's earliest
                                                    record of this launch, any node's  ──►
                                                    stderr, last:  hybridflow train: rank R failed: Type: message
                                                    <run dir>/error.txt (atomically)

A record keeps the whole traceback, and the line names where the error was raised (the innermost
frame in the project's own files, else the innermost one) and the stage and step it broke:

    hybridflow train: rank 1 failed: IndexError in advantages, step 1 (hybridflow/runtime/ops.py:767):
    index 128 is out of bounds ...; traceback in logs/errors/rank1.json

An error whose message already says what to change (a config value, a full disk) is recorded
without them (``record_failure(..., detail=False)``): its one line is the whole story.

On several nodes each node's launcher names the same first failure, whichever node it came
from: the ranks' clocks are compared (NTP keeps a cluster's within milliseconds), and records
older than the launch (an earlier job in the same run directory) are passed over.

torchrun's own ``record`` / ``TORCHELASTIC_ERROR_FILE`` mechanism is not used: it stamps errors
with whole seconds and picks the lowest rank among equal stamps (a peer's "connection closed"
can then pass for the cause), it writes only after the rank's ``finally`` blocks have closed
its process groups (by when the peers are failing too), and it prints a JSON traceback block
rather than one line. Ranks stopped by a signal
(``hybridflow.runtime.stops.Stopped``) write nothing: they did not fail.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from hfschema.files import write_atomic

__all__ = [
    "ERROR_DIR_ENV",
    "ERROR_FILE",
    "RUN_ERRORS",
    "RUN_ERROR_DIR_ENV",
    "Failure",
    "first_failure",
    "raised_at",
    "record_failure",
    "report_failure",
]

ERROR_DIR_ENV = "HYBRIDFLOW_ERROR_DIR"
"""Where the ranks of this launcher write their error records (set by the launcher)."""
RUN_ERROR_DIR_ENV = "HYBRIDFLOW_RUN_ERROR_DIR"
"""The run directory's ``RUN_ERRORS``, where every node's ranks write their records too."""
RUN_ERRORS = Path("logs") / "errors"
ERROR_FILE = "error.txt"
"""The first failure of the run's last start, in the run directory."""


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One rank's error."""

    rank: int
    """The rank's global rank (torchrun's RANK)."""
    restart: int
    """torchrun's restart round (TORCHELASTIC_RESTART_COUNT) it failed in."""
    time: float
    """When the exception reached the job's top level (``time.time()``)."""
    error: str
    """``Type: message``."""
    where: str = ""
    """``file:line`` the error was raised at (the innermost frame in the project's files); "": not said."""
    context: str = ""
    """The stage and step it broke (``advantages, step 1``); "": outside the steps' stages."""
    traceback: str = ""
    """The whole traceback, as Python prints it."""

    def line(self) -> str:
        if not (self.where or self.context):
            return f"rank {self.rank} failed: {self.error}"
        kind, _, message = self.error.partition(": ")
        head = kind + (f" in {self.context}" if self.context else "") + (f" ({self.where})" if self.where else "")
        rest = f"; traceback in {RUN_ERRORS / f'rank{self.rank}.json'}" if self.traceback else ""
        return f"rank {self.rank} failed: {head}: {message}{rest}"


_ROOT = Path(__file__).resolve().parents[1]


def raised_at(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in the project's own files
    (relative to the checkout), else of the innermost frame; "" without a traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if _is_ours(f.filename)]
    frame = (ours or frames)[-1]
    path = Path(frame.filename)
    shown = path.resolve().relative_to(_ROOT) if _is_ours(frame.filename) else path
    return f"{shown}:{frame.lineno}"


def _is_ours(filename: str) -> bool:
    path = Path(filename).resolve()
    installed = any(part.startswith(".venv") or part == "site-packages" for part in path.parts)
    return path.is_relative_to(_ROOT) and not installed


def record_failure(
    error: BaseException, *, env: dict[str, str] | None = None, context: str = "", detail: bool = True
) -> Path | None:
    """In a rank: write ``error`` for the launcher, with where it was raised, the stage and step
    (``context``) and the traceback unless ``detail=False``; None when no launcher asked for it."""
    env = os.environ if env is None else env
    directory = env.get(ERROR_DIR_ENV)
    if not directory:
        return None
    message = str(error).strip() or "(no message)"
    failure = Failure(
        rank=int(env.get("RANK", "0")),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        time=time.time(),
        error=f"{type(error).__name__}: {message}",
        where=raised_at(error) if detail else "",
        context=context if detail else "",
        traceback="".join(traceback.format_exception(error)) if detail and error.__traceback__ else "",
    )
    path = Path(directory) / f"rank{failure.rank}.json"
    write_atomic(path, json.dumps(asdict(failure)))
    if shared := env.get(RUN_ERROR_DIR_ENV):
        try:
            write_atomic(Path(shared) / path.name, json.dumps(asdict(failure)))
        except OSError:  # a run directory this node cannot write: its own launcher still knows
            pass
    return path


def first_failure(*directories: str | os.PathLike, since: float = 0.0) -> Failure | None:
    """The earliest error of the newest restart round recorded in ``directories`` at ``since`` or later."""
    found = []
    for path in (p for directory in directories for p in Path(directory).glob("rank*.json")):
        try:
            failure = Failure(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # a record cut short by a kill says nothing reliable
        if failure.time >= since:
            found.append(failure)
    if not found:
        return None
    last_round = max(f.restart for f in found)
    return min((f for f in found if f.restart == last_round), key=lambda f: (f.time, f.rank))


def report_failure(
    directory: str | os.PathLike,
    output_dir: str | os.PathLike | None,
    *,
    command: str,
    returncode: int,
    since: float = 0.0,
    killed: str | None = None,
) -> str:
    """The launcher's last line after torchrun failed (the first failure among this node's records
    in ``directory`` and every node's in the run directory, from ``since`` on); also written to
    ``<output_dir>/error.txt``. ``killed``: the out-of-memory killer ended a process of the job
    (``launch.oom``), the cause whatever the peers reported after it."""
    shared = [Path(output_dir) / RUN_ERRORS] if output_dir is not None else []
    failure = first_failure(directory, *shared, since=since)
    if killed is not None:
        line = f"{command}: {killed}" + (f" (then {failure.line()})" if failure is not None else "")
    elif failure is None:
        line = (
            f"{command}: the job failed with exit status {returncode}; no rank reported an error "
            "(a rank killed or exiting abruptly); see the ranks' output above"
        )
    else:
        line = f"{command}: {failure.line()}"
    if output_dir is not None and Path(output_dir).is_dir():
        write_atomic(Path(output_dir) / ERROR_FILE, line + "\n")
    return line
