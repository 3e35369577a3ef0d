"""A full disk (or quota), named in one line with the directory and the fix.

A full disk surfaces deep inside other libraries: megatron's checkpoint writer reports a worker's
``OSError`` as ``RuntimeError("Worker failure: [Errno 28] ...")`` inside torch's
``CheckpointException`` (gathered from every rank, pickled, so the original error's ``__cause__``
is gone and only its text is left), MLflow's SQLite store as a multi-line SQL error ending in
``database or disk is full``. ``is_disk_full`` looks through an error's causes, a checkpoint
error's per-rank failures and those texts; the run then stops with ``DiskFull``, whose message
says which directory's file system is full, what was kept and what to do.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from hfschema.files import existing_ancestor

__all__ = ["DiskFull", "free_bytes", "is_disk_full", "message"]

_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_TEXT = re.compile(rf"\[Errno ({'|'.join(str(e) for e in _ERRNOS)})\]|database or disk is full|No space left on device")


class DiskFull(RuntimeError):
    """The file system of the run's directory ran out of space (or quota)."""


def _errors(error: BaseException, seen: set[int] | None = None) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures a torch checkpoint error holds."""
    seen = set() if seen is None else seen
    if error is None or id(error) in seen:
        return
    seen.add(id(error))
    yield error
    for inner in (error.__cause__, error.__context__):
        if inner is not None:
            yield from _errors(inner, seen)
    for failure in getattr(error, "failures", {}).values():  # torch.distributed.checkpoint's CheckpointException
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            yield from _errors(inner, seen)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` comes from a full disk or an exceeded quota."""
    return any((isinstance(e, OSError) and e.errno in _ERRNOS) or _TEXT.search(str(e)) for e in _errors(error))


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on ``path``'s file system (its nearest existing ancestor's), None if unknown."""
    try:
        return shutil.disk_usage(existing_ancestor(path)).free
    except OSError:
        return None


def message(directory: Path, doing: str, kept: str) -> str:
    """One line: the full file system (by ``directory``), what was being written, what is kept."""
    free = free_bytes(directory)
    left = f", {free / 2**20:.0f} MiB free now" if free is not None else ""
    return (
        f"no space left on the file system of {directory}{left}, while {doing}; {kept}; free space there "
        "(run.keep_checkpoints=1 keeps fewer checkpoints) or set run.output_dir on a larger disk, then "
        "rerun the same command to resume"
    )
