"""Environments for the end-to-end runs (``agentic.environment=tests.agentic.envs:...``)."""

from __future__ import annotations

from hybridflow.agentic.env import Reply


class AskAgain:
    """Answers the policy's first turn with a user message asking it to check, ends at the
    second: every trajectory has two policy turns and one observation between them."""

    def __init__(self, tools, parse, *, pool, row) -> None:
        self.turns = 0

    def step(self, text: str) -> Reply:
        self.turns += 1
        if self.turns == 1:
            return Reply(messages=[{"role": "user", "content": "Are you sure? Answer again."}])
        return Reply(done=True)


class RevealAnswer:
    """Answers the first turn with the row's reference answer (an environment that reads its
    trajectory's data row), ends at the second."""

    def __init__(self, tools, parse, *, pool, row) -> None:
        self.row, self.turns = row, 0

    def step(self, text: str) -> Reply:
        self.turns += 1
        if self.turns == 1:
            return Reply(messages=[{"role": "user", "content": f"hint: {self.row.answer}"}])
        return Reply(done=True)


class AskTwice:
    """Asks the policy to check its first two turns and scores the third 1.0: a trajectory of
    three turns whose environment must be the same object throughout (it counts)."""

    def __init__(self, tools, parse, *, pool, row) -> None:
        self.turns = 0

    def step(self, text: str) -> Reply:
        self.turns += 1
        if self.turns < 3:
            return Reply(messages=[{"role": "user", "content": f"Check {self.turns}."}])
        return Reply(done=True, reward=1.0)
