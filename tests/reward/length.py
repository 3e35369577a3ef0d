"""A reward that differs between a random model's samples: the response's length in characters
(a group of equal rewards has no gradient, so a run's policy must move for a test to see it)."""


def chars(response: str, answer) -> float:  # noqa: ARG001 (the reward function's signature)
    return len(response) / 16
