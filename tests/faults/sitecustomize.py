"""Faults injected into every Python process of a job, by the tests, from outside the product.

A test puts this folder first on ``PYTHONPATH``; Python imports ``sitecustomize`` at the start
of every interpreter (the launcher, torchrun, each rank, the processes megatron's checkpoint
writer starts), and this one installs the faults its environment selects:

``HYBRIDFLOW_TEST_DISK_FULL=<text>``
    a file opened for writing whose path contains ``<text>`` opens, but every write to it fails
    with ``ENOSPC`` ("No space left on device"), as on a file system that filled up.
"""

from __future__ import annotations

import builtins
import errno
import io
import os

DISK_FULL_ENV = "HYBRIDFLOW_TEST_DISK_FULL"


class _FullDiskFile:
    """A real open file whose writes fail as a full disk's do."""

    def __init__(self, stream, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)

    def writelines(self, lines) -> None:
        self.write(b"")

    def __getattr__(self, attribute: str):
        return getattr(self._stream, attribute)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()


def _fill_disk_for(text: str) -> None:
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        stream = real_open(file, mode, *args, **kwargs)
        writing = any(flag in mode for flag in "wax+")
        if writing and isinstance(file, (str, bytes, os.PathLike)) and text in os.fsdecode(file):
            return _FullDiskFile(stream, os.fsdecode(file))
        return stream

    builtins.open = io.open = open_


if os.environ.get(DISK_FULL_ENV):
    _fill_disk_for(os.environ[DISK_FULL_ENV])
