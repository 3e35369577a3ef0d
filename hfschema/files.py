"""Atomic file writes: a reader sees the old file or the new one, never a half-written one."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to a temporary file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
