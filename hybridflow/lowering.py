"""Lowering: an algorithm's dataflow graph and the config's placement -> an ExecutionPlan.

    cfg ──► build_graph(cfg)      check_roles, check_sampling: the algorithm's roles are on
     │         │                  and its sampling can feed it; the graph is a valid DAG
     ├──► place(cfg) ──► Placement           pools of GPUs, roles on pools; layouts fit
     │         │
     │         ▼
     │    graph.validate(placement.roles)    every node's role has a pool
     │         │
     │         ▼
     │    stages: nodes in topological order, each with its pool, ranks, layout and the
     │            colocation switch that precedes it
     ├──► pool_memory() per pool ──► MemoryEstimate     (hybridflow.memory)
     └──► plan_weight_sync(cfg) ──► PlanStats           (optional: with_reshard)
                       │
                       ▼
                ExecutionPlan ──► describe() ──► ``hybridflow plan``

Everything is checked here, before a process starts: the runtime calls
``lower(cfg, with_reshard=False)`` first, and ``hybridflow plan`` prints the result. Pure: no
process groups, no CUDA, no I/O.

Placement rules:

- ``rollout.placement=colocated``: one pool of ``actor.parallel.world_size`` GPUs holds the
  actor, the enabled reference and critic, and the rollout engines (engine rank i on GPU i;
  the config already checked ``rollout.tp * num_replicas <= world``).
- ``rollout.placement=separate``: an ``actor`` pool (actor, reference, critic) and a
  ``rollout`` pool of ``rollout.tp * num_replicas`` GPUs, numbered after the actor's.
- A model role's layout must fit its pool (``world_size <= pool``, a ValueError naming the
  role's ``parallel`` keys otherwise). The actor fills its pool by construction; a critic with a
  smaller layout runs on the pool's first ``world_size`` ranks, and the other ranks skip its
  nodes (planned only: the runtime builds the critic under the actor's layout).
- Frozen models (``reference``, ``reward_model``, ``teacher``) run on the actor's pool, under the
  actor's layout or their own (``reference.parallel``, ``reward_model.parallel``,
  ``distillation.parallel``: the same ranks, groups of their own; the config refuses one that
  does not fill them); ``frozen_models`` describes them (a reward model's architecture is read
  from its directory).
- A frozen model with GPUs of its own (``reward_model.gpus``, ``distillation.gpus``) gets a pool
  of them, numbered after the actor's and the separate engines' (``config.frozen_gpus``); no
  colocation switch concerns it.
- ``reward`` and ``driver`` run on the CPU of every rank of the actor's pool.

Colocation switches (3D-HybridEngine). On a colocated pool each GPU node needs one of three
memory states: ``generate`` (engine weights and KV cache resident; the actor's and critic's
gradients and optimizer state on the host; every model role's parameters stay), ``sync``
(engine weights resident to receive the actor's, training state still on the host) or
``train`` (the engine has released its memory, or all but its weights under
``lora.push=adapter``: ``holds``; every model role fully resident). A stage
whose node needs another state than the previous GPU node left carries the ``Switch``, a
value the runtime executes as it stands (``hybridflow/runtime/switches.py``). The step
repeats, so it starts in the state its last GPU node (``sync_weights``) leaves.

Memory that does not fit the device is a warning, not an error: the estimate errs high.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfschema.model import ModelConfig
from hybridflow.config import (
    HybridflowConfig,
    enabled_roles,
    frozen_gpus,
    frozen_layout,
    frozen_layout_key,
    frozen_paths,
)
from hybridflow.graph import DRIVER, Graph, Node
from hybridflow.memory import GIB, MemoryEstimate, engine_keeps_weights, pool_memory
from hybridflow.model_size import count_parameters

if TYPE_CHECKING:
    from hybridflow.algorithms.recipes import AlgorithmSpec
    from reshard.stats import Bandwidth, PlanStats

__all__ = [
    "ExecutionPlan",
    "FrozenModel",
    "frozen_models",
    "Placement",
    "ResourcePool",
    "Stage",
    "Switch",
    "WeightSync",
    "lower",
    "place",
    "holds",
    "satisfies",
    "start_mode",
    "switch",
    "trained_roles",
]

logger = logging.getLogger(__name__)

COLOCATED, ACTOR_POOL, ROLLOUT_POOL = "colocated", "actor", "rollout"
MODEL_ROLES = ("actor", "reference", "critic", "reward_model", "teacher")
CPU_ROLES = ("reward", DRIVER)
GENERATE_OPS = ("generate", "generate_greedy")
SYNC_OP = "sync_weights"


# ----------------------------------------------------------------------- placement


@dataclass(frozen=True, kw_only=True)
class ResourcePool:
    """GPUs that run some roles; ranks are global and contiguous."""

    name: str
    """colocated, actor or rollout."""
    num_gpus: int
    """GPUs in the pool."""
    gpus_per_node: int
    """GPUs per node (``rollout.gpus_per_node``)."""
    first_rank: int
    """Global rank of the pool's first GPU."""
    roles: tuple[str, ...]
    """Roles on the pool, in graph.ROLES order."""

    @property
    def ranks(self) -> range:
        """Global ranks of the pool."""
        return range(self.first_rank, self.first_rank + self.num_gpus)

    @property
    def num_nodes(self) -> int:
        """Nodes the pool spans (a pool smaller than a node takes one)."""
        return -(-self.num_gpus // self.gpus_per_node)

    def describe(self) -> str:
        """``colocated: 64 GPUs on 8 nodes, ranks 0-63: actor, rollout, reward, driver``."""
        nodes = "node" if self.num_nodes == 1 else "nodes"
        return (
            f"{self.name}: {self.num_gpus} GPUs on {self.num_nodes} {nodes}, "
            f"{_ranks_text(self.ranks)}: {', '.join(self.roles)}"
        )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which pool of GPUs each role runs on."""

    mode: str
    """rollout.placement: colocated or separate."""
    pools: tuple[ResourcePool, ...]
    """The pools, actor's first."""
    rollout_ranks: int
    """Engine ranks (rollout.tp * num_replicas); in a colocated pool, its first ones."""
    role_ranks: tuple[tuple[str, int], ...] = ()
    """(model role, world size) of roles whose layout is smaller than their pool."""

    @property
    def roles(self) -> tuple[str, ...]:
        """Every placed role."""
        return tuple(role for pool in self.pools for role in pool.roles)

    @property
    def num_gpus(self) -> int:
        """GPUs of all pools."""
        return sum(pool.num_gpus for pool in self.pools)

    def pool_of(self, role: str) -> ResourcePool:
        """The pool ``role`` runs on; KeyError naming the placed roles."""
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise KeyError(f"role {role!r} is not placed; placed roles: {', '.join(self.roles)}")

    def ranks_of(self, role: str) -> range:
        """Global ranks running ``role`` (the engine ranks, for rollout)."""
        pool = self.pool_of(role)
        count = self.rollout_ranks if role == "rollout" else dict(self.role_ranks).get(role)
        return pool.ranks if count is None else range(pool.first_rank, pool.first_rank + count)

    def describe(self) -> list[str]:
        """A header line and one line per pool."""
        lines = [f"placement {self.mode}, {self.num_gpus} GPUs:"]
        lines += [f"  {pool.describe()}" for pool in self.pools]
        partial = [r for r in ("rollout", *dict(self.role_ranks)) if len(self.ranks_of(r)) < self.pool_of(r).num_gpus]
        lines += [
            f"  {role} on {_ranks_text(self.ranks_of(role))} of pool {self.pool_of(role).name} only" for role in partial
        ]
        return lines


def _ranks_text(ranks: range) -> str:
    """``rank 3`` or ``ranks 0-63``."""
    return f"rank {ranks.start}" if len(ranks) == 1 else f"ranks {ranks.start}-{ranks.stop - 1}"


def _check_fits(cfg: HybridflowConfig, role: str, pool: str, pool_size: int) -> None:
    layout = enabled_roles(cfg)[role]
    if layout.world_size <= pool_size:
        return
    model_parallel = layout.tp * layout.pp * layout.cp
    fix = (
        f"lower {role}.parallel.dp to {pool_size // model_parallel} or less"
        if model_parallel <= pool_size
        else f"lower {role}.parallel.tp*pp*cp = {model_parallel} to at most {pool_size}"
    )
    raise ValueError(
        f"{role}.parallel needs tp*pp*cp*dp = {layout.tp}*{layout.pp}*{layout.cp}*{layout.dp} = "
        f"{layout.world_size} GPUs, more than the {pool_size} of the {pool} pool it runs on "
        f"(actor.parallel's world size); {fix}, or grow actor.parallel"
    )


def place(cfg: HybridflowConfig) -> Placement:
    """Pools and roles from ``cfg.rollout.placement``; ValueError naming the key that does
    not fit (see the module docstring for the rules)."""
    frozen = frozen_paths(cfg)
    own = frozen_gpus(cfg)  # frozen models on GPUs of their own: a pool each, after the others
    models = tuple(enabled_roles(cfg)) + tuple(role for role, path in frozen.items() if path and role not in own)
    world = cfg.actor.parallel.world_size
    colocated = cfg.rollout.placement == COLOCATED
    for role in enabled_roles(cfg):
        _check_fits(cfg, role, COLOCATED if colocated else ACTOR_POOL, world)
    per_node, ranks = cfg.rollout.gpus_per_node, cfg.rollout.num_ranks
    if colocated:
        roles = (*models, "rollout", *CPU_ROLES)
        pools = (ResourcePool(name=COLOCATED, num_gpus=world, gpus_per_node=per_node, first_rank=0, roles=roles),)
    else:
        pools = (
            ResourcePool(
                name=ACTOR_POOL, num_gpus=world, gpus_per_node=per_node, first_rank=0, roles=(*models, *CPU_ROLES)
            ),
            ResourcePool(
                name=ROLLOUT_POOL, num_gpus=ranks, gpus_per_node=per_node, first_rank=world, roles=("rollout",)
            ),
        )
    pools += tuple(
        ResourcePool(name=role, num_gpus=len(ranks), gpus_per_node=per_node, first_rank=ranks.start, roles=(role,))
        for role, ranks in own.items()
    )
    smaller = tuple(
        (role, layout.world_size) for role, layout in enabled_roles(cfg).items() if layout.world_size < world
    )
    return Placement(mode=cfg.rollout.placement, pools=pools, rollout_ranks=ranks, role_ranks=smaller)


# ----------------------------------------------------------------------- frozen models


@dataclass(frozen=True, kw_only=True)
class FrozenModel:
    """A model the graph calls without training it: the reference policy, a reward model."""

    role: str
    """Its graph role: reference or reward_model."""
    model: ModelConfig
    """Its architecture (a reward model's, from its directory's config.json)."""
    source: str
    """Where its weights come from, in words."""
    layout: str
    """The layout it runs under, as a line."""
    offload: bool = False
    """On the host between its uses (its memory free for generation and training)."""

    def describe(self) -> str:
        """``reward_model: qwen3 score head, 0.6B parameters, from DIR; megatron ...; resident``."""
        head = "score head" if self.model.head == "score" else "LM head"
        params = count_parameters(self.model)["total"]
        where = "on the host between uses" if self.offload else "resident"
        what = f"{self.model.family} ({head}, {_count_text(params)} parameters)"
        return f"{self.role}: {what} from {self.source}; {self.layout}; {where}"


def _count_text(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def frozen_models(cfg: HybridflowConfig) -> tuple[FrozenModel, ...]:
    """The frozen models ``cfg`` runs. A reward model's architecture is read from its
    directory's config.json; one not there yet (a recipe planned before the download) is taken
    to be the actor's under a score head, with a warning."""
    out = []
    if cfg.reference.enabled:
        layout = frozen_layout_text(cfg, "reference")
        out.append(
            FrozenModel(
                role="reference",
                model=cfg.model.architecture,
                source=_reference_source(cfg),
                layout=layout,
                offload=cfg.reference.offload,
            )
        )
    if cfg.reward_model.path:
        out.append(
            FrozenModel(
                role="reward_model",
                model=_reward_model_architecture(cfg),
                source=cfg.reward_model.path,
                layout=frozen_layout_text(cfg, "reward_model"),
                offload=cfg.reward_model.offload,
            )
        )
    if cfg.judge.path:
        out.append(
            FrozenModel(
                role="judge",
                model=_judge_architecture(cfg),
                source=cfg.judge.path,
                layout=judge_text(cfg),
            )
        )
    if cfg.distillation.teacher_path:
        out.append(
            FrozenModel(
                role="teacher",
                model=_teacher_architecture(cfg),
                source=cfg.distillation.teacher_path,
                layout=frozen_layout_text(cfg, "teacher"),
                offload=cfg.distillation.offload,
            )
        )
    return tuple(out)


def _reference_source(cfg: HybridflowConfig) -> str:
    """Where the reference's weights come from: the actor's starting point."""
    if cfg.sft.steps > 0:
        return "the SFT warm-up's weights (checkpoints/sft)"
    if cfg.model.pretrained:
        return f"model.path {cfg.model.path}"
    return "the actor's random initial weights (checkpoints/initial)"


def trainer_text(cfg: HybridflowConfig, layout) -> str:
    """A role's trainer and layout in a few words: ``megatron tp=.. pp=..`` or ``fsdp2 dp=N``."""
    return TRAINER_TEXT[cfg.actor.backend].layout(layout)


def trainer_line(cfg: HybridflowConfig, role: str, layout) -> str:
    """``plan``'s summary line of a role: its layout and how its vocabulary is held."""
    return f"{role}: {TRAINER_TEXT[cfg.actor.backend].summary(cfg, layout)}"


def _fsdp2_text(layout) -> str:
    sequence = f" sp={layout.cp} (Ulysses)" if layout.cp > 1 else ""
    return f"fsdp2 dp={layout.dp}{sequence} (every parameter sharded over {layout.world_size} ranks)"


@dataclass(frozen=True, kw_only=True)
class TrainerText:
    """How ``plan``, the start line and the logs name a trainer backend's layout."""

    layout: Callable[[Any], str]
    """A role's layout -> its words in the stages and the start line."""
    summary: Callable[[HybridflowConfig, Any], str]
    """(cfg, a role's layout) -> the rest of the role's line in ``plan``'s summary."""


TRAINER_TEXT = {
    "megatron": TrainerText(
        layout=lambda layout: f"megatron {layout.describe()}",
        summary=lambda cfg, layout: f"{layout.describe()}; padded vocab {layout.padded_vocab_size(cfg.model)}",
    ),
    "fsdp2": TrainerText(
        layout=_fsdp2_text,
        summary=lambda cfg, layout: f"{_fsdp2_text(layout)}; transformers' class, vocab {cfg.model.vocab_size}",
    ),
}
"""Each trainer backend's words (``hybridflow.runtime.trainers.TRAINERS`` runs them)."""


def frozen_layout_text(cfg: HybridflowConfig, role: str) -> str:
    """``megatron tp=.. ... (its own: reward_model.parallel)``, ``(the actor's)``, or on GPUs of
    its own ``(its own GPUs: reward_model.gpus)``."""
    layout = frozen_layout(cfg, role)
    whose = f"its own: {frozen_layout_key(role)}" if layout != cfg.actor.parallel else "the actor's"
    if role in frozen_gpus(cfg):
        whose = f"its own GPUs: {frozen_layout_key(role).removesuffix('.parallel')}.gpus"
    return f"{trainer_text(cfg, layout)} ({whose})"


def judge_text(cfg: HybridflowConfig) -> str:
    """``sglang engine, tp=1, bfloat16 (on the actor's first GPUs, driven by rank 0)`` or, on GPUs
    of its own, ``... x2 replicas (its own GPUs: judge.gpus)``."""
    judge = cfg.judge
    engine = f"{judge.engine} engine, tp={judge.tp}, {judge.dtype}"
    if "judge" in frozen_gpus(cfg):
        return f"{engine} x{judge.gpus // judge.tp} replica(s) (its own GPUs: judge.gpus)"
    return f"{engine} (on the actor's first GPUs, driven by rank 0)"


def _architecture(key: str, path: str, planned: ModelConfig, check) -> ModelConfig:
    """The architecture of the frozen model at ``path`` (``check(path)`` refuses in one line what
    cannot serve), or ``planned`` with a warning where it is not downloaded yet."""
    if not Path(path).expanduser().exists():
        logger.warning("%s=%s does not exist here: planned as the actor's architecture", key, path)
        return planned
    return check(Path(path).expanduser())[1]


def _judge_architecture(cfg: HybridflowConfig) -> ModelConfig:
    from hfschema.model_source import judge_source

    return _architecture("judge.path", cfg.judge.path, cfg.model.architecture, lambda p: judge_source(p, cfg.judge.tp))


def _teacher_architecture(cfg: HybridflowConfig) -> ModelConfig:
    from hfschema.model_source import teacher_source

    check = lambda p: teacher_source(p, cfg.model.vocab_size)  # noqa: E731
    return _architecture("distillation.teacher_path", cfg.distillation.teacher_path, cfg.model.architecture, check)


def _reward_model_architecture(cfg: HybridflowConfig) -> ModelConfig:
    from hfschema.model import as_score_model
    from hfschema.model_source import reward_model_source

    planned = as_score_model(cfg.model.architecture)  # the actor's under a score head
    return _architecture("reward_model.path", cfg.reward_model.path, planned, reward_model_source)


# ----------------------------------------------------------------------- stages


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One node of the graph, placed: where it runs, under which layout, after which switch."""

    node: Node
    """The graph node."""
    pool: str
    """Name of the pool it runs on."""
    ranks: range
    """Global ranks that run it."""
    layout: str
    """The layout it runs under, as a line."""
    switch: Switch | None = None
    """The colocation switch before it (what moves between GPU and host); None = none."""

    def describe(self, index: int) -> list[str]:
        """``3. name [role] op on colocated ranks 0-63 (layout)`` and the switch, if any."""
        node = self.node
        head = f"{index}. {node.name} [{node.role}] {node.op} on {self.pool} {_ranks_text(self.ranks)} ({self.layout})"
        return [head] + ([f"     switch before it: {self.switch.describe()}"] if self.switch else [])


def _engine_text(cfg: HybridflowConfig) -> str:
    """The rollout engines in one line, e.g. ``sglang tp=8 ep=8 x8 replicas (64 ranks)``."""
    return cfg.rollout.engines_text()


def _role_layouts(cfg: HybridflowConfig) -> dict[str, str]:
    layouts = {role: trainer_text(cfg, layout) for role, layout in enabled_roles(cfg).items()}
    for role in ("reference", "reward_model", "teacher"):
        layouts[role] = frozen_layout_text(cfg, role)
    layouts["judge"] = judge_text(cfg)
    layouts["rollout"] = _engine_text(cfg)
    for role in CPU_ROLES:
        layouts[role] = "CPU, on each of its ranks"
    return layouts


def _node_place(cfg: HybridflowConfig, placement: Placement, node: Node) -> tuple[str, range, str]:
    """(pool name, ranks, layout line) of ``node``; a weight sync spans both sides."""
    if node.op == SYNC_OP:
        actor, engine = placement.ranks_of("actor"), placement.ranks_of("rollout")
        ranks = range(min(actor.start, engine.start), max(actor.stop, engine.stop))
        pools = dict.fromkeys([placement.pool_of("actor").name, placement.pool_of("rollout").name])
        return ("+".join(pools), ranks, f"actor {trainer_text(cfg, cfg.actor.parallel)} -> rollout {_engine_text(cfg)}")
    layout = _role_layouts(cfg)[node.role]
    return placement.pool_of(node.role).name, placement.ranks_of(node.role), layout


def _mode(node: Node) -> str | None:
    """What a colocated GPU must hold for ``node``: generate, sync, train, or None (CPU)."""
    if node.op in GENERATE_OPS or node.role == "rollout":
        return "generate"
    if node.op == SYNC_OP:
        return "sync"
    return "train" if node.role in MODEL_ROLES else None


ENGINE_TAGS = ("weights", "kv_cache", "cuda_graph")
"""The engine's releasable memory, by SGLang's tags."""
_HOLDS = {"generate": ENGINE_TAGS, "sync": ("weights",), "train": ()}
"""What of the engine's memory each mode keeps resident."""


def holds(cfg: HybridflowConfig, mode: str) -> tuple[str, ...]:
    """What of the engine's memory ``mode`` keeps resident under ``cfg`` (``lora.push=adapter``:
    the weights stay while the actor trains, ``memory.engine_keeps_weights``)."""
    if mode == "train" and engine_keeps_weights(cfg):
        return ("weights",)
    return _HOLDS[mode]


@dataclass(frozen=True, kw_only=True)
class Switch:
    """A colocation switch: what moves between the GPUs and the host, in this order."""

    source: str
    """The mode the GPUs leave: generate, sync or train."""
    target: str
    """The mode they enter."""
    offload: tuple[str, ...] = ()
    """Trained roles whose gradients and optimizer state go to the host."""
    engine_release: tuple[str, ...] = ()
    """Engine memory released (SGLang tags)."""
    engine_resume: tuple[str, ...] = ()
    """Engine memory taken back."""
    restore: tuple[str, ...] = ()
    """Trained roles whose gradients and optimizer state come back."""

    def describe(self) -> str:
        """E.g. ``actor grads+optimizer -> host; engine weights resume``."""
        parts = []
        if self.offload:
            parts.append(f"{', '.join(self.offload)} grads+optimizer -> host")
        if self.engine_release:
            parts.append(f"engine releases {_tags_text(self.engine_release)}")
        if self.engine_resume:
            parts.append(f"engine {_tags_text(self.engine_resume)} resume")
        if self.restore:
            parts.append(f"{', '.join(self.restore)} grads+optimizer <- host")
        return "; ".join(parts)


def _tags_text(tags: tuple[str, ...]) -> str:
    words = (["weights"] if "weights" in tags else []) + (["KV cache"] if "kv_cache" in tags else [])
    return "+".join(words)


def trained_roles(cfg: HybridflowConfig) -> tuple[str, ...]:
    """Roles with gradients and optimizer state (the reference has neither: it stays resident)."""
    return tuple(role for role in enabled_roles(cfg) if role in ("actor", "critic"))


def switch(cfg: HybridflowConfig, source: str | None, target: str) -> Switch:
    """The switch from mode ``source`` (None: everything resident, as at start) to ``target``."""
    trained = trained_roles(cfg)
    leaving_train = source in ("train", None) and target != "train"
    held = holds(cfg, source) if source is not None else ENGINE_TAGS
    wanted = holds(cfg, target)
    return Switch(
        source=source or "start",
        target=target,
        offload=trained if leaving_train else (),
        engine_release=tuple(t for t in held if t not in wanted),
        engine_resume=tuple(t for t in wanted if t not in held),
        restore=trained if target == "train" and source not in ("train", None) else (),
    )


def _stages(cfg: HybridflowConfig, placement: Placement, graph: Graph) -> tuple[Stage, ...]:
    order = graph.topological_order()
    colocated = placement.mode == COLOCATED
    places = [_node_place(cfg, placement, node) for node in order]
    modes = [_mode(node) if pool == COLOCATED else None for node, (pool, _, _) in zip(order, places)]
    # the step repeats: what the GPUs hold at its start is what its last GPU node left there
    current = next((m for m in reversed(modes) if m is not None), None)
    stages = []
    for node, mode, (pool, ranks, layout) in zip(order, modes, places):
        change = None
        if colocated and mode is not None and not satisfies(current, mode):
            change, current = switch(cfg, current, mode), mode
        stages.append(Stage(node=node, pool=pool, ranks=ranks, layout=layout, switch=change))
    return tuple(stages)


def satisfies(current: str | None, needed: str) -> bool:
    """Whether GPUs in mode ``current`` can run a node that needs ``needed`` (generating GPUs
    also hold what a sync needs: the engine's weights)."""
    return needed == current or (current == "generate" and needed == "sync")


def start_mode(stages: tuple[Stage, ...]) -> str | None:
    """The mode a step starts in: what its last node on the colocated GPUs leaves (the step repeats)."""
    modes = (_mode(s.node) for s in reversed(stages) if s.pool == COLOCATED)
    return next((mode for mode in modes if mode is not None), None)


# ----------------------------------------------------------------------- weight sync


@dataclass(frozen=True, kw_only=True)
class WeightSync:
    """A sync_weights node and the reshard plan's statistics (None when not planned)."""

    node: str
    """Name of the sync_weights node."""
    stats: PlanStats | None
    """What the actor -> rollout reshard moves; None with ``with_reshard=False``."""
    seconds: float = 0.0
    """Time the planner took."""

    bandwidth: Bandwidth | None = None
    """The link speeds the simulated time assumes."""
    adapters_only: bool = False
    """``lora.push=adapter``: the plan moves the base only while an engine lacks it; steps push adapters."""

    def describe(self) -> list[str]:
        """A header and ``PlanStats.describe()``; nothing when the sync was not planned."""
        if self.stats is None:
            return []
        bw = self.bandwidth
        header = (
            f"weight sync actor -> rollout, planned from shapes in {self.seconds:.2f} s "
            f"(node {self.node}; time at {bw.intra_node_gbps:g} GB/s intra-, "
            f"{bw.inter_node_gbps:g} GB/s inter-node per rank):"
        )
        lines = [header, *self.stats.describe().splitlines()]
        if self.adapters_only:
            lines.append(
                "  lora.push=adapter: this reshard moves the frozen base before the first step and again "
                "after an engine restart or a resume (colocated engines keep it resident while the actor "
                "trains); each step pushes only the adapters (SGLang's LoRA API)"
            )
        return lines


def _weight_syncs(cfg: HybridflowConfig, graph: Graph, with_reshard: bool) -> tuple[WeightSync, ...]:
    nodes = [node.name for node in graph.topological_order() if node.op == SYNC_OP]
    if not cfg.model.has_tensor_list:
        with_reshard = False  # an unmapped architecture planned before its directory exists
    if not nodes or not with_reshard:
        return tuple(WeightSync(node=name, stats=None) for name in nodes)
    from hybridflow.weight_sync import plan_weight_sync  # here: reshard is the slow import

    bandwidth = cfg.rollout.bandwidth()
    start = time.perf_counter()
    stats = plan_weight_sync(cfg).stats
    seconds = time.perf_counter() - start
    logger.debug("planned the actor -> rollout weight sync in %.3f s", seconds)
    return tuple(
        WeightSync(node=name, stats=stats, seconds=seconds, bandwidth=bandwidth, adapters_only=cfg.lora.pushes_adapters)
        for name in nodes
    )


# ----------------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True)
class ExecutionPlan:
    """A config lowered: what runs where, in which order, in how much memory."""

    spec: AlgorithmSpec
    """The algorithm's ``AlgorithmSpec`` (estimator, loss, roles)."""
    graph: Graph
    """The dataflow graph of one step."""
    placement: Placement
    """Pools of GPUs and the roles on them."""
    stages: tuple[Stage, ...]
    """The graph's nodes in topological order, placed."""
    weight_syncs: tuple[WeightSync, ...]
    """Every sync_weights node with the reshard plan's statistics."""
    memory: tuple[MemoryEstimate, ...]
    """Per-GPU memory of each pool, per phase."""
    frozen: tuple[FrozenModel, ...] = ()
    """The models the graph calls without training them (reference, reward model)."""

    @property
    def start_mode(self) -> str | None:
        """The mode each step starts in (None: no GPU node, or not colocated)."""
        return start_mode(self.stages) if self.placement.mode == COLOCATED else None

    def memory_of(self, pool: str) -> MemoryEstimate:
        """The estimate of pool ``pool``."""
        return next(m for m in self.memory if m.pool == pool)

    @property
    def fits(self) -> bool:
        """Whether every pool's peak fits its device."""
        return all(m.fits for m in self.memory)

    def verdict(self) -> list[str]:
        """The answer first: whether the run fits, then each pool's peak per GPU and, where it
        does not fit, the settings that would shrink it."""
        pools = self.placement.pools
        nodes = sum(pool.num_nodes for pool in pools)
        device = max(m.device_bytes for m in self.memory) / GIB
        gpus = self.placement.num_gpus
        where = f"{gpus} GPU{'s' * (gpus > 1)} on {nodes} node{'s' * (nodes > 1)} of {device:g} GiB"
        lines = [f"{'fits' if self.fits else 'DOES NOT FIT'}: {where} ({self.placement.mode})"]
        for estimate in self.memory:
            others = ", ".join(
                f"{phase} {total / GIB:.2f}" for phase, total in estimate.totals.items() if phase != estimate.peak_phase
            )
            lines.append(
                f"  pool {estimate.pool}: peak {estimate.peak_bytes / GIB:.2f} GiB per GPU in "
                f"{estimate.peak_phase}{f' ({others})' if others else ''}"
            )
            if not estimate.fits:
                lines.append(f"    {estimate.warning().removeprefix(f'WARNING pool {estimate.pool}: ')}")
        return lines

    def describe(self) -> list[str]:
        """Graph, placement, stages with switches, memory per pool and phase, weight sync."""
        lines = [
            f"graph {self.graph.name} ({len(self.graph.nodes)} nodes, data: "
            f"{', '.join(self.graph.data_fields) or '-'}):"
        ]
        lines += [f"  {line}" for line in self.graph.to_text().splitlines()]
        lines += self.placement.describe()
        if self.frozen:
            lines.append("frozen models:")
            lines += [f"  {model.describe()}" for model in self.frozen]
        lines.append("stages:")
        for i, stage in enumerate(self.stages, 1):
            lines += [f"  {line}" for line in stage.describe(i)]
        for estimate in self.memory:
            lines += estimate.describe()
        for sync in self.weight_syncs:
            lines += sync.describe()
        return lines


def lower(cfg: HybridflowConfig, *, with_reshard: bool = True, device_memory_gib: float = 80.0) -> ExecutionPlan:
    """Check and place ``cfg``'s algorithm; ValueError (GraphError for graph faults) naming
    the key at fault. ``with_reshard=False`` skips planning the weight sync (~1 s at 671B)."""
    from hybridflow.algorithms.recipes import algorithm_spec, build_graph

    graph = build_graph(cfg)  # check_roles, check_sampling, then validates the graph
    spec = algorithm_spec(cfg)
    placement = place(cfg)
    graph.validate(placement.roles)  # every node's role has a pool
    frozen = frozen_models(cfg)
    architectures = {m.role: m.model for m in frozen if m.role != "reference"}  # the reference is the actor's
    memory = tuple(
        pool_memory(cfg, pool.roles, pool=pool.name, device_memory_gib=device_memory_gib, frozen=architectures)
        for pool in placement.pools
    )
    for estimate in memory:
        if not estimate.fits:
            logger.warning("%s", estimate.warning())
    return ExecutionPlan(
        spec=spec,
        graph=graph,
        placement=placement,
        stages=_stages(cfg, placement, graph),
        weight_syncs=_weight_syncs(cfg, graph, with_reshard),
        memory=memory,
        frozen=frozen,
    )
