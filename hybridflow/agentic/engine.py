"""A rollout engine whose samples are multi-turn trajectories (``agentic.enabled``).

```
replica driver: start_engine ──► AgenticEngine(the engine, cfg, tokenizer)
generate(prompts, params)   (the same call the runtime makes of any engine)
    prompt × n trajectories ──► rollout.run_trajectories on the wrapped engine: token ids in,
    every trajectory of the call on this replica (its prefix stays in the engine's cache)
    ──► RolloutBatch: each sample the whole trajectory, its loss mask and turn counts
```

Every other call (weight pushes, memory, shutdown) goes to the wrapped engine unchanged, so the
runtime's weight sync, restarts and colocation switches see the engine they always did.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Any

from hybridflow.agentic.env import Environment, ToolEnvironment
from hybridflow.agentic.parsers import PARSERS
from hybridflow.agentic.rollout import TurnLimits, run_trajectories
from hybridflow.agentic.tools import Tool, import_named, resolve_tool
from hybridflow.agentic.trajectory import ObservationRenderer, Trajectory
from hybridflow.config import AgenticConfig, HybridflowConfig
from hybridflow.rollout.base import FINISH_PAUSED, RolloutBatch, SamplingParams

__all__ = ["AgenticEngine", "check_agentic", "configured_tools", "environment_class"]

logger = logging.getLogger(__name__)

CUT_TURNS_WARNING = 0.2
"""The share of a call's trajectories with a turn cut at ``agentic.turn_tokens`` that earns the
run's one warning (a tool call cut there never runs, so RL cannot learn to make it)."""

END_OF_TURN = "<|im_end|>"
"""The token a ChatML policy ends its turn with (Qwen, the tiny test models)."""


def configured_tools(cfg: AgenticConfig) -> list[Tool]:
    """The tools ``agentic.tools`` names; ValueError (one line, the key) when one is unknown."""
    from hybridflow.agentic import builtin_tools  # noqa: F401  (registers calculator)

    tools = []
    for index, name in enumerate(cfg.tools):
        if name == "python":
            tools.append(builtin_tools.python_tool(_sandbox(cfg)))
            continue
        try:
            tools.append(resolve_tool(name))
        except ValueError as error:
            raise ValueError(f"agentic.tools[{index}]: {error}") from None
        if tools[-1].name in [t.name for t in tools[:-1]]:  # the model could not tell which it calls
            raise ValueError(f"agentic.tools[{index}]: a second tool named {tools[-1].name!r}; remove or rename one")
    return tools


def _sandbox(cfg: AgenticConfig):
    from hybridflow.agentic.sandbox import BubblewrapSandbox, RemoteSandbox, SandboxLimits

    limits = SandboxLimits(
        wall_seconds=cfg.sandbox_wall_seconds, memory_mb=cfg.sandbox_memory_mb, disk_mb=cfg.sandbox_disk_mb
    )
    return RemoteSandbox(cfg.sandbox_url, limits) if cfg.sandbox == "remote" else BubblewrapSandbox(limits)


def environment_class(cfg: AgenticConfig, data_source: str | None = None) -> type:
    """The environment class of ``data_source``'s rows: ``agentic.environments[data_source]``,
    else ``agentic.environment``, else ToolEnvironment; ValueError naming the key."""
    if data_source in cfg.environments:
        return _import_environment(f"agentic.environments.{data_source}", cfg.environments[data_source])
    if cfg.environment is None:
        return ToolEnvironment
    return _import_environment("agentic.environment", cfg.environment)


def _import_environment(key: str, spec: str) -> type:
    try:
        found = import_named(spec)
    except LookupError as error:
        raise ValueError(f"{key}={spec!r} does not import: {error}") from None
    if not callable(getattr(found, "step", None)):
        raise ValueError(f"{key}={spec!r} has no step(text) method")
    return found


