"""Many multi-turn trajectories on one engine, each advancing on its own.

```
ready: trajectories whose next turn can be sampled
loop:
    engine.generate(every ready trajectory's context, token ids in)    one batched call
    each new turn ──► its environment's step, in a thread of its own (runs while the engine works)
    replies that came back ──► observation tokens appended ──► ready again, or finished
```

``schedule="independent"`` (the default) takes whatever replies have come back when the engine
is free again: a slow tool holds back only its own trajectory. When none has, it waits for the
first and then up to ``gather_s`` more for others, so the quick tools' trajectories share one
engine call instead of one call each (an engine call costs about the same for one trajectory
as for many of them). ``"turn_synchronous"`` waits
for every reply before the next call, as a step-by-step loop over the batch would (the
baseline of ``benchmarks/agentic_rollout.py``).

Environment steps run in threads of this call, one per trajectory in flight; the tools they
call run in the environment's own pool. Sharing one pool deadlocks: steps that wait on their
tools' answers fill every worker, and the tools queue behind them until they time out.

Limits end a trajectory without an error: ``max_turns`` policy turns, ``max_tokens`` response
tokens (turns and observations), a turn that hit its token budget without the end token. An
observation longer than ``observation_tokens`` has its messages' text cut to fit (counted).

The call's ``params.max_new_tokens`` is its budget of response tokens per trajectory (partial
rollouts' segment): a trajectory that spent it pauses before its next turn (``FINISH_PAUSED``),
its environment kept on it, and a later call given the trajectory continues it. A turn is never
split, so each is sampled by one policy version and its tool call sees the whole of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridflow.agentic.env import Environment, Reply
from hybridflow.agentic.trajectory import ObservationRenderer, Trajectory
from hybridflow.rollout.base import FINISH_LENGTH, FINISH_PAUSED, FINISH_STOP, RolloutEngine, SamplingParams

__all__ = ["SCHEDULES", "TurnLimits", "run_trajectories"]

SCHEDULES = ("independent", "turn_synchronous")


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int = 4
    """Policy turns per trajectory."""
    max_tokens: int = 512
    """Response tokens per trajectory, observations included."""
    turn_tokens: int = 128
    """Tokens one policy turn may sample."""
    observation_tokens: int = 256
    """Tokens one observation may take; its messages' text is cut to fit."""


