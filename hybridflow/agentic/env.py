"""Environments: what answers the policy between its turns.

```
env = make_env(row)                       one per trajectory (state lives in it)
reply = env.step(text of the policy's turn)
    Reply(messages=[tool / user messages], done=False)   the trajectory goes on
    Reply(done=True, reward=r | None)                    it ends (None: the reward function scores it)
```

``ToolEnvironment`` is the common case: it reads the turn's tool calls (``parsers``), runs each
registered tool (``tools``) with its timeout, and answers with one ``tool`` message per call in
the calls' order; a turn without a call ends the trajectory. A malformed call, an unknown tool,
arguments that do not fit the schema, a tool that raises or times out: each is answered with an
error message the policy reads, and counted; none stops the run.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.agentic.parsers import ParsedTurn, ToolCall
from hybridflow.agentic.tools import Tool

__all__ = ["QUEUE_WAIT_S", "Environment", "Reply", "ToolEnvironment", "ToolOutcome"]

QUEUE_WAIT_S = 60.0
"""How long a tool call may wait for a free worker (``agentic.tool_workers``) before it is
answered with an error; tools that hang hold their workers (a Python thread cannot be stopped)."""


@dataclass
class ToolOutcome:
    """Counts of one reply's tool calls (added to the trajectory's stats)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    malformed: int = 0


@dataclass
class Reply:
    """The environment's answer to one turn."""

    messages: list[dict[str, str]] = field(default_factory=list)
    """Observation messages (``tool`` or ``user``) appended before the policy's next turn."""
    done: bool = False
    reward: float | None = None
    outcome: ToolOutcome = field(default_factory=ToolOutcome)


class Environment(Protocol):
    """One trajectory's counterpart; ``step`` runs in a worker thread, off the engine's path."""

    def step(self, text: str) -> Reply: ...


class ToolEnvironment:
    """Answers tool calls with the registered tools; a turn without one ends the trajectory."""

    def __init__(
        self,
        tools: Sequence[Tool],
        parse: Callable[[str], ParsedTurn],
        *,
        pool: concurrent.futures.Executor,
        row: Any = None,
    ) -> None:
        self.tools: Mapping[str, Tool] = {t.name: t for t in tools}
        self.parse, self.pool, self.row = parse, pool, row

    def step(self, text: str) -> Reply:
        turn = self.parse(text)
        if not turn.wants_tools:
            return Reply(done=True)
        outcome = ToolOutcome(calls=len(turn.calls), malformed=len(turn.malformed))
        # parallel calls run together; their answers come back in the calls' order
        runs = []
        for call in turn.calls:
            started = threading.Event()
            runs.append((call, started, self.pool.submit(self._call, call, started)))
        messages = [self._answer(*run, outcome) for run in runs]
        messages += [{"role": "tool", "content": f"error: {why}"} for why in turn.malformed]
        return Reply(messages=messages, outcome=outcome)

    def _call(self, call: ToolCall, started: threading.Event) -> str:
        started.set()
        found = self.tools.get(call.name)
        if found is None:
            raise LookupError(f"unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}")
        wrong = found.argument_errors(call.arguments)
        if wrong is not None:
            raise TypeError(f"{call.name}: {wrong}")
        result = found.fn(**call.arguments)
        return result if isinstance(result, str) else json.dumps(result)

    def _answer(
        self, call: ToolCall, started: threading.Event, future: concurrent.futures.Future, outcome: ToolOutcome
    ) -> dict[str, str]:
        timeout = self.tools[call.name].timeout_s if call.name in self.tools else None
        try:
            # the timeout is the tool's own time: waiting for a free worker does not count
            if not started.wait(QUEUE_WAIT_S):
                raise concurrent.futures.TimeoutError
            return {"role": "tool", "content": future.result(timeout=timeout)}
        except concurrent.futures.TimeoutError:
            outcome.timeouts += 1
            future.cancel()  # a running Python function cannot be stopped; its answer is dropped
            if not started.is_set():
                return {"role": "tool", "content": f"error: no tool worker was free for {QUEUE_WAIT_S:g} s"}
            return {"role": "tool", "content": f"error: {call.name} took longer than {timeout:g} s"}
        except Exception as error:  # a tool's own failure is the policy's observation
            outcome.errors += 1
            return {"role": "tool", "content": f"error: {type(error).__name__}: {error}"}
