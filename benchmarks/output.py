"""What every benchmark does with its result, and the byte sizes their options take."""

from __future__ import annotations

import json

from hfschema.files import write_atomic

__all__ = ["emit", "parse_bytes"]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def emit(result: dict, json_path: str | None) -> None:
    """Print ``result`` as JSON and, with ``--json PATH``, write it there too (atomically)."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        write_atomic(json_path, text + "\n")


def parse_bytes(text: str) -> int:
    """``4500M``, ``1G``, ``64K`` or a plain number of bytes."""
    unit = _UNITS.get(text[-1].upper())
    return int(float(text[:-1]) * unit) if unit else int(text)
