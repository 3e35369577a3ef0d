"""The one atomic write (a reader sees the old file or the new one, never a half-written one,
and a crash or power loss leaves one of the two), directory publishing that never removes the
last good copy first, and the check that a checkpoint's shard files are all there."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

__all__ = [
    "PREVIOUS_SUFFIX",
    "check_distinct",
    "existing_ancestor",
    "fsync_directory",
    "publish_directory",
    "restore_previous",
    "shard_problems",
    "staged_directory",
    "writable_directory_problem",
    "write_atomic",
]


def fsync_directory(path: str | os.PathLike) -> None:
    """Make the names in ``path`` (a rename, a new file) durable, where the OS allows it."""
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform that cannot open a folder: the rename stands, only later on disk
        return
    try:
        os.fsync(handle)
    except OSError:  # some file systems (and every Windows one) refuse fsync on a folder
        pass
    finally:
        os.close(handle)


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[str], None]) -> Path:
    """Write ``path`` so that a reader, or the next start after a crash, sees the old file or the
    new one and never half of one: a temporary file in the same folder (made if missing), flushed
    to disk, renamed over ``path``, then the folder flushed so the rename survives a power loss.
    ``content``: text (UTF-8), bytes, or a function that writes the temporary path it is given
    (a parquet or torch writer). The temporary file is removed if writing fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        if callable(content):
            content(temporary)
        else:
            Path(temporary).write_bytes(content.encode() if isinstance(content, str) else content)
        _fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_directory(path.parent)
    return path


def _fsync_file(path: str) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


_RENAME_EXCHANGE = 2  # linux/fs.h: swap two existing names in one step


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2``); False where the OS or the
    file system cannot (then nothing changed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd = -100  # AT_FDCWD: paths relative to the working directory, as os.replace takes them
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


PREVIOUS_SUFFIX = ".previous"
"""Where ``publish_directory`` keeps the copy it replaces, where no atomic swap exists, until the
new one is in place; ``restore_previous`` brings it back after a crash in between."""


def publish_directory(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Give the fully written ``staging`` directory the name ``final``, never removing the copy
    already under ``final`` before the new one is in place: a new name is one rename; over an
    existing copy the two are swapped in one step (Linux) and the old one, now under the staging
    name, removed; elsewhere the old copy moves to ``<final>.previous`` first, which
    ``restore_previous`` puts back if the process dies before the new one is in."""
    staging, final = Path(staging), Path(final)
    if not final.exists():
        os.replace(staging, final)
        fsync_directory(final.parent)
        return
    if _exchange(staging, final):
        old = staging
    else:
        old = final.with_name(final.name + PREVIOUS_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
    fsync_directory(final.parent)  # the new copy in place, durably, before the old one goes
    shutil.rmtree(old)


def restore_previous(folder: str | os.PathLike) -> list[Path]:
    """Put back each ``<name>.previous`` in ``folder`` whose ``<name>`` is missing (a publish cut
    short between its two renames); a ``.previous`` beside its new copy is removed. Returns the
    directories restored."""
    restored = []
    for previous in sorted(Path(folder).glob(f"*{PREVIOUS_SUFFIX}")):
        final = previous.with_name(previous.name[: -len(PREVIOUS_SUFFIX)])
        if final.exists():
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.replace(previous, final)
            restored.append(final)
    return restored


def check_distinct(out: str | os.PathLike, sources: Iterator[str | os.PathLike] | tuple = ()) -> None:
    """ValueError naming both when writing ``out`` (through ``<out>.tmp`` and ``<out>.previous``)
    would replace or write inside one of ``sources``, or one of them inside it: paths compared
    after resolving links, as ``cp a a`` does, so ``--overwrite`` can never cost the input."""
    out = Path(out).resolve()
    written = [out, out.with_name(out.name + ".tmp"), out.with_name(out.name + PREVIOUS_SUFFIX)]
    for source in sources:
        read = Path(source).resolve()
        for path in written:
            if read == path or read.is_relative_to(path) or path.is_relative_to(read):
                where = "is" if read == path else ("is inside" if path.is_relative_to(read) else "holds")
                raise ValueError(
                    f"the output {out} {where} the input {read}{'' if path == out else f' (via {path.name})'}: "
                    "writing it would replace or change the input; choose an output directory outside it"
                )


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike, *, overwrite: bool, sources: tuple = ()) -> Iterator[Path]:
    """``<out>.tmp`` to write into, published as ``out`` on success (``publish_directory``) and
    removed on any error; ValueError before anything is written if ``out`` exists and
    ``overwrite`` is False, or if ``out`` and one of ``sources`` (the directories read) overlap
    (``check_distinct``)."""
    out = Path(out)
    check_distinct(out, sources)
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
    publish_directory(staging, out)


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
