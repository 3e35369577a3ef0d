"""Actor -> rollout weight sync at run time: a reshard plan executed on live parameters.

``rollout.sync_route=sliced`` (the default) moves each engine rank only its own share:

```
every actor rank                                   actor process r (colocated with engine rank r)
  global_named_parameters(actor)  ──execute(plan)──►  buffers shaped as SGLang rank r's tensors
                                                       │ handles.prepare_rank_payload: pad, cast,
                                                       │ share (CUDA-IPC handle / shared memory)
                                 gather the handles (bytes) to every replica's driver
                                                       ▼
             replica k's driver: engine.push_rank_payloads([payload k*tp, ..., payload k*tp+tp-1])
                                   scheduler r maps rank r's tensors from process r and copies
                                   (process r holds its buffers until then: barrier)
```

Every replica receives every push (``sync/replica{k}/engine_bytes``). A driver whose engine
is lost meanwhile (``EngineLost``) says so in the gather that ends the push; every process then
replaces the lost engines together (``recovery``) and the push runs again.

``rollout.sync_route=full`` is the baseline: the plan gathers every tensor whole under its
Hugging Face name on each replica's driver (unsharded replicas: one each), and the engine's own
loader slices it.

``lora.push=adapter`` (SGLang engines): the plan moves the frozen base, unmerged, only while an
engine lacks it (the first push, and again after an engine restart; colocated GPU engines keep
their weights while the actor trains, ``lowering.holds``); every push then hands each replica's
driver the adapters in PEFT layout, which its engine loads through SGLang's adapter API:

```
every actor rank: adapter_push (all-gather over the actor ranks: each holds them whole)
colocated   the drivers are actor ranks: they load what they gathered
separate    actor rank 0 announces names, shapes, dtypes and the PEFT config; actor rank
            k % actors sends replica k's driver one flat buffer per dtype (the link: NCCL on
            GPUs), so the sends spread over the actor ranks' links
```

The plans come from ``hybridflow.weight_sync``, the same ones ``hybridflow plan`` prints,
computed once from shapes. The weights themselves cross processes once, in the reshard; what
the driver gathers for a sliced push is a few hundred bytes per tensor.
"""

from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from hfschema.engines import ENGINES, resolve
from hybridflow.config import HybridflowConfig
from hybridflow.lowering import holds
from hybridflow.rollout.base import AdapterReceiver, EngineLost, SlicedWeightReceiver, require, weight_digest
from hybridflow.runtime.channel import Channel
from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.replicas import (
    ReplicaFailed,
    driver_rank,
    replica_of,
)
from hybridflow.weight_sync import WeightSyncPlan, plan_weight_sync
from reshard.executor import WIRE_DTYPES, ProcessMap, execute

__all__ = ["EngineSync", "drops_weights"]

logger = logging.getLogger(__name__)

"""The process that drives the rollout engine."""


class _Pushed(NamedTuple):
    """What each process tells every other after a push (a few numbers)."""

    replica: int | None
    """The replica this process drives, or None."""
    engine_bytes: float
    """Bytes its engine received."""
    plan_bytes: int
    """Bytes the reshard plan delivered to this process (received and copied locally)."""
    relayed_bytes: int
    """Bytes it forwarded for others."""
    worst: float | None
    """The refit verifier's worst relative difference on this driver, or None."""
    lost: str | None = None
    """Why this driver's engine was lost during the push (``EngineLost``), or None."""
    adapter_bytes: float = 0.0
    """Bytes of LoRA adapters its engine loaded (``lora.push=adapter``)."""


def _lost(gathered: list[_Pushed]) -> list[tuple[int, int, str]]:
    """[(driver rank, replica, cause)] of the engines lost during a push."""
    return [(rank, g.replica, g.lost) for rank, g in enumerate(gathered) if g.lost is not None]


