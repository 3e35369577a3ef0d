"""Rollout over ``rollout.num_replicas`` engines, each driven by a rank of its own.

```
replica k = engine ranks k*tp .. k*tp+tp-1 (engine-major, as the reshard plan numbers them);
colocated, engine rank i shares actor rank i's GPU, so replica k's driver is actor rank k*tp

step's prompts, cut into chunks ──► a shared counter (torch.distributed's store)
   driver of replica 0: take chunk, generate, take the next ...      a replica busy with long
   driver of replica 1: take chunk, generate, take the next ...      generations takes fewer
                                    │                                 chunks: at most one chunk
   samples (prompt index made global) ──exchange──► each DP rank      in flight per replica
   receives the samples of its own prompts (``shares.owner``), in (prompt, sample) order
```

Each chunk is sampled with its own seed (chunk 0 with the call's seed), so a sample is a
function of the weights, its prompt and its chunk's seed, never of which replica served it:
runs and resumed runs draw the same samples whatever the timing. One replica takes the
whole batch as one chunk, as before replicas existed.

Asynchronous RL (separate placement) splits a call in two: ``start`` (the engine ranks generate
at once and keep their samples) and, steps later, ``collect`` (the gather and delivery above).
With partial rollouts a batch started ahead generates ``segment`` tokens per request, and at
each later step ``advance`` continues its unfinished requests with the weights the engine holds
by then (to their end at the step before its collection): every response token keeps the
policy version that sampled it (``RolloutSample.segments``).

```
start b (version v)       chunk c: generate <= segment tokens per request (seed: chunk c's)
advance, at step v+1      chunk c's unfinished requests: prompt + tokens so far as the prompt,
(engine at version v+1)   <= segment more tokens (seed: chunk c's, segment 1), the prefix re-read
                          with the new weights; routed experts kept from the segment that fed
                          each token
advance, at step b-1      the same, to the end of every request
```

A driver whose engine is lost mid-call (``EngineLost``: a process of it died, or a call outran
``rollout.generate_timeout_s``) reports it like any failure; with ``restarts`` every process of
the channel then has the lost engines replaced and re-synced (``recovery``: separate placement's
engine ranks and actor ranks alike, all inside this call) and the whole call runs again, same
chunks, same seeds, so it returns the samples the failed call would have. A batch started
ahead (``start``) is not regenerated: ``collect`` stops the run naming why (``ASYNC_LOST``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import NamedTuple, Sequence

import torch

from hybridflow.config import HybridflowConfig
from hybridflow.rollout.base import FINISH_LENGTH, FINISH_PAUSED, EngineLost, RolloutSample, SamplingParams
from hybridflow.runtime.channel import Channel
from hybridflow.runtime.exchange import SampleMeta, deliver, meta_of
from hybridflow.runtime.shares import Shard, balanced_owners, owner

__all__ = [
    "ReplicaFailed",
    "ReplicaOutput",
    "Started",
    "advance",
    "chunk_seed",
    "collect",
    "driver_rank",
    "generate",
    "replica_of",
    "start",
]

_SEED_MOD = 2**31 - 1
_SEGMENT_SEED = 104729
"""Offsets a continuation's seeds from the segments before it (a prime, like the chunks' 7919)."""
ASYNC_LOST = (
    "a batch started ahead (asynchronous RL) cannot be regenerated on a new engine: the actor ranks "
    "train meanwhile and hold newer weights than it was started under"
)
"""Why ``collect`` refuses to restart a lost engine."""


class ReplicaFailed(RuntimeError):
    """A rollout replica failed mid-generation; every rank raises it, naming the replica."""


def driver_rank(cfg: HybridflowConfig, replica: int) -> int:
    """The global rank that drives ``replica`` (its first engine rank's GPU)."""
    return replica * cfg.rollout.tp


def replica_of(cfg: HybridflowConfig, rank: int) -> int | None:
    """The replica ``rank`` drives, or None."""
    tp = cfg.rollout.tp
    if rank % tp or rank // tp >= cfg.rollout.num_replicas:
        return None
    return rank // tp


def engine_nodes(cfg: HybridflowConfig) -> int:
    """Nodes one engine spans: its tp ranks over ``rollout.gpus_per_node`` GPUs each."""
    return max(1, cfg.rollout.tp // cfg.rollout.gpus_per_node)


def node_role(cfg: HybridflowConfig, rank: int) -> tuple[int, int] | None:
    """(replica, node rank within the engine) when ``rank`` starts an engine's part on its node (the
    first of the engine's ranks there; node 0's is the replica's driver), else None."""
    tp, per_node = cfg.rollout.tp, cfg.rollout.gpus_per_node
    local = rank % tp
    if rank >= tp * cfg.rollout.num_replicas or local % min(tp, per_node):
        return None
    return rank // tp, local // per_node


def chunk_seed(seed: int, chunk: int) -> int:
    """The sampling seed of one chunk of a generate call (chunk 0: the call's own)."""
    return (seed + chunk * 7919) % _SEED_MOD


def _chunks(num_prompts: int, cfg: HybridflowConfig) -> list[range]:
    replicas = cfg.rollout.num_replicas
    count = 1 if replicas == 1 else min(num_prompts, replicas * cfg.rollout.dispatch_chunks)
    size = math.ceil(num_prompts / max(count, 1))
    return [range(start, min(start + size, num_prompts)) for start in range(0, num_prompts, size)]


@dataclasses.dataclass(frozen=True)
class ReplicaOutput:
    """A generate call over every replica, as one rank sees it: its DP rank's samples only."""

    samples: tuple[RolloutSample, ...]
    """This rank's DP rank's samples, prompt indices global, in (prompt, sample) order."""
    positions: tuple[int, ...]
    """Each of them's position among all the call's samples in (prompt, sample) order."""
    metas: tuple[SampleMeta, ...]
    """Every sample's metadata (lengths, finish reason), in (prompt, sample) order."""
    seconds: float
    """Wall time of the slowest replica."""
    samples_per_replica: tuple[int, ...]
    """How many samples each replica generated."""
    received_bytes: int
    """Sample bytes this rank received from the drivers."""
    intervals: tuple[tuple[float, float], ...] = ()
    """When each driver generated its share (``time.time()`` start, end)."""


class _Counter:
    """The next chunk to take, shared by the replica drivers (the run's store)."""

    def __init__(self, store, call: int) -> None:
        self.store = store
        self.key = f"hybridflow/rollout/{call}"

    def take(self) -> int:
        return self.store.add(self.key, 1) - 1


def _drive(
    engine, prompts: Sequence, params: SamplingParams, seed: int, chunks: list[range], counter: _Counter
) -> tuple[list[RolloutSample], float, list[int]]:
    """Generate chunks on this replica until none is left: the samples, the seconds, and each
    sample's chunk."""
    samples, chunk_of, started = [], [], time.perf_counter()
    while (chunk := counter.take()) < len(chunks):
        span = chunks[chunk]
        engine.reseed(chunk_seed(seed, chunk))
        out = engine.generate([prompts[i] for i in span], params)
        samples += [dataclasses.replace(x, prompt_index=span.start + x.prompt_index) for x in out.samples]
        chunk_of += [chunk] * len(out.samples)
    return samples, time.perf_counter() - started, chunk_of


class _Report(NamedTuple):
    """What each rank tells every other after generating (pickled: a few ints per sample)."""

    replica: int | None
    metas: list
    seconds: float
    error: str | None
    dp_rank: int | None
    """The rank's data-parallel rank; None for an engine rank (separate placement)."""
    lost: bool = False
    """Whether ``error`` is the engine lost (``EngineLost``): a new engine can take over."""
    interval: tuple[float, float] | None = None
    """When this driver generated (``time.time()`` at start and end); None: it did not."""


def generate(
    cfg: HybridflowConfig,
    engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seed: int,
    *,
    call: int,
    channel: Channel,
    replica: int | None,
    shard: Shard | None,
    device,
    restarts=None,
) -> ReplicaOutput:
    """Every replica's share of ``prompts``, delivered to the data-parallel ranks that own them
    (``shares.owner``; collective over ``channel``). ``engine`` is the engine of ``replica``
    when this rank drives it, else None; ``shard``: this rank's DP share (None on an engine
    rank); ``call`` numbers the call, the same on every rank; ``device``: where the samples
    travel (the rank's GPU, so NCCL carries them); ``restarts``: this rank's
    ``recovery.EngineRestarts`` (None: a lost engine stops the run)."""
    chunks = _chunks(len(prompts), cfg)
    dp_rank = None if shard is None else shard.dp_rank
    attempt = 0
    while True:
        samples, mine = [], _Report(None, [], 0.0, None, dp_rank)
        if engine is not None:
            samples, mine, _ = _attempt(
                engine,
                prompts,
                params,
                seed,
                chunks,
                channel,
                replica=replica,
                call=call,
                attempt=attempt,
                dp_rank=dp_rank,
            )
        gathered: list[_Report] = channel.gather(mine)
        _raise_failures(gathered, restartable=restarts is not None)
        lost = [(rank, g.replica, g.error) for rank, g in enumerate(gathered) if g.lost]
        if not lost:
            break
        engine = restarts.restart(lost)  # every rank together; raises ReplicaFailed past the limit
        attempt += 1
    return _deliver(cfg, samples, gathered, len(prompts), channel=channel, device=device)


def _deliver(
    cfg: HybridflowConfig,
    samples: list[RolloutSample],
    gathered: list[_Report],
    num_prompts: int,
    *,
    channel: Channel,
    device,
) -> ReplicaOutput:
    """The drivers' samples to the DP ranks that own their prompts (collective over ``channel``)."""
    counts = [0] * cfg.rollout.num_replicas
    for report in gathered:
        if report.replica is not None:
            counts[report.replica] += len(report.metas)
    if num_prompts and not any(counts):  # a step of no samples would train on nothing, silently
        raise RuntimeError(f"the rollout engines returned no sample for {num_prompts} prompts and named no error")
    got = deliver(
        samples,
        [g.metas for g in gathered],
        [g.dp_rank for g in gathered],
        _owner_of(cfg, gathered, num_prompts),
        device=device,
        link=channel.link,
    )
    return ReplicaOutput(
        samples=got.samples,
        positions=got.positions,
        metas=got.metas,
        seconds=max(g.seconds for g in gathered),
        samples_per_replica=tuple(counts),
        received_bytes=got.received_bytes,
        intervals=tuple(g.interval for g in gathered if g.interval is not None),
    )


def _owner_of(cfg: HybridflowConfig, gathered: list[_Report], num_prompts: int):
    """meta -> the DP rank that trains on it: ``shares.owner``'s blocks, or under token-budget
    micro-batches the same counts balanced by the tokens every rank now knows (the metadata)."""
    dp_size = cfg.actor.parallel.dp
    if cfg.packing.max_tokens_per_micro_batch is None or dp_size == 1:
        return lambda m: owner(m.prompt_index, num_prompts, dp_size)
    tokens = [0] * num_prompts
    for report in gathered:
        for m in report.metas:
            tokens[m.prompt_index] += m.prompt_len + m.response_len
    owners = balanced_owners(tokens, dp_size)
    return lambda m: owners[m.prompt_index]


@dataclasses.dataclass(frozen=True)
class Started:
    """A driver's share of a call started ahead of its collection (asynchronous RL), kept in the
    driver's memory: its samples and its report."""

    samples: list[RolloutSample]
    report: _Report
    chunk_of: tuple[int, ...] = ()
    """Each sample's chunk: ``advance`` continues a chunk's unfinished requests together, with
    seeds of that chunk, so a sample never depends on which replica holds it."""
    params: SamplingParams | None = None
    """The call's sampling, its whole ``max_new_tokens`` (partial rollouts; None otherwise)."""
    seed: int = 0
    segments: int = 0
    """Continuations run so far (``advance``): each draws its own seeds."""
    version: int | None = None
    """The policy version that generated its latest tokens (partial rollouts)."""

    def merged(self, other: "Started") -> "Started":
        """Both shares as one (a resumed run with fewer replicas than saved buffers)."""
        r = self.report
        return dataclasses.replace(
            self,
            samples=self.samples + other.samples,
            chunk_of=self.chunk_of + other.chunk_of,
            report=r._replace(metas=r.metas + other.report.metas, seconds=r.seconds + other.report.seconds),
        )

    def unfinished(self) -> list[int]:
        """Positions of the requests a partial rollout has yet to continue."""
        if self.params is None or self.report.error is not None:
            return []
        limit = self.params.max_new_tokens
        # a trajectory says itself when it paused: one cut by its own limits ended
        return [
            i
            for i, x in enumerate(self.samples)
            if x.finish_reason == FINISH_PAUSED
            or (x.finish_reason == FINISH_LENGTH and not x.turn_stats and len(x.response_ids) < limit)
        ]


def start(
    cfg: HybridflowConfig,
    engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seed: int,
    *,
    call: str,
    channel: Channel,
    replica: int,
    segment: int | None = None,
    version: int | None = None,
) -> Started:
    """Generate this driver's share of ``prompts`` now, with the weights its engine holds, for a
    later ``collect`` (the chunks and seeds are those ``generate`` would use: the samples do not
    depend on when they are collected). A failure is kept in the report and raised at collect.

    Partial rollouts: ``version`` (the engine's policy version) tags every token; ``segment``
    caps this first part at that many tokens per request, the rest left to ``advance``."""
    first = (
        params if segment is None else dataclasses.replace(params, max_new_tokens=min(segment, params.max_new_tokens))
    )
    samples, report, chunk_of = _attempt(
        engine,
        prompts,
        first,
        seed,
        _chunks(len(prompts), cfg),
        channel,
        replica=replica,
        call=call,
        attempt=0,
        dp_rank=None,
    )
    if version is None:
        return Started(samples, report)
    samples = [dataclasses.replace(x, segments=((0, version),)) for x in samples]
    return Started(
        samples, report._replace(metas=[meta_of(x) for x in samples]), tuple(chunk_of), params, seed, version=version
    )


def advance(engine, started: Started, version: int, *, segment: int | None) -> tuple[Started, tuple[float, float]]:
    """Continue ``started``'s unfinished requests with the weights ``engine`` holds now, policy
    ``version`` (the pause at a token boundary and the in-flight weight update of partial
    rollouts): ``segment`` more tokens each, or to their end (None). Returns the batch and when
    it generated; a failure is kept in the report, raised at collect as ``start``'s are."""
    began, samples = time.time(), list(started.samples)
    groups: dict[tuple[int, int], list[int]] = {}
    for i in started.unfinished():  # a chunk's requests, by the tokens they hold (one budget each)
        groups.setdefault((started.chunk_of[i], len(samples[i].response_ids)), []).append(i)
    error, lost = None, False
    try:
        for (chunk, done), rows in sorted(groups.items()):
            left = started.params.max_new_tokens - done
            params = dataclasses.replace(
                started.params, n=1, max_new_tokens=left if segment is None else min(segment, left)
            )
            engine.reseed(chunk_seed(started.seed + (started.segments + 1) * _SEGMENT_SEED, chunk))
            out = engine.generate([samples[i].prompt_ids + samples[i].response_ids for i in rows], params)
            for more in out.samples:
                i = rows[more.prompt_index]
                samples[i] = _continued(samples[i], more, version)
    except Exception as failure:
        error, lost = _described(failure)
    ended = time.time()
    report = started.report._replace(
        metas=[meta_of(x) for x in samples], error=error, lost=lost, seconds=started.report.seconds + (ended - began)
    )
    return (
        dataclasses.replace(started, samples=samples, report=report, segments=started.segments + 1, version=version),
        (began, ended),
    )


def _continued(x: RolloutSample, more: RolloutSample, version: int) -> RolloutSample:
    """``x`` followed by ``more``, a continuation whose prompt was x's prompt and response: the
    new tokens tagged ``version``; routed experts kept as each token was first fed (the new
    call's rows for x's tokens re-read them under the new weights). A trajectory's continuation
    brings its loss mask's next part and its counts so far."""
    routes = x.routed_experts
    if routes is None:  # a trajectory paused after an observation: the next turn's call covers all
        routes = more.routed_experts
    elif more.routed_experts is not None:
        routes = torch.as_tensor(routes)
        routes = torch.cat([routes, torch.as_tensor(more.routed_experts)[len(routes) :]])
    return dataclasses.replace(
        x,
        response_ids=x.response_ids + more.response_ids,
        logprobs=x.logprobs + more.logprobs,
        finish_reason=more.finish_reason,
        routed_experts=routes,
        segments=x.segments + ((len(x.response_ids), version),),
        loss_mask=x.loss_mask + more.loss_mask,
        turn_stats=more.turn_stats or x.turn_stats,
    )


def collect(
    cfg: HybridflowConfig, started: Started | None, *, num_prompts: int, channel: Channel, shard: Shard | None, device
) -> ReplicaOutput:
    """A started call's samples, delivered as ``generate`` delivers them (collective over
    ``channel``; ``started``: this driver's share, None on every other process)."""
    dp_rank = None if shard is None else shard.dp_rank
    samples, mine = (
        ([], _Report(None, [], 0.0, None, dp_rank)) if started is None else (started.samples, started.report)
    )
    gathered: list[_Report] = channel.gather(mine)
    _raise_failures(gathered, why_not=ASYNC_LOST)
    return _deliver(cfg, samples, gathered, num_prompts, channel=channel, device=device)


def _attempt(
    engine,
    prompts: Sequence,
    params: SamplingParams,
    seed: int,
    chunks: list[range],
    channel: Channel,
    *,
    replica: int,
    call: int,
    attempt: int,
    dp_rank: int | None,
) -> tuple[list[RolloutSample], _Report, list[int]]:
    """This driver's share of one try of the call, its report (a failure too: the others must
    learn of it, or they would wait in the gather) and each sample's chunk."""
    counter = _Counter(channel.store, call if attempt == 0 else f"{call}/retry{attempt}")
    try:
        began = time.time()
        samples, seconds, chunk_of = _drive(engine, prompts, params, seed, chunks, counter)
        return (
            samples,
            _Report(replica, [meta_of(x) for x in samples], seconds, None, dp_rank, interval=(began, time.time())),
            chunk_of,
        )
    except Exception as failure:
        error, lost = _described(failure)
        return [], _Report(replica, [], 0.0, error, dp_rank, lost=lost), []


def _described(failure: Exception) -> tuple[str, bool]:
    """(the report's error, whether the engine is lost): a lost engine's message is the cause
    (which process, or the timeout); any other error is named with its type."""
    if isinstance(failure, EngineLost):
        return str(failure), True
    return f"{type(failure).__name__}: {failure}", False


def _raise_failures(gathered: list, *, restartable: bool = False, why_not: str | None = None) -> None:
    """ReplicaFailed for the first failure, unless every failure is a lost engine and
    ``restartable`` (the caller restarts those); ``why_not``: why a lost engine is not restarted
    here, for the message."""
    for rank, report in enumerate(gathered):
        replica, error = report.replica, report.error
        if error is not None and not (report.lost and restartable):
            why = f"; {why_not}" if report.lost and why_not else ""
            raise ReplicaFailed(
                f"rollout replica {replica} (driven by rank {rank}) failed mid-generation: {error}{why}; "
                "the step is abandoned; rerun the same command to resume from the newest checkpoint"
            )
