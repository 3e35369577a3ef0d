"""The values one RL step passes around: what an op may read, what it returns, what it may undo.

```
loop.run_step:   fields = {prompts, answers}
  each stage:    produced = OPS[op](session, node, Inputs(node, fields), step)
                 fields |= produced.fields            (exactly the node's outputs)
                 metrics |= produced.metrics          (the step's metrics, in stage order)
```

An op sees only the fields its node declares as inputs (``Inputs``): the graph's edges are all
the data that passes between ops, so ``hybridflow plan`` prints every one of them, and an op
that reads anything else fails at once, naming the field and the node to declare it on.

A filter (DAPO's dynamic sampling) drops samples and draws more: its output ``kept`` (``Kept``)
holds the batch it kept and every per-sample field it was given, filtered and drawn alike. A node
that reads ``kept`` reads those under their own names (``responses``, ``scores``,
``baseline_scores``): a stage after the filter cannot index a field of the whole batch with the
kept batch's rows (ReMax's baselines once were, and crashed with an index past the batch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.runtime.session import ModelRole

__all__ = ["Inputs", "Kept", "Produced", "Step", "StepUndo", "UndeclaredRead"]


class UndeclaredRead(AssertionError):
    """An op read (or asked for) a field its node does not declare: an edge the graph lacks."""


@dataclass(frozen=True)
class Kept:
    """What a filter kept: ``fields["responses"]`` (the rollout) and each per-sample field the
    filter read (``scores`` [N'], ``baseline_scores`` [N'] ...), in step with its samples."""

    fields: dict[str, Any]


class Inputs(Mapping[str, Any]):
    """The step's fields as one node may read them: its declared inputs, and nothing else; with
    ``kept`` among them, the kept batch's fields under their own names."""

    def __init__(self, node: Any, fields: Mapping[str, Any]) -> None:
        self._node = node
        kept = fields.get("kept") if "kept" in node.inputs else None
        self._fields = {**fields, **kept.fields} if kept is not None else fields

    def _declared(self, name: str) -> None:
        if name not in self._node.inputs:
            raise UndeclaredRead(
                f"op {self._node.op!r} of node {self._node.name!r} read field {name!r}, which the node "
                f"does not declare (its inputs: {', '.join(self._node.inputs) or 'none'}); add it to the "
                "node's inputs in hybridflow/algorithms/recipes.py so the graph has the edge"
            )

    def __getitem__(self, name: str) -> Any:
        self._declared(name)
        return self._fields[name]

    def __contains__(self, name: object) -> bool:
        self._declared(str(name))
        return name in self._fields

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._node.inputs if name in self._fields)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Produced:
    """What one op returns: its node's output fields and the metrics it measured."""

    fields: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)
    reward_errors: int = 0
    """Reward calls that raised (their samples scored 0), over every rank; the run counts them."""


class StepUndo:
    """Host snapshots of the roles this RL step updates, taken before each role's first update,
    when ``run.on_nan=skip`` and the step makes more than one update (one update that fails is
    never applied, so it needs none): a skipped step then changes no weights at all."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._taken: list[tuple[ModelRole, Any]] = []

    def before_update(self, role: ModelRole) -> None:
        if self.active and all(r is not role for r, _ in self._taken):
            self._taken.append((role, role.snapshot()))

    def rollback(self) -> bool:
        """Undo every update of the step; whether there was any to undo."""
        for role, snap in self._taken:
            role.rollback(snap)
        undone, self._taken = bool(self._taken), []
        return undone


@dataclass(frozen=True)
class Step:
    """The RL step an op runs in."""

    index: int
    """0-based: the step that turns policy version ``index`` into ``index + 1``."""
    undo: StepUndo = field(default_factory=lambda: StepUndo(False))
    """Snapshots for ``run.on_nan=skip``: an op calls ``before_update`` before it changes a role."""
