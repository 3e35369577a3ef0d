"""Regions: boxes of a tensor as one half-open ``(start, stop)`` interval per dimension.

Everything the planner moves is a box of a canonical (Hugging Face) tensor, and every box lands
in a box of some fused parameter. A fused parameter may have extra leading dimensions of extent
one (SGLang's ``w13_weight[E_local, 2I, H]`` holds one expert's ``gate_proj[I, H]`` at
``((j, j + 1), (0, I), (0, H))``), so mapping a sub-box of a canonical box into the parameter
keeps those leading intervals and shifts the trailing ones.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator
from typing import Optional

__all__ = [
    "Region",
    "full_region",
    "gc_paused",
    "intersect",
    "map_into",
    "num_elements",
    "region_shape",
    "split_even",
]

Region = tuple[tuple[int, int], ...]
"""One ``(start, stop)`` per dimension, half-open, ``start < stop``."""


def full_region(shape: tuple[int, ...]) -> Region:
    """The whole tensor of ``shape``."""
    return tuple((0, size) for size in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    """Extent of each dimension."""
    return tuple(stop - start for start, stop in region)


def num_elements(region: Region) -> int:
    """Number of elements in the box."""
    return math.prod(stop - start for start, stop in region)


def intersect(a: Region, b: Region) -> Optional[Region]:
    """The common box of ``a`` and ``b``, or None when they do not overlap."""
    if a == b:
        return a
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def map_into(sub: Region, box: Region, param_box: Region) -> Region:
    """Where ``sub`` (inside canonical ``box``) lies in the parameter box ``param_box``.

    ``param_box`` has the same trailing extents as ``box`` and may have extra leading dims.
    """
    lead = len(param_box) - len(box)
    shifted = tuple((p0 + s0 - b0, p0 + s1 - b0) for (s0, s1), (b0, _), (p0, _) in zip(sub, box, param_box[lead:]))
    return param_box[:lead] + shifted


def split_even(size: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` equal contiguous pieces of ``range(size)``."""
    step = size // parts
    return index * step, (index + 1) * step


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit).

    Building a 1,000-rank layout allocates millions of small acyclic tuples; the collector's
    repeated full scans of them cost about a third of the planning time and free nothing.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
