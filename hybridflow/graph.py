"""The static dataflow graph of one RL step: nodes that declare the fields they read and write.

A node names its role (where it runs), its op (what the runtime does) and the fields it
reads and writes. Nothing else is declared: an edge exists wherever one node writes a field
that another reads, and fields nobody writes must come from the data loader.

    Node(generate, rollout)      reads prompts           writes responses ─────────┐
    Node(reward, reward)         reads responses,answers writes scores    ◄────────┘
                                                                          ─────────┐
    Node(advantages, driver)     reads token_rewards ... writes advantages ◄── ... ┘
                │
                ▼
    Graph(nodes, data_fields=(prompts, answers))
        .validate(placed_roles)   one writer per field; every read written or loaded;
                                  known, placed roles; unique names; no cycle
        .edges()                  (producer, consumer, field) resolved from the fields
        .topological_order()      Kahn's order, ties broken by declaration order
        .to_text() / .to_mermaid()

The graph is a plain value: no torch, no process groups. The algorithms in
``hybridflow.algorithms`` build one per config, and the lowering places it on ranks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["DRIVER", "Edge", "Graph", "GraphError", "Node", "ROLES", "ROLE_SWITCHES"]

DRIVER = "driver"
ROLES = ("actor", "reference", "critic", "reward_model", "teacher", "rollout", "judge", "reward", DRIVER)
"""Where a node runs. ``driver`` is CPU-side bookkeeping that every rank does for itself."""

ROLE_SWITCHES = {
    "actor": "set actor.enabled=true",
    "reference": "set reference.enabled=true (the actor's layout unless reference.parallel)",
    "critic": "set critic.enabled=true or leave it unset (it takes the actor's layout)",
    "reward_model": "set reward_model.path (it takes the actor's layout)",
    "teacher": "set distillation.teacher_path (it takes the actor's layout)",
    "judge": "set judge.path (its engine runs on the actor's first judge.tp GPUs)",
    "rollout": "configure the rollout section",
    "reward": "configure the reward section",
    DRIVER: "the driver runs on every rank",
}
"""How a user places each role: quoted by ``Graph.validate`` when a node's role is missing."""

DATA_SOURCE_ID = "data_fields"  # mermaid id of the data loader; node ids are "node_<name>"


class GraphError(ValueError):
    """A dataflow graph that cannot run: the message names the node, field or role at fault."""


class Edge(NamedTuple):
    """One field flowing from the node that writes it to a node that reads it (node names)."""

    producer: str
    consumer: str
    field: str


@dataclass(frozen=True, kw_only=True)
class Node:
    """One step of the graph: ``op`` on ``role`` reads ``inputs`` and writes ``outputs``."""

    name: str
    """Unique within the graph; a Python identifier (it names metrics and mermaid ids)."""
    role: str
    """Where it runs: one of ROLES."""
    op: str
    """What the runtime does; it dispatches on this string."""
    inputs: tuple[str, ...] = ()
    """Fields read."""
    outputs: tuple[str, ...] = ()
    """Fields written; each field has exactly one writer in a graph."""
    options: tuple[tuple[str, Any], ...] = ()
    """Settings of the op as (key, value) pairs; a mapping is accepted and frozen."""
    doc: str = ""
    """One line on what the node does."""

    def __post_init__(self) -> None:
        # accept lists and mappings for convenience; store tuples so the node stays hashable
        for key in ("inputs", "outputs"):
            if isinstance(getattr(self, key), str):  # tuple("prompts") would be its letters
                raise TypeError(
                    f"node {self.name!r}: {key} must be a tuple of field names, got the string {getattr(self, key)!r}"
                )
            object.__setattr__(self, key, tuple(getattr(self, key)))
        pairs = self.options.items() if isinstance(self.options, Mapping) else self.options
        object.__setattr__(self, "options", tuple((str(k), v) for k, v in pairs))

    def option(self, key: str, default: Any = KeyError) -> Any:
        """The value of option ``key``; ``default`` when the node has none, given one (options a
        graph transform adds to some graphs only), else KeyError naming the options it has."""
        for name, value in self.options:
            if name == key:
                return value
        if default is not KeyError:
            return default
        have = ", ".join(name for name, _ in self.options) or "none"
        raise KeyError(f"node {self.name!r} has no option {key!r}; it has: {have}")

    def describe(self) -> str:
        """``name [role] op: in, ... -> out, ...`` and the options, if any."""
        reads = ", ".join(self.inputs) or "-"
        writes = ", ".join(self.outputs) or "-"
        line = f"{self.name} [{self.role}] {self.op}: {reads} -> {writes}"
        if self.options:
            line += "  (" + ", ".join(f"{k}={v}" for k, v in self.options) + ")"
        return line