def check_agentic(cfg: HybridflowConfig) -> None:
    """Everything ``agentic`` names resolves (before any rank starts): the parser, each tool (and
    the sandbox the python tool needs), the environment class."""
    a = cfg.agentic
    if not a.enabled:
        return
    if cfg.async_rl.partial_rollout and cfg.async_rl.resume == "checkpoint":  # live environments
        raise ValueError(
            "agentic.enabled=true with async_rl.partial_rollout=true: a paused trajectory's environment "
            "lives in its engine and cannot be saved with a checkpoint; set async_rl.resume=drop (a "
            "resumed run regenerates the batches started ahead)"
        )
    if a.tool_parser not in PARSERS:
        raise ValueError(f"agentic.tool_parser={a.tool_parser!r} is not one of: {', '.join(sorted(PARSERS))}")
    configured_tools(a)
    for source in [None, *a.environments]:
        environment_class(a, source)


class AgenticEngine:
    """``RolloutEngine`` whose ``generate`` runs trajectories on the engine it wraps."""

    def __init__(self, engine: Any, cfg: HybridflowConfig, tokenizer) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg.agentic
        self.tools = configured_tools(self.cfg)
        self.parse = PARSERS[self.cfg.tool_parser]
        self.environments = {None: environment_class(self.cfg)}
        self.environments.update({k: environment_class(self.cfg, k) for k in self.cfg.environments})
        budget = cfg.data.max_response_length
        self.limits = TurnLimits(
            max_turns=self.cfg.max_turns,
            max_tokens=budget,
            turn_tokens=self.cfg.turn_tokens or budget,
            observation_tokens=self.cfg.observation_tokens,
        )
        self.renderer = ObservationRenderer(
            tokenizer, tokenizer.convert_tokens_to_ids(END_OF_TURN), special_tokens=self.cfg.tool_output_special_tokens
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="tool")
        self._warned_cut = False
        self.paused: dict[tuple[int, ...], list[Trajectory]] = {}
        """Trajectories paused between a partial rollout's segments, by their context so far."""

    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        """Each prompt's ``params.n`` trajectories, run to their end or paused at
        ``params.max_new_tokens`` response tokens; a prompt that is a paused trajectory's whole
        context (``runtime.replicas.advance``) continues that trajectory, and its sample is the
        part this call added."""
        began = time.perf_counter()
        starts, since = [], []
        for i, p in enumerate(prompts):
            for k in range(params.n):
                t = self._paused_or_new(p, i, k)
                starts.append(t)
                since.append(len(t.response_ids))
        rows = [getattr(p, "row", None) for p in prompts]  # rollout.base.Prompt carries its row
        done = run_trajectories(
            self.engine,
            starts,
            lambda t: self._environment(rows[t.prompt_index]),
            dataclasses.replace(params, n=1),
            renderer=self.renderer,
            tokenizer=self.tokenizer,
            limits=self.limits,
            schedule=self.cfg.schedule,
        )
        for t in done:
            if t.finish_reason == FINISH_PAUSED:
                self.paused.setdefault(tuple(t.context), []).append(t)
        self._warn_if_cut([t for t in done if t.finish_reason != FINISH_PAUSED])
        samples = tuple(t.sample(mark) for t, mark in zip(done, since))
        return RolloutBatch(samples=samples, seconds=time.perf_counter() - began)

    def _paused_or_new(self, prompt, index: int, sample: int) -> Trajectory:
        """The paused trajectory whose context ``prompt`` is (numbered as this call's), or a new one."""
        waiting = self.paused.get(tuple(prompt))
        if not waiting:
            return Trajectory(tuple(prompt), index, sample)
        t = waiting.pop()  # trajectories with the same tokens so far are interchangeable
        if not waiting:
            del self.paused[tuple(prompt)]
        t.prompt_index, t.sample_index = index, sample
        return t

    def _warn_if_cut(self, done: list[Trajectory]) -> None:
        cut = sum(1 for t in done if t.stats.truncated_turns)
        if self._warned_cut or cut < CUT_TURNS_WARNING * len(done):
            return
        self._warned_cut = True
        logger.warning(
            "%d of %d trajectories had a turn cut at agentic.turn_tokens=%d before its end token; a tool "
            "call cut there never runs: raise agentic.turn_tokens (agentic/truncated_turns counts them)",
            cut,
            len(done),
            self.limits.turn_tokens,
        )

    def _environment(self, row) -> Environment:
        source = getattr(row, "data_source", None)
        cls = self.environments.get(source, self.environments[None])
        return cls(self.tools, self.parse, pool=self.pool, row=row)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    def __getattr__(self, name: str) -> Any:  # weight pushes, memory, reseed: the wrapped engine's
        return getattr(self.engine, name)
