"""The one atomic write and directory publishing (``hfschema.files``), with crashes injected
between their steps: a crash leaves the old copy or the new one, and resume finds a complete one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hfschema import files
from hfschema.files import PREVIOUS_SUFFIX, publish_directory, write_atomic
from hybridflow.runtime import state
from tests.runtime.run_dirs import checkpoint


class Crash(BaseException):
    """The process dies here: nothing after it runs, no handler cleans up."""


def _crash_on_call(monkeypatch: pytest.MonkeyPatch, module, name: str, call: int) -> None:
    """Make the ``call``-th call (1-based) of ``module.name`` crash before it does anything."""
    real, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise Crash(f"{name} call {call}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)


def test_write_atomic_writes_text_bytes_and_through_a_writer_and_flushes_file_and_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        files.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    assert write_atomic(tmp_path / "a" / "t.txt", "héllo").read_text(encoding="utf-8") == "héllo"
    assert write_atomic(tmp_path / "b.bin", b"\x00\xff").read_bytes() == b"\x00\xff"
    assert (
        write_atomic(tmp_path / "c.txt", lambda tmp: Path(tmp).write_text("via a writer")).read_text() == "via a writer"
    )
    assert write_atomic(tmp_path / "empty", "").read_bytes() == b""
    # each write: its temporary file, then the folder that holds the new name
    folder = tmp_path.name
    assert [Path(p).name if Path(p).is_dir() else "file" for p in synced] == ["file", "a"] + ["file", folder] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b.bin", "c.txt", "empty"]  # no temporaries


def test_a_failed_or_crashed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = write_atomic(tmp_path / "state.json", "old")

    def broken(temporary: str) -> None:
        Path(temporary).write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, broken)
    _crash_on_call(monkeypatch, files.os, "replace", 1)
    with pytest.raises(Crash):
        write_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def _dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights").write_text(text)
    return path


def test_publishing_over_a_copy_swaps_them_and_a_crash_before_the_clean_up_leaves_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final, staging = _dir(tmp_path / "sft", "old"), _dir(tmp_path / "sft.partial", "new")
    _crash_on_call(monkeypatch, files.shutil, "rmtree", 1)  # right after the swap
    with pytest.raises(Crash):
        publish_directory(staging, final)
    assert (final / "weights").read_text() == "new"
    assert (staging / "weights").read_text() == "old"  # a .partial: resume never reads it
    monkeypatch.undo()
    publish_directory(_dir(tmp_path / "sft.tmp", "newer"), final)
    assert (final / "weights").read_text() == "newer" and not (tmp_path / "sft.tmp").exists()


@pytest.mark.parametrize(
    "crash_at", [1, 2, 3], ids=["before-moving-the-old-aside", "between-the-renames", "before-removing-the-old"]
)
def test_without_an_atomic_swap_a_crash_at_any_step_leaves_a_complete_checkpoint_to_resume_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int
) -> None:
    """Where the file system cannot swap two names (``renameat2`` missing): the old copy moves to
    ``.previous``, the new one in, the old removed. A crash before each of those steps."""
    old = checkpoint(tmp_path, "step_000004", 4)
    new = checkpoint(tmp_path / "staging", "step_000004", 5)
    staging = new.rename(state.staging_dir(old))
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    if crash_at < 3:
        _crash_on_call(monkeypatch, files.os, "replace", crash_at)
    else:
        _crash_on_call(monkeypatch, files.shutil, "rmtree", 2)  # the first clears a stale .previous
    with pytest.raises(Crash):
        state.publish(staging, old)
    monkeypatch.undo()
    found = state.find_resume(tmp_path, "auto")
    assert found.path == old and found.damaged == ()
    assert state.read_state(old).step == (5 if crash_at == 3 else 4)
    assert not old.with_name(old.name + PREVIOUS_SUFFIX).exists()


def test_publishing_a_new_name_is_one_rename(tmp_path: Path) -> None:
    staging = _dir(tmp_path / "step_000002.partial", "w")
    publish_directory(staging, tmp_path / "step_000002")
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]
