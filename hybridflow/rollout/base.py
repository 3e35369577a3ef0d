"""The rollout-engine interface: what the RL loop asks of SGLang or the transformers reference.

```
RolloutRequest (token ids per prompt + SamplingParams)
      │  engine.generate(...)
      ▼
RolloutBatch: one RolloutSample per (prompt, sample index) — prompt ids, response ids,
              log-probs of the sampled tokens, finish reason, routed experts (MoE, optional)
      │  hybridflow.rollout.tokens: pad / mask into [B, T] tensors for the trainer
      ▼
trainer (megatron_adapters)  ──  weights  ──►  engine.push_weights(...) (reshard plan)
```

Engines register by name (``register_engine`` / ``make_engine``); callers depend on the
``RolloutEngine`` protocol only. Nothing here imports sglang, transformers or torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from hfschema.engines import ENGINES

__all__ = [
    "BackgroundGenerator",
    "EngineLost",
    "FINISH_LENGTH",
    "FINISH_PAUSED",
    "FINISH_STOP",
    "MEMORY_TAGS",
    "Finished",
    "PendingBatch",
    "Prompt",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "SamplingParams",
    "TURN_STATS",
    "WeightPushReport",
    "engine_names",
    "make_engine",
    "memory_tags",
    "register_engine",
    "submit",
    "weight_digest",
]

FINISH_STOP = "stop"
"""The response ended with EOS or a stop token."""
FINISH_LENGTH = "length"
"""The response hit ``max_new_tokens`` (truncated; RL recipes may shape or mask it)."""
FINISH_PAUSED = "paused"
"""A multi-turn trajectory stopped between two turns at the call's ``max_new_tokens`` (a
partial rollout's segment), its environment kept by the engine for the call that continues it;
never trained on: the last segment runs every trajectory to its end."""


class Prompt(tuple):
    """A prompt's token ids (a tuple of ints: all an engine reads) and the data row they come
    from, which a multi-turn rollout builds the trajectory's environment from
    (``hybridflow.agentic``); ``row`` is None where no row is known."""

    def __new__(cls, ids, row: Any = None) -> "Prompt":
        prompt = super().__new__(cls, ids)
        prompt.row = row
        return prompt

    def __reduce__(self):  # pickled to the engine ranks with its row
        return (Prompt, (tuple(self), self.row))


class EngineLost(RuntimeError):
    """The engine stopped serving mid-call: one of its processes died, or the call ran past its
    timeout. The engine is unusable; a new one can take its place (``runtime/recovery.py``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample responses; greedy when temperature is 0."""

    n: int = 1
    """Samples per prompt (GRPO's group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    max_new_tokens: int = 32
    """Response length cap."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (EOS is always one)."""
    seed: int | None = None
    """Sampling seed (reproducible where the engine supports it)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k={self.top_k} must be -1 (all) or >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens} must be >= 1")


TURN_STATS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "malformed_calls",
    "observation_tokens",
    "truncated_observations",
    "truncated_turns",
)
"""What ``RolloutSample.turn_stats`` counts, in order (``hybridflow.agentic.trajectory``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSample:
    """One generated response."""

    prompt_index: int
    """Index of its prompt in the request."""
    sample_index: int
    """Which of the ``n`` samples of that prompt."""
    prompt_ids: tuple[int, ...]
    """The prompt's token ids."""
    response_ids: tuple[int, ...]
    """Generated token ids (the stop token included when the engine returns it)."""
    logprobs: tuple[float, ...]
    """Log-probability of each response token under the engine's (unscaled) distribution."""
    finish_reason: str
    """``FINISH_STOP`` or ``FINISH_LENGTH`` (``FINISH_PAUSED`` only between partial rollouts' segments)."""
    routed_experts: Any = None
    """The experts each MoE layer chose for every token fed to the model — the prompt's and
    the response's but the last, SGLang's ``return_routed_experts`` layout: ``[P + R - 1, L, k]``
    ints (P prompt, R response tokens, L MoE layers) — or None."""
    segments: tuple[tuple[int, int], ...] = ()
    """(first response token, policy version) of each weight version that sampled part of the
    response, in order, when it was generated across weight pushes (asynchronous RL's partial
    rollouts, ``runtime/replicas.advance``); empty: one version sampled it all."""
    loss_mask: tuple[int, ...] = ()
    """Per response token, 1 where the policy sampled it and 0 where it did not (a multi-turn
    trajectory's observations, ``hybridflow.agentic``); empty: the policy sampled every one."""
    turn_stats: tuple[int, ...] = ()
    """A multi-turn trajectory's counts, in ``TURN_STATS`` order; empty for a single response."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """All samples of one generate call, prompt-major then sample index."""

    samples: tuple[RolloutSample, ...]
    """The samples."""
    seconds: float
    """Wall time of the call."""

    @property
    def num_response_tokens(self) -> int:
        """Generated tokens in the batch."""
        return sum(len(s.response_ids) for s in self.samples)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightPushReport:
    """What one weight push moved."""

    seconds: float
    """Wall time of the push."""
    bytes_per_rank: tuple[int, ...]
    """Bytes each engine rank received."""
    route: str
    """How the weights travelled (e.g. ``sliced`` or ``full``)."""


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What ``release_memory`` / ``resume_memory`` free and take back (SGLang's memory-saver tags)."""


def memory_tags(tags: Sequence[str] | None) -> list[str]:
    """``tags`` checked against ``MEMORY_TAGS`` (None: all of them), duplicates dropped."""
    if tags is None:
        return list(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS)) if not isinstance(tags, str) else [tags]
    if unknown:
        raise ValueError(f"memory tags {unknown}: choose among {', '.join(MEMORY_TAGS)} (a list or tuple)")
    return list(dict.fromkeys(tags))


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine the RL loop can drive."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses for each prompt (token ids)."""
        ...

    def push_weights(self, weights: Any, *, route: str = "sliced") -> WeightPushReport:
        """Replace the engine's weights (engine-specific payload; see each engine)."""
        ...

    def reseed(self, seed: int) -> None:
        """Seed the sampler; the next generate call then depends only on weights, prompts and seed."""
        ...

    def pause(self) -> None:
        """Stop scheduling new work (in-flight requests are held)."""
        ...

    def resume(self) -> None:
        """Continue after ``pause``."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes / KV (after a weight push they are stale)."""
        ...

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free accelerator memory while training runs: ``tags`` among ``weights``, ``kv_cache``,
        ``cuda_graph`` (None: all). No-op on CPU. Whether released weights keep their values is
        the engine's (SGLang's do not: push weights again after resuming them)."""
        ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what ``release_memory`` freed (``tags`` as there; ones not released are skipped)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and every process it started."""
        ...


@runtime_checkable
class SlicedWeightReceiver(Protocol):
    """An engine that takes each of its ranks' own weight shares in place
    (``rollout.sync_route=sliced``: ``runtime.sync`` writes the engine's per-rank tensors)."""

    def rank_params(self) -> list[dict[str, dict[str, Any]]]:
        """Each engine rank's parameters: name -> {shape, dtype}, in the engine's own layout."""
        ...

    def push_rank_payloads(self, payloads: Sequence[Any]) -> WeightPushReport:
        """Copy each rank's shared tensors (one payload per engine rank, in rank order) into place."""
        ...

    def weight_digests(self) -> list[dict[str, list[float]]]:
        """Each rank's parameter digests, which the refit verifier compares with what was sent."""
        ...


@runtime_checkable
class AdapterReceiver(Protocol):
    """An engine that serves LoRA adapters over a resident base (``lora.push=adapter``)."""

    def load_adapter(self, name: str, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> WeightPushReport:
        """Load the adapters (PEFT names and config) as ``name``; later generate calls use them."""
        ...


class PendingBatch(Protocol):
    """A generate call started and not yet collected (``submit``)."""

    def result(self) -> RolloutBatch:
        """The batch, waiting for it if need be (once)."""
        ...


@dataclasses.dataclass(frozen=True)
class Finished:
    """A ``PendingBatch`` already generated: what ``submit`` returns for an engine that cannot
    generate in the background."""

    batch: RolloutBatch

    def result(self) -> RolloutBatch:
        return self.batch


@runtime_checkable
class BackgroundGenerator(Protocol):
    """An engine that generates while its caller does other work (SGLang: its schedulers are
    processes of their own)."""

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> PendingBatch:
        """Start ``generate(prompts, params)``; returns once the engine has every request."""
        ...


def submit(engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> PendingBatch:
    """``engine``'s batch started in the background where it can be (``BackgroundGenerator``),
    else generated now."""
    if isinstance(engine, BackgroundGenerator):
        return engine.submit(prompts, params)
    return Finished(engine.generate(prompts, params))


ENGINE_PROTOCOLS = (RolloutEngine, SlicedWeightReceiver, AdapterReceiver, BackgroundGenerator)
"""Everything the runtime asks of an engine (``tests/rollout/test_engine_protocol.py`` holds it to
that): every engine implements ``RolloutEngine``; the two others are what a route needs."""


def require(engine: Any, protocol: type, setting: str) -> None:
    """TypeError naming ``setting`` when ``engine`` lacks ``protocol``'s methods."""
    if not isinstance(engine, protocol):
        missing = [name for name in protocol_methods(protocol) if not callable(getattr(engine, name, None))]
        raise TypeError(
            f"{setting} needs a rollout engine with {', '.join(missing)} ({protocol.__name__}); "
            f"{type(engine).__name__} has not: choose another engine or setting"
        )


def protocol_methods(protocol: type) -> list[str]:
    """The methods a protocol asks for."""
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}
# Built-in engines register when their module is imported; importing on demand keeps sglang
# (seconds to import, CUDA-minded) out of processes that never start it.
_BUILTIN_MODULES = {name: traits.module for name, traits in ENGINES.items()}


def register_engine(name: str) -> Callable[[Callable[..., RolloutEngine]], Callable[..., RolloutEngine]]:
    """Decorator: make a factory available to ``make_engine(name, ...)``."""

    def add(factory: Callable[..., RolloutEngine]) -> Callable[..., RolloutEngine]:
        if name in _ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered")
        _ENGINES[name] = factory
        return factory

    return add


def engine_names() -> list[str]:
    """Registered and built-in engine names."""
    return sorted(set(_ENGINES) | set(_BUILTIN_MODULES))


def make_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Start the engine registered as ``name``; ValueError lists the valid names."""
    if name not in _ENGINES and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; registered engines: {', '.join(engine_names()) or 'none'}")
    return _ENGINES[name](**kwargs)


def weight_digest(tensor) -> list[float]:
    """[sum, sum of squares] of ``tensor`` in float64: what the refit check compares between the
    tensors the trainer sent and what an engine holds (each engine reports its own this way)."""
    flat = tensor.detach().reshape(-1).double()
    return [float(flat.sum()), float((flat * flat).sum())]