class _Run:
    """The state of one ``run_trajectories`` call."""

    def __init__(self, engine, params, renderer, tokenizer, limits, steps, make_env, gather_s: float) -> None:
        self.gather_s = gather_s
        self.engine, self.params, self.renderer = engine, params, renderer
        self.tokenizer, self.limits, self.steps = tokenizer, limits, steps
        self.make_env = make_env
        self.marks: dict[int, int] = {}
        """Each trajectory's response length when this call took it (its budget counts from there)."""
        self.waiting: dict[concurrent.futures.Future, Trajectory] = {}
        self.ready: list[Trajectory] = []
        self.closing: dict[int, list[int]] = {}
        self.calls = 0

    def generate(self) -> None:
        """One engine call per token budget over the ready trajectories; their new turns go to
        their environments."""
        budgets: dict[int, list[Trajectory]] = defaultdict(list)
        for t in self.ready:
            budgets[min(self.limits.turn_tokens, self.limits.max_tokens - len(t.response_ids))].append(t)
        self.ready = []
        for budget, group in budgets.items():
            self.calls += 1
            seed = None if self.params.seed is None else self.params.seed + self.calls
            params = dataclasses.replace(self.params, n=1, max_new_tokens=budget, seed=seed)
            batch = self.engine.generate([t.context for t in group], params)
            for t, sample in zip(group, batch.samples):
                self._turn(t, sample)

    def _turn(self, t: Trajectory, sample) -> None:
        ids, end = list(sample.response_ids), self.renderer.end_id
        t.add_turn(ids, sample.logprobs, sample.routed_experts)
        if sample.finish_reason == FINISH_LENGTH or not ids:
            t.finish_reason = FINISH_LENGTH  # cut mid-turn: nothing to answer
            t.stats.truncated_turns += bool(ids)
            return
        if ids[-1] != end and ids[-1] in self.params.stop_token_ids:
            return  # it stopped at end-of-text, not end-of-turn: the trajectory is over
        # an engine that stops at the end token without returning it: the template still needs it
        self.closing[id(t)] = [] if ids[-1] == end else [end]
        text = self.tokenizer.decode(ids[:-1] if ids[-1] == end else ids, skip_special_tokens=False)
        if t.env is None:
            t.env = self.make_env(t)
        self.waiting[self.steps.submit(t.env.step, text)] = t

    def collect(self, *, wait_all: bool) -> None:
        """Apply the replies that came back (all of them with ``wait_all``; at least one when
        nothing else can run)."""
        if not self.waiting:
            return
        if wait_all:
            concurrent.futures.wait(self.waiting)
        elif not self.ready:  # the engine would idle: the first reply, and the ones close behind it
            concurrent.futures.wait(self.waiting, return_when=concurrent.futures.FIRST_COMPLETED)
            concurrent.futures.wait(self.waiting, timeout=self.gather_s)
        for future in [f for f in self.waiting if f.done()]:
            self._reply(self.waiting.pop(future), future.result())

    def _reply(self, t: Trajectory, reply: Reply) -> None:
        t.stats.add(reply.outcome)
        if reply.done:
            t.reward = reply.reward
            return
        if t.stats.turns >= self.limits.max_turns:
            t.finish_reason = FINISH_LENGTH  # it asked for more than the turns allow
            return
        ids = self.closing.pop(id(t), []) + self._observation(t, reply.messages)
        if len(t.response_ids) + len(ids) >= self.limits.max_tokens:
            t.finish_reason = FINISH_LENGTH  # no room left for the answer and another turn
            return
        t.add_observation(ids)
        if len(t.response_ids) - self.marks[id(t)] >= self.params.max_new_tokens:
            t.finish_reason = FINISH_PAUSED  # this call's budget is spent: the next turn is a later call's
            return
        self.ready.append(t)

    def _observation(self, t: Trajectory, messages: list[dict]) -> list[int]:
        ids = self.renderer.render(messages)
        cap = self.limits.observation_tokens
        if len(ids) <= cap:
            return ids
        t.stats.truncated_observations += 1
        frame = len(self.renderer.render([{**m, "content": ""} for m in messages]))
        share = max((cap - frame) // len(messages), 0)
        cut = [{**m, "content": self._cut(m["content"], share)} for m in messages]
        return self.renderer.render(cut)[:cap] if frame > cap else self.renderer.render(cut)

    def _cut(self, text: str, tokens: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= tokens else self.tokenizer.decode(ids[:tokens])


def run_trajectories(
    engine: RolloutEngine,
    starts: Sequence[Trajectory],
    make_env: Callable[[Trajectory], Environment],
    params: SamplingParams,
    *,
    renderer: ObservationRenderer,
    tokenizer,
    limits: TurnLimits = TurnLimits(),
    schedule: str = "independent",
    gather_s: float = 0.05,
) -> list[Trajectory]:
    """Run every trajectory of ``starts`` to its end, or to its pause at ``params.max_new_tokens``,
    on ``engine`` (see the module doc); returns them, filled in, in the same order. A paused
    trajectory among ``starts`` continues where it stopped."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; one of {', '.join(SCHEDULES)}")
    with concurrent.futures.ThreadPoolExecutor(max(len(starts), 1), thread_name_prefix="env") as steps:
        run = _Run(engine, params, renderer, tokenizer, limits, steps, make_env, gather_s)
        run.ready = list(starts)
        for t in starts:
            run.marks[id(t)] = len(t.response_ids)
            t.finish_reason = FINISH_STOP
        while run.ready or run.waiting:
            if run.ready:
                run.generate()
            run.collect(wait_all=schedule == "turn_synchronous")
    return list(starts)