@dataclass(frozen=True, kw_only=True)
class Graph:
    """An algorithm's step as nodes; edges follow from the fields they read and write."""

    name: str
    """Usually the algorithm's name."""
    nodes: tuple[Node, ...]
    """In declaration order, which breaks ties in ``topological_order``."""
    data_fields: tuple[str, ...] = ()
    """Fields the data loader supplies (e.g. prompts, answers)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "data_fields", tuple(self.data_fields))

    # ------------------------------------------------------------------ queries

    def node(self, name: str) -> Node:
        """The node called ``name``; KeyError listing the node names."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"graph {self.name!r} has no node {name!r}; nodes: {self._names()}")

    def roles(self) -> tuple[str, ...]:
        """Roles the nodes run on, in ROLES order (unknown roles last, as declared)."""
        used = {node.role for node in self.nodes}
        extra = [node.role for node in self.nodes if node.role not in ROLES]
        return tuple(r for r in ROLES if r in used) + tuple(dict.fromkeys(extra))

    def producers(self) -> dict[str, str]:
        """Field -> the node that writes it; GraphError if two nodes, or a node and the data
        loader, write the same field."""
        writers = {name: "the data loader" for name in self.data_fields}
        found = {}
        for node in self.nodes:
            for name in node.outputs:
                if name in writers:
                    raise GraphError(
                        f"graph {self.name!r}: field {name!r} is written by both "
                        f"{_who(writers[name])} and node {node.name!r}; rename one of them"
                    )
                writers[name] = found[name] = node.name
        return found

    def edges(self) -> list[Edge]:
        """Every (producer, consumer, field), consumers in declaration order; data-loader
        fields and fields nobody writes give no edge."""
        writer = self.producers()
        return [Edge(writer[f], node.name, f) for node in self.nodes for f in node.inputs if f in writer]

    def sinks(self) -> tuple[Node, ...]:
        """Nodes whose outputs no node reads: where the step ends."""
        feeding = {edge.producer for edge in self.edges()}
        return tuple(node for node in self.nodes if node.name not in feeding)

    def topological_order(self) -> tuple[Node, ...]:
        """Nodes with every producer before its consumers; among the nodes ready at a time the
        one declared first goes first. GraphError naming the nodes of a cycle if there is one."""
        index = {node.name: i for i, node in enumerate(self.nodes)}
        preds, succs = self._adjacency()
        waiting = {name: len(p) for name, p in preds.items()}
        ready = [index[name] for name, count in waiting.items() if count == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            node = self.nodes[heapq.heappop(ready)]
            order.append(node)
            for succ in succs[node.name]:
                waiting[succ] -= 1
                if waiting[succ] == 0:
                    heapq.heappush(ready, index[succ])
        if len(order) < len(self.nodes):
            stuck = {name for name, count in waiting.items() if count}
            raise GraphError(f"graph {self.name!r} has a cycle: {_cycle(preds, stuck)}")
        return tuple(order)

    # ------------------------------------------------------------------ checks

    def validate(self, placed_roles: Iterable[str] | None = None) -> None:
        """Raise GraphError unless the graph can run: node names unique identifiers, roles
        known (and placed, if ``placed_roles`` is given), one writer per field, every field
        read is written or loaded, no cycle."""
        self._check_names()
        self._check_roles(placed_roles)
        self._check_reads()
        self.topological_order()

    def _check_names(self) -> None:
        seen = set()
        for node in self.nodes:
            if not node.name.isidentifier():
                raise GraphError(
                    f"graph {self.name!r}: node name {node.name!r} must be an identifier (letters, digits, underscores)"
                )
            if node.name in seen:
                raise GraphError(f"graph {self.name!r}: two nodes are called {node.name!r}; give each a unique name")
            seen.add(node.name)

    def _check_roles(self, placed_roles: Iterable[str] | None) -> None:
        placed = None if placed_roles is None else set(placed_roles)
        for node in self.nodes:
            if node.role not in ROLES:
                raise GraphError(
                    f"graph {self.name!r}: node {node.name!r} has unknown role {node.role!r}; roles: {', '.join(ROLES)}"
                )
            if placed is not None and node.role not in placed:
                raise GraphError(
                    f"graph {self.name!r}: node {node.name!r} runs on the {node.role} role, "
                    f"which this config does not place: {ROLE_SWITCHES[node.role]}"
                )

    def _check_reads(self) -> None:
        available = set(self.producers()) | set(self.data_fields)
        for node in self.nodes:
            for name in node.inputs:
                if name not in available:
                    raise GraphError(
                        f"graph {self.name!r}: node {node.name!r} reads field {name!r}, which "
                        "no node writes and the data loader does not supply; available "
                        f"fields: {', '.join(sorted(available)) or 'none'}"
                    )

    # ------------------------------------------------------------------ rendering

    def to_text(self) -> str:
        """One line per node in topological order: ``name [role] op: in -> out  (options)``."""
        return "\n".join(node.describe() for node in self.topological_order())

    def to_mermaid(self) -> str:
        """A mermaid ``flowchart TD``: the data loader, one box per node, and one arrow per
        (producer, consumer) pair labelled with the fields it carries."""
        lines = ["flowchart TD"]
        if self.data_fields:
            lines.append(f'    {DATA_SOURCE_ID}[/"data: {", ".join(self.data_fields)}"/]')
        for node in self.topological_order():
            label = f"{node.name}<br/>{node.role}: {node.op}"
            lines.append(f'    node_{node.name}["{label}"]')
        for (src, dst), names in self._arrows().items():
            lines.append(f'    {src} -->|"{", ".join(names)}"| {dst}')
        return "\n".join(lines)

    def _arrows(self) -> dict[tuple[str, str], list[str]]:
        """(mermaid source id, mermaid target id) -> fields, data-loader arrows first."""
        arrows: dict[tuple[str, str], list[str]] = {}
        loaded = set(self.data_fields)
        for node in self.nodes:
            for name in node.inputs:
                if name in loaded:
                    arrows.setdefault((DATA_SOURCE_ID, f"node_{node.name}"), []).append(name)
        for edge in self.edges():
            key = (f"node_{edge.producer}", f"node_{edge.consumer}")
            arrows.setdefault(key, []).append(edge.field)
        return arrows

    # ------------------------------------------------------------------ helpers

    def _names(self) -> str:
        return ", ".join(node.name for node in self.nodes)

    def _adjacency(self) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
        """(predecessors, successors) of every node, by name."""
        preds: dict[str, set[str]] = {node.name: set() for node in self.nodes}
        succs: dict[str, set[str]] = {node.name: set() for node in self.nodes}
        for edge in self.edges():
            preds[edge.consumer].add(edge.producer)
            succs[edge.producer].add(edge.consumer)
        return preds, succs


def _who(writer: str) -> str:
    return writer if writer == "the data loader" else f"node {writer!r}"


def _cycle(preds: dict[str, set[str]], stuck: set[str]) -> str:
    """``a -> b -> a`` for one cycle among ``stuck`` nodes (those Kahn's order never freed).

    Every stuck node waits on a stuck predecessor, so walking predecessors from any stuck
    node must revisit one: the walk from that node's first visit on is a cycle.
    """
    walk = [min(stuck)]
    while walk[-1] not in walk[:-1]:
        walk.append(min(preds[walk[-1]] & stuck))
    start = walk.index(walk[-1])
    loop = walk[start:][::-1]  # predecessor walk reversed: producer -> consumer order
    return " -> ".join(loop)
