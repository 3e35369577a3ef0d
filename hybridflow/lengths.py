"""Prompt and response lengths decided from the data and the model when the config leaves them unset.

A run started from a model directory and data files should not inherit the synthetic task's
few-token budget: the prompt length is the longest prompt of the data's first rows, tokenised as
the run will (the model's tokenizer and chat template, the system prompt, the tools), rounded up
to leave room for longer rows further on; the response length is one and a half times the longest
worked answer the warm-up trains on, or ``RESPONSE_WITHOUT_ANSWERS``; both within the model's
context. ``load_config`` decides them once; the launcher hands the decided numbers to the ranks
on their command line, so every process, ``plan`` and ``--resolved`` agree.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.config import HybridflowConfig

logger = logging.getLogger(__name__)

SYNTHETIC = (64, 16)
"""The synthetic task's lengths: its prompts and answers are a few tokens; also what a config
whose data or tokenizer is not on this machine plans with (said in one line)."""
ROUND_TO = 64
"""Decided lengths are rounded up to this many tokens: rows past the first ones may be longer."""
RESPONSE_WITHOUT_ANSWERS = 1024
"""The response budget when no worked answers show how long an answer runs."""
ANSWER_HEADROOM = 1.5
"""How much longer than the longest worked answer a response may grow under RL."""


@dataclass(frozen=True)
class Decision:
    prompt: int
    response: int
    why: str
    """One line: where each number comes from, and how to choose another."""

    def overrides(self) -> list[str]:
        """The command-line overrides that give a rank these numbers without deciding again."""
        return [f"data.max_prompt_length={self.prompt}", f"data.max_response_length={self.response}"]


def _round_up(tokens: int) -> int:
    return -(-max(tokens, 1) // ROUND_TO) * ROUND_TO


def decide(cfg: HybridflowConfig) -> Decision | None:
    """The lengths ``cfg`` leaves unset (None), decided; None when both are set."""
    d = cfg.data
    if d.max_prompt_length is not None and d.max_response_length is not None:
        return None
    measured = _measure(cfg)
    if not isinstance(measured, str):
        return _from_measure(cfg, *measured)
    prompt = d.max_prompt_length if d.max_prompt_length is not None else SYNTHETIC[0]
    response = d.max_response_length if d.max_response_length is not None else SYNTHETIC[1]
    why = f"data lengths {prompt}/{response} (the synthetic task's where unset): {measured}"
    return Decision(prompt, response, why)


def _from_measure(cfg: HybridflowConfig, rows: int, longest_prompt: int, longest_answer: int | None) -> Decision:
    d, context = cfg.data, cfg.model.max_position_embeddings
    parts = []
    prompt = d.max_prompt_length
    if prompt is None:
        prompt = min(_round_up(longest_prompt), context - 1)
        parts.append(
            f"data.max_prompt_length={prompt} (the longest of the first {rows} training prompts has "
            f"{longest_prompt} tokens)"
        )
    response = d.max_response_length
    if response is None:
        if longest_answer:
            wanted = _round_up(int(longest_answer * ANSWER_HEADROOM))
            source = f"{ANSWER_HEADROOM:g} x the longest warm-up answer, {longest_answer} tokens"
        else:
            wanted = RESPONSE_WITHOUT_ANSWERS
            source = "no warm-up answers to measure"
        response = min(wanted, context - prompt)
        if response < wanted:
            source += f"; cut to the model's context of {context}"
        parts.append(f"data.max_response_length={response} ({source})")
    if response < 1:
        raise ValueError(
            f"data.max_prompt_length={prompt} leaves no room for a response in the model's context of "
            f"{context} tokens; set data.max_prompt_length and data.max_response_length to sum to at most {context}"
        )
    why = "decided from the data and the model: " + ", ".join(parts) + "; set them to choose"
    return Decision(prompt, response, why)


def _measure(cfg: HybridflowConfig) -> tuple[int, int, int | None] | str:
    """(rows measured, the longest prompt's tokens, the longest warm-up answer's tokens or None),
    or why they cannot be measured here."""
    path = cfg.model.path
    files = [os.fspath(p) for p in cfg.data.train_files]
    if not (path and os.path.isdir(os.path.expanduser(path)) and all(os.path.exists(p) for p in files)):
        return "the data or the model's tokenizer is not on this machine; the run decides them from the data"
    from hybridflow.data import model_tokenizer, preview_rows, tokenize_rows, tool_schemas

    tokenizer = model_tokenizer(path)
    sft_key = cfg.sft.response_key if cfg.sft.steps > 0 and cfg.run.mode != "rm" else None
    rows = preview_rows(cfg, files, sft_key=sft_key)
    unlimited = replace(cfg.data, max_prompt_length=1 << 30, on_bad_row="skip")
    try:
        encoded, _ = tokenize_rows(rows, tokenizer, unlimited, tool_schemas(cfg), name="training")
    except ValueError:
        encoded = []
    if not encoded:  # the run's own checks name why, row by row
        return "no prompt of the training files' first rows could be read"
    longest_prompt = max(len(e.prompt_ids) for e in encoded)
    answers = [_answer_tokens(tokenizer, row.sft_response) for row in rows if row.sft_response]
    return len(rows), longest_prompt, max(answers, default=None)


def _answer_tokens(tokenizer, response) -> int:
    """Tokens of a worked answer: its text, or a multi-turn continuation's turns together."""
    text = response if isinstance(response, str) else "".join(str(m.get("content") or "") for m in response)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
