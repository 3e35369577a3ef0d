"""Atomic file writes (a reader sees the old file or the new one, never a half-written one), and
the check that a checkpoint's shard files are all there."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["existing_ancestor", "shard_problems", "staged_directory", "writable_directory_problem",
           "write_text_atomic"]


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


def shard_problems(directory: str | os.PathLike, storage_data: Mapping) -> list[str]:
    """Shard files a torch ``.metadata``'s ``storage_data`` lists (each item's ``relative_path``,
    ``offset``, ``length``) that are missing from ``directory`` or shorter than listed."""
    directory, needed = Path(directory), {}
    for info in storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing (listed in .metadata)")
        elif path.stat().st_size < size:
            problems.append(f"{path} is truncated ({path.stat().st_size} bytes, .metadata lists {size})")
    return problems


def existing_ancestor(path: str | os.PathLike) -> Path:
    """``path`` itself if it exists, else its nearest ancestor that does."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_directory_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a directory this process writes into (made if missing), or None."""
    path, base = Path(path), existing_ancestor(path)
    if base == path.absolute() and not path.is_dir():
        return "is a file, not a directory"
    if not base.is_dir():
        return f"lies under {base}, which is a file"
    try:  # a real probe: permission bits say nothing of a read-only mount or a pseudo file system
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as error:
        return f"cannot be written ({base}: {error.strerror})"
    return None