class EngineSync:
    """Moves one actor's weights into the engines; every process of ``channel`` calls ``push``
    together (colocated: the actor ranks; separate: the actor ranks, which send, and the engine
    ranks, which receive their own shares and hand them to their replica's driver).

    Construct it on every process together (the processes that hold destination ranks gather
    the engines' parameter tables from their drivers); ``engines`` is this process's
    ``EngineClient``, whose engine (a replica driver's; None elsewhere) it pushes to, the one a
    restart replaced included; ``source_params`` is None on an engine rank.
    """

    def __init__(
        self,
        cfg: HybridflowConfig,
        *,
        channel: Channel,
        device: torch.device,
        engines: EngineClient | None = None,
        source_params=None,
        adapters=None,
    ) -> None:
        self.cfg = cfg
        self.channel = channel
        self.device = device
        self.route = cfg.rollout.sync_route
        self.sync: WeightSyncPlan = plan_weight_sync(cfg)
        self.plan = self.sync.plan
        actors = cfg.actor.parallel.world_size
        # colocated: destination rank r shares actor rank r's device (the config checked r < world);
        # separate: destination rank r is joint rank actors + r, a process of its own
        self.offset = actors if channel.separate else 0
        self.processes = ProcessMap(
            source=tuple(range(actors)),
            destination=tuple(self.offset + r for r in range(self.sync.destination.num_ranks)),
        )
        self.dtype = WIRE_DTYPES[cfg.rollout.dtype]
        self.source_params = source_params
        self.adapters = adapters
        """``lora.push=adapter`` on an actor rank: a collective call over the actor ranks that
        returns the actor's adapters as PEFT (tensors, config); None elsewhere."""
        self.pushes_adapters = cfg.lora.pushes_adapters
        """The engines get the base once and adapters every push (else merged weights)."""
        self._base_held = False
        """Every engine holds the base the plan last pushed (adapter pushes then move nothing else)."""
        self.engines = engines
        self.pushes = 0
        """Counted pushes so far (the refit checks' schedule)."""
        self.restarts = None
        """This process's ``recovery.EngineRestarts`` (None: an engine lost in a push stops the run)."""
        holds_destination = not channel.separate or source_params is None
        engine = self.engine
        # what the routes need of the engine (rollout.base's protocols), named before any push
        if engine is not None and self.route == "sliced":
            require(engine, SlicedWeightReceiver, "rollout.sync_route=sliced")
        if engine is not None and self.pushes_adapters:
            require(engine, AdapterReceiver, "lora.push=adapter")
        self.engine_params = self._engine_params() if self.route == "sliced" and holds_destination else None
        self.engine_drops_weights = drops_weights(cfg, gpu=torch.cuda.is_available())
        """Whether the engine's weights are released (and lose their values) after every
        generation, so every step must push, even one that left the actor unchanged."""

    @property
    def engine(self):
        """This process's replica's engine on its driver, else None."""
        return None if self.engines is None else self.engines.engine

    def _engine_params(self) -> list[dict]:
        """Every engine rank's parameter table (engine-major: replica k's ranks at k*tp..), read by
        each replica's driver from its running engine and gathered on every process of the default
        group (the actor ranks when colocated, the engine ranks when separate)."""
        mine = (replica_of(self.cfg, dist.get_rank()), self.engine.rank_params()) if self.engine else (None, [])
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        tables = dict(item for item in gathered if item[0] is not None)
        return [table for replica in sorted(tables) for table in tables[replica]]

    def _destination(self) -> int | None:
        """The destination (engine) rank this process plays, or None."""
        rank = self.channel.rank - self.offset
        return rank if 0 <= rank < len(self.processes.destination) else None

    def _buffers(self, dest: int | None) -> dict[str, torch.Tensor]:
        """This process's destination tensors, on its device (on a GPU they are shared with the
        engine as CUDA-IPC handles, so they must live there)."""
        if dest is None:
            return {}
        shapes = self.sync.destination.param_shapes(dest)
        return {name: torch.zeros(shape, dtype=self.dtype, device=self.device) for name, shape in shapes.items()}

    def push(self, *, counted: bool = True, announce: bool = True) -> dict[str, float]:
        """Execute the plan, hand the engines their tensors, flush their caches. ``counted=False``:
        a push that re-fills a restarted engine, which leaves the refit checks' schedule as it was;
        ``announce=False``: the engine ranks are already in this push with us (a restart inside a
        call). An engine lost meanwhile is restarted (``restarts``) and the push runs again."""
        started = time.perf_counter()
        if announce and self.source_params is not None:  # an actor rank; separate: the engine ranks receive with us
            self.channel.announce(("push",))
        verify = self._verifying()  # the retries check what the lost push would have checked
        gathered = self._push_once(verify)
        while lost := _lost(gathered):
            if self.restarts is None:
                rank, replica, cause = lost[0]
                raise ReplicaFailed(
                    f"rollout replica {replica} (driven by rank {rank}) lost its engine during a "
                    f"weight push: {cause}; rerun the same command to resume from the newest checkpoint"
                )
            self.restarts.replace(lost)  # every process together; ReplicaFailed past the budget
            gathered = self._push_once(verify)
        self.pushes += counted
        return self._metrics(gathered, time.perf_counter() - started)

    def engines_replaced(self) -> None:
        """Some engine was restarted (empty): the next push moves the base again (collective
        knowledge: every process is told, ``recovery.EngineRestarts.replace``)."""
        self._base_held = False

    def _push_once(self, verify: bool) -> list[_Pushed]:
        """One try of the push; every process's ``_Pushed``, gathered on every process."""
        if not self.pushes_adapters:
            return self.channel.gather(self._push_base(verify))
        if self._base_held:  # the engines hold the base (the plan keeps it resident): adapters only
            return self._push_adapters(_Pushed(self._replica(), 0.0, 0, 0, None))
        return self._push_adapters(self._push_base(verify))

    def _replica(self) -> int | None:
        """The replica this process drives, or None."""
        return replica_of(self.cfg, dist.get_rank()) if self.engine else None

    def _push_base(self, verify: bool) -> _Pushed:
        """The plan's push of the actor's weights (merged, or the base under ``lora.push=adapter``);
        this process's ``_Pushed`` (collective)."""
        dest = self._destination()
        sources = self.source_params() if self.source_params is not None else None
        if sources is not None and not self.pushes:
            check_source_params(self.sync.source, sources, rank=dist.get_rank())
        buffers = self._buffers(dest)
        report = execute(
            self.plan,
            self.processes,
            sources=sources,
            destinations=buffers,
            bucket_bytes=self.cfg.rollout.reshard_bucket_mb << 20,
            link=self.channel.link,
        )
        pushed, worst, lost = 0.0, None, None
        # the engine's weights are resident: the plan's switch before sync_weights resumed them
        if self.engine_params is not None:
            pushed, worst, lost = self._push_sliced(dest, buffers, verify)
        elif self.route == "full":
            pushed = self._push_full(buffers)
        return _Pushed(
            self._replica(),
            pushed,
            report.bytes_received + report.bytes_copied_locally,
            report.bytes_relayed,
            worst,
            lost,
        )

    def _push_adapters(self, mine: _Pushed) -> list[_Pushed]:
        """The actor's adapters into every replica's engine (collective: every process gathers
        them), after the base push ``mine`` reports, if any; then the gather that ends the push."""
        delivered = self._adapters_on_drivers()
        loaded, lost = 0.0, mine.lost
        if self.engine is not None and lost is None:
            tensors, config = delivered
            try:
                report = self.engine.load_adapter(f"policy_{self.pushes + 1}", tensors, config)
                loaded = float(report.bytes_per_rank[0])
            except EngineLost as error:
                lost = str(error)
        gathered = self.channel.gather(mine._replace(adapter_bytes=loaded, lost=lost))
        self._base_held = not _lost(gathered)
        return gathered

    def _adapters_on_drivers(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The actor's adapters (PEFT tensors, config) on every replica's driver; None on a
        process that is neither an actor rank nor a driver (collective over the channel)."""
        here = self.adapters() if self.adapters is not None else None  # every actor rank
        if not self.channel.separate:
            return here
        layout = self.channel.broadcast(_layout(*here) if self.channel.rank == 0 else None)
        actors, sends, receives, flat = self.channel.actors, [], [], None
        for replica in range(self.cfg.rollout.num_replicas):
            source, driver = replica % actors, self.offset + driver_rank(self.cfg, replica)
            if self.channel.rank == source:
                sends += [(buf, driver, tag) for tag, buf in enumerate(_flatten(here[0], layout, self.device))]
            if self.channel.rank == driver:
                flat = [torch.empty(n, dtype=d, device=self.device) for d, n in _flat_sizes(layout)]
                receives += [(buf, source, tag) for tag, buf in enumerate(flat)]
        self.channel.link.exchange(sends, receives)
        return (_unflatten(flat, layout), layout[1]) if flat is not None else None

    def _metrics(self, gathered: list[_Pushed], seconds: float) -> dict[str, float]:
        per_replica, adapters = [0.0] * self.cfg.rollout.num_replicas, [0.0] * self.cfg.rollout.num_replicas
        for g in gathered:
            if g.replica is not None:
                per_replica[g.replica], adapters[g.replica] = g.engine_bytes, g.adapter_bytes
        checked = [g.worst for g in gathered if g.worst is not None]
        return {
            "sync/seconds": seconds,
            "sync/plan_bytes": float(sum(g.plan_bytes for g in gathered)),
            "sync/relayed_bytes": float(sum(g.relayed_bytes for g in gathered)),  # forwarded by engine ranks
            "sync/engine_bytes": float(sum(per_replica)),
            **(
                {
                    "sync/adapter_bytes": float(sum(adapters)),
                    **{f"sync/replica{k}/adapter_bytes": b for k, b in enumerate(adapters)},
                }
                if self.pushes_adapters
                else {}
            ),
            **{f"sync/replica{k}/engine_bytes": b for k, b in enumerate(per_replica)},
            **({"checks/refit_max_rel_diff": max(checked)} if checked else {}),
        }

    def _verifying(self) -> bool:
        """Whether this push reads the engines' weights back (the first, then every
        ``checks.refit_every``-th; the same answer on every process)."""
        every = self.cfg.checks.refit_every
        return self.engine_params is not None and every > 0 and self.pushes % every == 0

    def _push_sliced(
        self, dest: int | None, buffers: dict[str, torch.Tensor], verify: bool
    ) -> tuple[float, float | None, str | None]:
        """Each destination process shares its buffers; each replica's driver pushes its ranks'
        shares (collective over the default group, whose rank r plays destination rank r).
        Returns the bytes pushed; on a driver when ``verify``ing, the refit verifier's worst
        relative difference between what its ranks shared and what its engine now holds; and,
        on a driver whose engine was lost meanwhile, the cause (the collectives still complete:
        the other processes must not wait for it)."""
        traits = ENGINES[self.cfg.rollout.engine]
        prepare_rank_payload = resolve(traits.sliced_payload)
        tp = self.cfg.rollout.tp
        # payloads carry the engine-local rank: replica k's rank j is global destination k*tp + j
        payload, kept = prepare_rank_payload(dest % tp, buffers, self.engine_params[dest]) if buffers else (None, [])
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, payload)  # handles: a few hundred bytes per tensor
        pushed, worst, lost = 0.0, None, None
        try:
            if self.engine is not None:
                first = driver_rank(self.cfg, replica_of(self.cfg, dist.get_rank()))  # the replica's first engine rank
                pushed, lost = self._hand_over(gathered[first : first + tp])
            if verify:  # digests of exactly the engine-layout tensors each rank shared
                shared: list = [None] * dist.get_world_size()
                dist.all_gather_object(
                    shared, {n: weight_digest(t) for n, t in zip(buffers, kept)} if buffers else None
                )
                if self.engine is not None and lost is None:
                    worst = refit_difference(shared[first : first + tp], self.engine.weight_digests())
        finally:
            # each engine read its ranks' tensors straight from their owners: hold them until then
            dist.barrier()
        del kept
        return pushed, worst, lost

    def _hand_over(self, payloads: list) -> tuple[float, str | None]:
        """The driver's push of its ranks' payloads: (bytes pushed, None), or (0, the cause) when
        the engine is lost meanwhile."""
        try:
            return float(sum(self.engine.push_rank_payloads(payloads).bytes_per_rank)), None
        except EngineLost as error:  # its message is the cause: which process, or the timeout
            return 0.0, str(error)

    def _push_full(self, buffers: dict[str, torch.Tensor]) -> float:
        if not buffers or self.engine is None:  # destination k of the full route: replica k's (tp=1) driver
            return 0.0
        result = self.engine.push_weights(buffers, route="full")
        self.engine.flush_cache()
        return float(sum(result.bytes_per_rank))

    @property
    def destination_ranks(self) -> int:
        """Ranks of the plan's destination (engine ranks for sliced, the driver for full)."""
        return len(self.processes.destination)


