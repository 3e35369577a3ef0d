"""When each start-up phase of a run ended, as the driver rank saw it (``benchmarks/startup.py``).

```
process created (torchrun started the worker)
  imports     the worker's modules: torch, megatron-core, transformers, the engine's
  rendezvous  the process groups (and the joint group with the engine ranks when separate)
  session     the data files, tokenizer and prompts, the MLflow run
  warm_up     the SFT warm-up (none: nothing)
  models      the actor (and reference, critic) built, their weights loaded
  engines     the rollout engines started, the weight sync planned (separate placement: the
              engine ranks start theirs meanwhile, and the first push waits for them)
  first_push  the actor's weights pushed into them
  first_step  the first RL step
```

The marks are wall-clock times (``time.time()``), so a benchmark that started the command
subtracts its own start. Rank 0 writes them to ``<output_dir>/logs/startup.json`` when the first
RL step ends; other processes keep theirs.

One clock per process, at module level on purpose: the first phases end before any object of
the run exists to hold it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from hfschema.files import write_atomic

__all__ = ["PHASES", "STARTUP_FILE", "mark", "write"]

STARTUP_FILE = Path("logs") / "startup.json"
PHASES = ("process", "imports", "rendezvous", "session", "warm_up", "models", "engines", "first_push", "first_step")
"""The marks of a start, in the order they end (``process``: when the worker was created)."""

_marks: list[tuple[str, float]] = [("process", psutil.Process().create_time())]


def mark(phase: str) -> None:
    """``phase`` ended now (a phase marked twice keeps its first end: a resumed step is not the first)."""
    if all(name != phase for name, _ in _marks):
        _marks.append((phase, time.time()))


def write(out_dir: str | Path) -> None:
    """The marks so far, as {"marks": [[phase, time], ...]}, into the run directory."""
    path = Path(out_dir) / STARTUP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"marks": [[name, at] for name, at in _marks]}))
