"""``runtime.disk_full``: a full disk recognised however a library reports it."""

from __future__ import annotations

import errno
import sqlite3
import traceback

from torch.distributed.checkpoint.api import CheckpointException

from hybridflow.runtime.disk_full import is_disk_full, message


def _raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise error from cause
    except BaseException as caught:
        return caught


def test_a_full_disk_is_recognised_through_causes_checkpoint_failures_and_sqlite() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/x.distcp")
    assert is_disk_full(full) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(_raised(RuntimeError("Worker failure"), full))  # a cause
    # megatron's writer, gathered by torch from every rank (pickled: only the text survives)
    gathered = RuntimeError(f"Worker failure: {full}")
    assert is_disk_full(CheckpointException("write", {1: (gathered, traceback.extract_stack())}))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))  # MLflow's store


def test_other_errors_are_not_a_full_disk() -> None:
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(CheckpointException("write", {}))  # a non-coordinator rank's copy: no causes
    assert not is_disk_full(_raised(ValueError("bad row 28"), KeyError("x")))


def test_the_message_is_one_line_naming_the_directory_what_was_kept_and_the_fix(tmp_path) -> None:
    line = message(tmp_path / "checkpoints", "writing checkpoint step_000002.partial", "step_000001 is kept")
    assert "\n" not in line and str(tmp_path / "checkpoints") in line and "MiB free now" in line
    assert "step_000001 is kept" in line and "run.output_dir" in line
