"""A multi-turn trajectory as the trainer sees it: exactly the tokens the engine sampled, and
the observations between them in the chat template's form, never re-tokenised.

```
prompt ids (the row's chat, rendered once)
  + turn 1: the engine's sampled ids, with their log-probs        loss mask 1
  + observation: the template's tokens for the tool / user messages loss mask 0, log-prob 0
  + turn 2: sampled ids ...                                        loss mask 1
  ...
```

``ObservationRenderer`` finds an observation's tokens by difference: the template renders a
fixed conversation ending in an assistant turn, then the same with the observation messages
and the next assistant header; the second must extend the first, and what it adds (after the
text that follows the assistant's end token) is the observation. So the earlier turns are never
rendered again from text, and what the model produced is trained on as it produced it.

An observation's text is the tools', written by whatever the model ran: the tokenizer's special
and added tokens in it (``<|im_end|>``, ``<tool_call>``) are neutralised before it is rendered, so
a program cannot end the tool's turn and write one of its own into the model's context, and
control characters (NUL, terminal escape sequences) are written as visible escapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.rollout.base import FINISH_STOP, TURN_STATS, RolloutSample

__all__ = ["ObservationRenderer", "Trajectory", "TrajectoryStats", "final_turn", "turn_metrics"]

_ANCHOR = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

SPECIAL_TOKEN_MODES = ("escape", "refuse")

_BREAK = "\u200b"
"""Put inside a special token's text (a zero-width space): the tokenizer no longer matches it."""

_CONTROL_CHARACTERS = {c: f"\\x{c:02x}" for c in (*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F)}
"""C0 control characters but tab and line ends, and DEL: written as ``\\xNN``."""


