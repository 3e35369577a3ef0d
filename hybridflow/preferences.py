"""Preference pairs for reward-model training (``run.mode=rm``): rows read from jsonl / parquet.

```
row  ── chosen / rejected (rm.chosen_key, rm.rejected_key) ──► PreferencePair(prompt, chosen, rejected)
        texts + data.prompt_key            (verl's RM parquet, OpenRLHF's prompt/chosen/rejected)
        chats ending in the assistant's turn (HF preference sets: UltraFeedback's binarized
                                              chosen / rejected messages, the prompt turns inside)
        texts without a prompt               (hh-rlhf's whole dialogues: scored as they are)
PreferencePair ── encode_pair ──► chosen ids, rejected ids: the prompt as RL prompts are encoded
                                  (chat template), the response and the end-of-turn token after
                                  it, as an RL sample ends
```

A bad row (a column missing, a type, chosen and rejected with different prompts, too long) is
skipped with its file and row, or stops the run, as ``data.on_bad_row`` says, the way prompt
rows are (``hybridflow.data``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config import DataConfig
from hybridflow.data import (
    DATA_SOURCE_KEY,
    BadRow,
    BadRows,
    as_encodable,
    check_prompt,
    is_message,
    optional_str,
    reader_for,
    write_jsonl,
)

__all__ = ["PreferencePair", "encode_pair", "make_task_pairs", "read_pairs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PreferencePair:
    """One preference: two responses to one prompt, the first preferred."""

    uid: str
    """``"<path>:<line or row>"``, as prompt rows are named."""
    prompt: str | list[dict[str, str]] | None
    """The prompt (text or chat); None: the responses are whole texts scored as they are."""
    chosen: str
    rejected: str
    data_source: str | None = None


def _response(value: Any, key: str) -> tuple[list[dict[str, str]] | None, str]:
    """(the turns before it, or None for text; the response text) of a chosen / rejected cell."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"empty response in {key!r}")
        return None, value
    if isinstance(value, list) and value and all(is_message(m) for m in value):
        if value[-1]["role"] != "assistant":
            raise BadRow(f"the chat in {key!r} ends with a {value[-1]['role']!r} turn, not the assistant's response")
        before = [{"role": m["role"], "content": m["content"]} for m in value[:-1]]
        return before, value[-1]["content"]
    raise BadRow(f"{key!r} is of type {type(value).__name__}; expected text or a chat ending in the assistant's turn")


def _make_pair(uid: str, record: Any, cfg: DataConfig, chosen_key: str, rejected_key: str) -> PreferencePair:
    if isinstance(record, BadRow):
        raise record
    if not isinstance(record, Mapping):
        raise BadRow(f"a row must be an object of columns, not of type {type(record).__name__}")
    for key in (chosen_key, rejected_key):
        if record.get(key) is None:
            raise BadRow(f"no column {key!r} (rm.chosen_key / rm.rejected_key)")
    turns_c, chosen = _response(record[chosen_key], chosen_key)
    turns_r, rejected = _response(record[rejected_key], rejected_key)
    if turns_c != turns_r:
        raise BadRow(f"{chosen_key!r} and {rejected_key!r} answer different conversations (their turns before differ)")
    prompt = record.get(cfg.prompt_key)
    if prompt is not None:
        prompt = check_prompt(prompt, cfg.prompt_key)
    if turns_c:  # the chat carries its own prompt turns (a prompt column beside them repeats them)
        prompt = turns_c
    return PreferencePair(
        uid=uid, prompt=prompt, chosen=chosen, rejected=rejected, data_source=optional_str(record, DATA_SOURCE_KEY)
    )


