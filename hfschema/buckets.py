"""Consecutive groups of items under a size budget (weight-push buckets, safetensors shards)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["fill_buckets"]

T = TypeVar("T")


def fill_buckets(items: Sequence[T], sizes: Sequence[int], limit: int) -> list[list[T]]:
    """``items`` in order, cut into groups whose ``sizes`` add up to at most ``limit``; an item
    bigger than ``limit`` goes alone. Always at least one group."""
    groups: list[list[T]] = [[]]
    filled = 0
    for item, size in zip(items, sizes, strict=True):
        if groups[-1] and filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(item)
        filled += size
    return groups