def _markers(tokenizer) -> re.Pattern | None:
    """A pattern matching any of the tokenizer's special or added tokens' texts, longest first."""
    texts = {*tokenizer.get_added_vocab(), *tokenizer.all_special_tokens}
    texts = sorted((t for t in texts if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _broken(token: str) -> str:
    return token[0] + _BREAK + token[1:] if len(token) > 1 else f"\\u{ord(token):04x}"


class ObservationRenderer:
    """Token ids of observation messages after an assistant turn that ended in ``end_id``.

    Templates may render the last assistant turn unlike earlier ones (Qwen3's and other
    reasoning models' write an empty ``<think></think>`` block into the last one only): what the
    model sampled is kept as sampled anyway, so only the turns before the anchor's assistant turn
    must render alike, and the observation is what the template writes after that turn's end
    token. A template that changes the earlier turns themselves cannot be appended to."""

    def __init__(self, tokenizer, end_id: int, *, special_tokens: str = "escape") -> None:
        if special_tokens not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"special_tokens={special_tokens!r}; one of {', '.join(SPECIAL_TOKEN_MODES)}")
        self.tokenizer, self.end_id, self.special_tokens = tokenizer, end_id, special_tokens
        self._special = _markers(tokenizer)
        before = self._ids(_ANCHOR, add_generation_prompt=False)
        if end_id not in before:
            raise ValueError(
                f"the chat template does not end an assistant turn with token {end_id} "
                f"({tokenizer.convert_ids_to_tokens(end_id)!r}); set the model's end-of-turn token"
            )
        ends = [i for i, token in enumerate(before) if token == end_id]
        self._turns = len(ends)  # end tokens up to and including the anchor's assistant turn's
        # the earlier turns (system, user), up to where the assistant's turn begins: must not change
        self._earlier = before[: ends[-2] + 1] if len(ends) > 1 else []

    def _ids(self, messages, *, add_generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The tokens that follow the model's end token: ``messages`` and the next assistant
        header, as the template writes them."""
        after = self._ids([*_ANCHOR, *(self.safe(m) for m in messages)], add_generation_prompt=True)
        ends = [i for i, token in enumerate(after) if token == self.end_id]
        if after[: len(self._earlier)] != self._earlier or len(ends) < self._turns:
            raise ValueError(
                "the chat template renders the turns before the last one differently once observation "
                f"messages ({', '.join(m['role'] for m in messages)}) follow them, so a trajectory cannot "
                "grow token for token; give the tokenizer a template that renders earlier turns the same "
                "whatever follows (the chat_template of the model directory's tokenizer_config.json)"
            )
        return after[ends[self._turns - 1] + 1 :]

    def safe(self, message: Mapping[str, str]) -> dict[str, str]:
        """``message`` with its content fit for the model's context (see the module doc): special
        tokens escaped, or under ``refuse`` the content replaced by a line saying why."""
        if not isinstance(message.get("content"), str):
            return dict(message)
        text = message["content"].translate(_CONTROL_CHARACTERS)
        found = self._special.findall(text) if self._special is not None else []
        if found and self.special_tokens == "refuse":
            text = (
                f"[withheld: this output held the model's control token {_broken(found[0])} "
                "(agentic.tool_output_special_tokens=refuse)]"
            )
        elif found:
            text = self._special.sub(lambda match: _broken(match[0]), text)
        return {**message, "content": text}


@dataclass
class TrajectoryStats:
    """What happened in one trajectory (the step's ``agentic/...`` metrics sum these)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that raised, had bad arguments or named an unknown tool."""
    tool_timeouts: int = 0
    malformed_calls: int = 0
    observation_tokens: int = 0
    truncated_observations: int = 0
    truncated_turns: int = 0
    """Policy turns cut at their token budget before the end token (a tool call cut there is lost)."""

    def add(self, outcome) -> None:
        """Count one reply's tool calls (``env.ToolOutcome``)."""
        self.tool_calls += outcome.calls
        self.tool_errors += outcome.errors
        self.tool_timeouts += outcome.timeouts
        self.malformed_calls += outcome.malformed

    def counts(self) -> tuple[int, ...]:
        """The counts in ``rollout.base.TURN_STATS`` order (how they travel with a sample)."""
        return tuple(getattr(self, name) for name in TURN_STATS)


@dataclass
class Trajectory:
    """One trajectory under construction: the response side grows turn by turn."""

    prompt_ids: tuple[int, ...]
    prompt_index: int
    sample_index: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on the tokens the policy sampled, 0 on observations."""
    finish_reason: str = FINISH_STOP
    reward: float | None = None
    """Set by an environment that scores the trajectory itself; None: the reward function does."""
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)
    routed_experts: Any = None
    """The experts the engine routed every token to, from the last turn's call (``RolloutSample.
    routed_experts``); that call was fed the whole trajectory, so its routes cover every token
    but the last, the earlier turns' as the engine prefilled them; None without routing replay."""
    env: Any = None
    """Its environment, made at its first reply and kept with it (a paused trajectory's state)."""

    @property
    def context(self) -> list[int]:
        """What the engine continues from: the prompt and everything since."""
        return [*self.prompt_ids, *self.response_ids]

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float], routed_experts: Any = None) -> None:
        """The engine's sampled tokens of one turn, as sampled (and the routes of its call)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a turn of {len(ids)} tokens came with {len(logprobs)} log-probs")
        self.routed_experts = routed_experts
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.stats.turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        self.routed_experts = None  # the next turn's call brings routes that cover these
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.stats.observation_tokens += len(ids)

    def sample(self, since: int = 0) -> RolloutSample:
        """The trajectory as the trainer takes a rollout sample (``loss_mask`` marks the policy's
        tokens); ``since``: only the response from there on, the rest as its prompt (a paused
        trajectory's continuation, which ``runtime.replicas`` appends to what it has)."""
        return RolloutSample(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_ids=(*self.prompt_ids, *self.response_ids[:since]),
            response_ids=tuple(self.response_ids[since:]),
            logprobs=tuple(self.logprobs[since:]),
            finish_reason=self.finish_reason,
            loss_mask=tuple(self.loss_mask[since:]),
            turn_stats=self.stats.counts(),
            routed_experts=self.routed_experts,
        )


def final_turn(sample: RolloutSample) -> tuple[int, ...]:
    """The tokens of a sample's last policy turn (all of a single response): what its reward
    scores, not the tool answers before it."""
    mask = sample.loss_mask
    if not mask or all(mask):
        return sample.response_ids
    last_observed = len(mask) - 1 - mask[::-1].index(0)
    return sample.response_ids[last_observed + 1 :]


def turn_metrics(metas) -> dict[str, float]:
    """The step's ``agentic/...`` metrics from every sample's metadata (the same on every rank):
    means per trajectory and totals over the batch; empty without multi-turn samples."""
    rows = [(m.turn_stats, m.response_len) for m in metas if m.turn_stats]
    if not rows:
        return {}
    sums = {name: sum(stats[i] for stats, _ in rows) for i, name in enumerate(TURN_STATS)}
    tokens = sum(length for _, length in rows)
    return {
        "agentic/turns_mean": sums["turns"] / len(rows),
        "agentic/tool_calls_per_trajectory": sums["tool_calls"] / len(rows),
        "agentic/tool_errors": float(sums["tool_errors"]),
        "agentic/tool_timeouts": float(sums["tool_timeouts"]),
        "agentic/malformed_calls": float(sums["malformed_calls"]),
        "agentic/observation_token_share": sums["observation_tokens"] / max(tokens, 1),
        "agentic/truncated_observations": float(sums["truncated_observations"]),
        "agentic/truncated_turns": float(sums["truncated_turns"]),
    }