def read_pairs(paths: Sequence[str], cfg: DataConfig, *, chosen_key: str, rejected_key: str) -> list[PreferencePair]:
    """The good preference rows of every file in ``paths``, in file order (bad rows as
    ``data.on_bad_row`` says); a file without one good row is a ValueError."""
    if not paths:
        raise ValueError("no preference files given; set data.train_files (or leave it empty for the task's pairs)")
    pairs: list[PreferencePair] = []
    for path_text in paths:
        path = Path(path_text)
        bad = BadRows(path_text, cfg, "fix the row")
        kept = 0
        for number, record in reader_for(path).rows(path):
            uid = f"{path_text}:{number}"
            try:
                pairs.append(_make_pair(uid, record, cfg, chosen_key, rejected_key))
                kept += 1
            except BadRow as reason:
                bad.add(uid, str(reason))
        bad.summarise()
        if not kept:
            raise ValueError(
                f"{path_text}: no usable preference rows ({bad.count} bad, see the warnings above); "
                f"check rm.chosen_key={chosen_key!r}, rm.rejected_key={rejected_key!r}"
            )
    return pairs


def encode_pair(pair: PreferencePair, tokenizer, cfg: DataConfig, end_id: int, use_chat: bool) -> tuple[list, list]:
    """Token ids of (prompt + chosen, prompt + rejected), each response followed by ``end_id``;
    ``BadRow`` when one is longer than data.max_prompt_length + data.max_response_length."""
    from hybridflow.rollout.tokens import encode_prompts

    prompt_ids: list[int] = []
    if pair.prompt is not None:
        (prompt_ids,) = encode_prompts(tokenizer, [as_encodable(pair.prompt, use_chat, cfg.system_prompt)])
    limit = cfg.max_prompt_length + cfg.max_response_length
    out = []
    for response in (pair.chosen, pair.rejected):
        ids = list(prompt_ids) + tokenizer(response, add_special_tokens=False)["input_ids"] + [end_id]
        if len(ids) > limit:
            raise BadRow(
                f"{len(ids)} tokens with the response, more than data.max_prompt_length + "
                f"data.max_response_length = {limit}"
            )
        out.append(ids)
    return out[0], out[1]


def make_task_pairs(task_cfg, data_cfg: DataConfig, out_dir: str | Path, *, seed: int) -> tuple[Path, Path]:
    """The synthetic task's preference pairs as train and held-out jsonl files: the correct
    answer chosen; rejected, the task's plausible wrong answer or, half of the time, the answer
    of another question (so that a reward model learns the property, not the wrong answer's
    shape: for ``max`` the smaller operand, and numbers above the larger one too). A held-out
    question's answer is paired with every other answer of the task (for ``max``: 9 pairs each)."""
    from hybridflow.tasks import _generate, get_task

    task = get_task(task_cfg.name)
    heldout, train, _ = _generate(task_cfg, seed)
    if not isinstance(train[0].solution, str):
        raise ValueError(
            f"task.name={task_cfg.name}: its answers are multi-turn; the task's preference pairs are "
            "made for one-answer tasks (arithmetic, max, countdown), or give data.train_files"
        )
    rng = random.Random(f"hybridflow.preferences:{task_cfg.name}:{seed}")
    answers = sorted({str(i.solution) for i in train if isinstance(i.solution, str)})

    def row(item) -> dict[str, Any]:
        rejected = task.corrupt(item, rng)
        others = [a for a in answers if a != item.solution]
        if others and rng.random() < 0.5:
            rejected = rng.choice(others)
        return {
            data_cfg.prompt_key: item.question,
            "chosen": item.solution,
            "rejected": rejected,
            DATA_SOURCE_KEY: task_cfg.name,
        }

    def against_all(item) -> list[dict[str, Any]]:  # held out: the answer against every other one
        others = [a for a in answers if a != item.solution]
        return [{**row(item), "rejected": a} for a in others]

    out = Path(out_dir)
    paths = (out / f"{task_cfg.name}_pairs_train.jsonl", out / f"{task_cfg.name}_pairs_heldout.jsonl")
    write_jsonl(paths[0], [row(i) for i in train])
    write_jsonl(paths[1], [pair for i in heldout for pair in against_all(i)])
    logger.info("wrote the %s task's preference pairs: %d train, %d held-out", task_cfg.name, len(train), len(heldout))
    return paths