def check_source_params(layout, sources: dict[str, torch.Tensor], *, rank: int) -> None:
    """Every parameter the plan reads on this actor rank is one the trainer holds, of its shape
    (an unmapped architecture's tensors are its weight files' names, which must be transformers'
    parameter names): one line naming it before the first push reads past it."""
    for name, shape in layout.param_shapes(rank).items():
        held = sources.get(name)
        if held is None or tuple(held.shape) != tuple(shape):
            found = "no parameter" if held is None else f"a parameter of shape {list(held.shape)}"
            raise ValueError(
                f"the weight sync reads {name} {list(shape)} on actor rank {rank}, but the trainer holds {found} of "
                "that name; the model's tensors (its weight files' for model.family=transformers) must be the "
                "trainer's parameters: remove a tensor the model does not hold from the weight files"
            )


def drops_weights(cfg: HybridflowConfig, *, gpu: bool) -> bool:
    """Whether the plan's switches release the engine's weights each step: colocated GPU engines
    do while the actor trains, unless the plan keeps them (``lowering.holds``; CPU engines
    release nothing)."""
    return gpu and cfg.rollout.placement == "colocated" and "weights" not in holds(cfg, "train")


def refit_difference(shared: list[dict[str, list[float]]], engine: list[dict[str, list[float]]]) -> float:
    """The largest relative difference between the digests of the tensors each engine rank was
    given and of its parameters as the engine holds them (a parameter missing there: inf)."""
    worst = 0.0
    for given, held in zip(shared, engine):
        for name, want in given.items():
            got = held.get(name)
            if got is None:
                return float("inf")
            worst = max(worst, *(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want)))
    return worst


