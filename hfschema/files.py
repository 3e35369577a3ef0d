"""Atomic file writes: a reader sees the old file or the new one, never a half-written one."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["staged_directory", "write_text_atomic"]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to a temporary file beside ``path`` and rename it over ``path`` (its folder is
    made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike, *, overwrite: bool) -> Iterator[Path]:
    """``<out>.tmp`` to write into, renamed to ``out`` on success and removed on any error;
    ValueError before anything is written if ``out`` exists and ``overwrite`` is False."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"output directory {out} exists; pass overwrite=True (--overwrite) to replace it")
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
