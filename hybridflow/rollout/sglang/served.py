"""Which model classes the installed SGLang serves, read without importing it.

SGLang registers a model class by the ``EntryClass`` of each module in ``sglang/srt/models``;
importing its registry imports every one of them (15 s on a CPU). ``hybridflow plan`` and the
checks before any rank starts only need the names, so the modules' text is read instead (30 ms).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

__all__ = ["served_architectures"]

_ENTRY = re.compile(r"^EntryClass\s*=\s*(\[[^\]]*\]|\w+)", re.MULTILINE)


@functools.cache
def served_architectures() -> frozenset[str]:
    """The ``architectures`` names (config.json) SGLang builds a model for; empty without SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return frozenset()
    names: set[str] = set()
    for module in (Path(spec.origin).parent / "srt" / "models").glob("*.py"):
        for entry in _ENTRY.finditer(module.read_text(errors="replace")):
            names.update(re.findall(r"\w+", entry.group(1)))
    return frozenset(names)
