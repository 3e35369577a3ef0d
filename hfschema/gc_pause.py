"""Start-up work done with Python's cyclic garbage collector paused, and what it imported frozen.

Why: importing torch, megatron-core, SGLang and MLflow allocates millions of objects that live as
long as the process, and with the collector on, every few hundred allocations it scans the young
ones again, then again as they age, and each later full collection scans them all. Paused for
the import and frozen after it (``gc.freeze``: out of every later collection's reach), a rank of
the CPU quickstart reaches its first step about 3 s sooner, most of it in the engine's start
(``benchmarks/startup.py``; docs/speed.md has the figures).

Used by a rank from its first line to the end of its imports (``hybridflow/runtime/worker.py``),
around SGLang's engine import (``hybridflow/rollout/sglang/engine.py``) and MLflow's start
(``hybridflow/runtime/tracking.py``); never around a training step or anything that loops.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cyclic collector off, then restore it. If the block imported modules,
    freeze every object made so far first: a module's objects live as long as the process, and a
    process imports a module once, so each process freezes a bounded amount (whatever cyclic
    garbage was pending then is kept, not collected: a start-up's, small)."""
    was_enabled, modules = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        if was_enabled:
            gc.enable()
