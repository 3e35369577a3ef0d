"""What a run prints, and what it keeps for later.

The terminal shows hybridflow's own lines (rank 0's notes, every rank's warnings), errors from
any library, the progress bars and the summary. Everything else, megatron-core's and
SGLang's logs and Python's warnings (deprecations, CPU fallbacks), goes to the run's log files:

    <run.output_dir>/logs/rank<R>.log          every log record of rank R at INFO and above
    <run.output_dir>/logs/engine_rank<R>.log   the output of the rollout engine rank R starts
                                               (SGLang's scheduler and detokenizer processes)

``run.verbose=true`` (``hybridflow train -v``) shows every library's records on the terminal too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOG_DIR", "configure", "engine_output", "reapply"]

LOG_DIR = "logs"
TOLD = ("hybridflow", "launch")
"""The loggers whose notes (INFO) the terminal shows: the run's own account of itself."""
OWN = ("megatron_adapters", "reshard", "moe", "hfschema")
"""This project's other packages: the terminal shows their warnings; other libraries' errors only."""
FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
_NOISY = ("httpx", "urllib3", "alembic", "mlflow.store.db.utils")


class _Settings:
    """The last ``configure`` call's arguments, for ``reapply``."""

    args: tuple | None = None


class _OwnOrSevere(logging.Filter):
    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):  # e.g. a failed rank's traceback: the terminal has its own
            return False
        top = record.name.split(".", 1)[0]
        if self.verbose or top in TOLD:
            return True
        return record.levelno >= (logging.WARNING if top in OWN else logging.ERROR)


def configure(out_dir: str | os.PathLike, *, rank: int, driver: bool, verbose: bool) -> Path:
    """Set this rank's logging (replacing what was set before); returns its log file."""
    _Settings.args = (out_dir, rank, driver, verbose)
    path = Path(out_dir) / LOG_DIR / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file = logging.FileHandler(path, encoding="utf-8")
    file.setFormatter(logging.Formatter(FORMAT))
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(logging.Formatter(FORMAT))
    terminal.setLevel(logging.INFO if driver else logging.WARNING)
    terminal.addFilter(_OwnOrSevere(verbose))
    root.addHandler(file)
    root.addHandler(terminal)
    root.setLevel(logging.INFO)
    logging.captureWarnings(not verbose)  # Python's warnings become records: the file keeps them
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return path


def reapply() -> None:
    """Set the last configuration again: SGLang's engine start re-configures the root logger of
    the process that starts it (``logging.basicConfig(force=True)``)."""
    if _Settings.args is not None:
        out_dir, rank, driver, verbose = _Settings.args
        configure(out_dir, rank=rank, driver=driver, verbose=verbose)


@contextlib.contextmanager
def engine_output(out_dir: str | os.PathLike | None, rank: int, *, verbose: bool) -> Iterator[Path | None]:
    """Send this process's stdout and stderr to ``logs/engine_rank<R>.log`` while an engine
    starts: the processes it starts inherit them and keep writing there; this process's are
    back after the block (and its logging as configured). No-op when ``verbose`` or without a
    run directory."""
    if verbose or out_dir is None:
        yield None
        return
    path = Path(out_dir) / LOG_DIR / f"engine_rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield path
    except Exception as error:  # its processes' tracebacks are in the file, not on the terminal
        error.add_note(f"the engine's own output: {path}")
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)
        reapply()