_Layout = tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict]
"""The adapters' (name, shape, dtype) in sending order, and their PEFT config."""


def _layout(tensors: dict[str, torch.Tensor], config: dict) -> _Layout:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()], config


def _flat_sizes(layout: _Layout) -> list[tuple[torch.dtype, int]]:
    """[(dtype, elements)] of the flat buffers, in order of each dtype's first tensor."""
    sizes: dict[torch.dtype, int] = {}
    for _, shape, dtype in layout[0]:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return list(sizes.items())


def _flatten(tensors: dict[str, torch.Tensor], layout: _Layout, device: torch.device) -> list[torch.Tensor]:
    """One flat buffer per dtype on ``device`` (what the link sends)."""
    return [
        torch.cat([tensors[name].reshape(-1) for name, _, d in layout[0] if d == dtype]).to(device)
        for dtype, _ in _flat_sizes(layout)
    ]


def _unflatten(flat: list[torch.Tensor], layout: _Layout) -> dict[str, torch.Tensor]:
    """The tensors of ``layout``, each with storage of its own (a view would carry the whole flat
    buffer wherever the engine pickles it)."""
    offsets = {dtype: 0 for dtype, _ in _flat_sizes(layout)}
    buffers = dict(zip(offsets, flat))
    out = {}
    for name, shape, dtype in layout[0]:
        n = math.prod(shape)
        out[name] = buffers[dtype][offsets[dtype] : offsets[dtype] + n].view(shape).clone()
        offsets[dtype] += n
    return out
