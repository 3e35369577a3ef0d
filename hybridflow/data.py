"""RL prompt data: rows read from jsonl / parquet, tokenised prompts, a resumable sampler.

```
*.jsonl (one JSON object a line) ─┐  read_rows: check each row (prompt, answer, types);
*.parquet (one row a record)  ────┴─ a bad row is skipped with a warning or is fatal
                                          │             (data.on_bad_row)
                                          ▼
                               PromptRow(uid, prompt, answer, data_source, sft_response, extra)
                                          │  tokenize_rows: encode_prompts (chat template),
                                          ▼  too long -> a bad row like above
                               TokenizedPrompt(row, prompt_ids)
PromptSampler(n_rows, batch_size, seed).batch(step) -> row indices of RL step ``step``
```

Rows are named the way an editor shows them: jsonl by **line** (1-based, the number an editor
shows), parquet by **row** (0-based, the index pyarrow and pandas use). A row's ``uid`` is
``"<path>:<that number>"``.

``write_jsonl`` / ``write_parquet`` write generated data atomically (a temporary file in the
same folder, flushed, then renamed: ``hfschema.files.write_atomic``), so a reader never sees
half a file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfschema.files import write_atomic
from hybridflow.config import DataConfig, HybridflowConfig

__all__ = [
    "DATA_SOURCE_KEY",
    "BadRow",
    "BadRows",
    "DataReport",
    "PromptRow",
    "PromptSampler",
    "TokenizedPrompt",
    "as_encodable",
    "check_prompt",
    "is_message",
    "optional_str",
    "preview_files",
    "read_rows",
    "reader_for",
    "sft_key",
    "tokenize_rows",
    "write_jsonl",
    "write_parquet",
]

logger = logging.getLogger(__name__)

DATA_SOURCE_KEY = "data_source"
DEFAULT_PROMPT_KEY = "prompt"
"""``data.prompt_key``'s default."""
MESSAGES_KEY = "messages"
"""The chat-format column read as the prompt when a row has no ``prompt`` (``_from_messages``)."""
"""Column naming the row's origin; under ``reward.function=auto`` a registered reward name there
picks the reward function."""
_MAX_WARNINGS_PER_FILE = 10  # past this, bad rows of a file are counted, not logged one by one


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, kw_only=True)
class PromptRow:
    """One RL prompt with what the verifier and SFT need."""

    uid: str
    """``"<path>:<line>"`` for jsonl (1-based), ``"<path>:<row>"`` for parquet (0-based)."""
    prompt: str | list[dict[str, str]]
    """Raw text, or a chat: a list of ``{"role": ..., "content": ...}``."""
    answer: Any
    """The reference answer handed to the reward function (``data.answer_key``)."""
    data_source: str | None = None
    """Where the row comes from; a registered reward name here picks the reward function under
    ``reward.function=auto``."""
    sft_response: str | list[dict[str, str]] | None = None
    """The SFT target, when ``read_rows`` was given ``sft_key``: the answer's text, or a
    multi-turn continuation (assistant turns and the tool / user messages between them, ending
    with an assistant turn) that only the assistant turns are trained on."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other top-level columns."""


@dataclass(frozen=True, kw_only=True)
class TokenizedPrompt:
    """A prompt row and its token ids (chat template applied when configured)."""

    row: PromptRow
    """The row the ids come from."""
    prompt_ids: tuple[int, ...]
    """Token ids of the prompt, ending in the assistant's turn for chat prompts."""


@dataclass(kw_only=True)
class DataReport:
    """Counts of what ``read_rows`` kept and skipped, per file (filled in when passed)."""

    kept: dict[str, int] = field(default_factory=dict)
    """Good rows per file."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Bad rows skipped per file (``data.on_bad_row=skip``)."""
    too_long: list[int] = field(default_factory=list)
    """Token counts of the prompts ``tokenize_rows`` skipped as longer than ``data.max_prompt_length``."""

    @property
    def num_skipped(self) -> int:
        """Bad rows skipped over all files."""
        return sum(self.skipped.values())

    def check_dropped(self, name: str, key: str, cfg: DataConfig, *, kept: int) -> None:
        """ValueError in one line when more than ``data.max_dropped_share`` of ``name``'s rows
        (``key``: the setting naming them) were skipped, with the setting that keeps them; else
        log the one count of what was read, kept and skipped."""
        dropped = self.num_skipped + len(self.too_long)
        total = kept + dropped
        longest = max(self.too_long, default=0)
        keep = ""
        if self.too_long:
            count = len(self.too_long)
            keep = f"data.max_prompt_length={longest} keeps the {count} too long (the longest has {longest} tokens)"
        if total and dropped / total > cfg.max_dropped_share:
            malformed = f"{self.num_skipped} malformed (see the warnings above)" if self.num_skipped else ""
            why = ", ".join(x for x in (malformed, f"{len(self.too_long)} too long" if self.too_long else "") if x)
            fix = "; ".join(x for x in (keep, "fix or remove the malformed rows" if self.num_skipped else "") if x)
            raise ValueError(
                f"{key}: {dropped} of {total} {name} rows ({dropped / total:.0%}) would be dropped ({why}), more "
                f"than data.max_dropped_share={cfg.max_dropped_share:g}; {fix} (or raise data.max_dropped_share)"
            )
        logger.info(
            "%s: %d rows read, %d kept, %d skipped (%d malformed, %d longer than data.max_prompt_length=%d)",
            name, total, kept, dropped, self.num_skipped, len(self.too_long), cfg.max_prompt_length,
        )  # fmt: skip


class BadRow(Exception):
    """A row check failed; the message is the reason, without the file and row."""


# --------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class _Reader:
    rows: Callable[[Path], Iterator[tuple[int, Any]]]
    """(number, decoded row or BadRow) for each row of the file."""
    unit: str
    """How a row is named in messages, e.g. "line 3 (1-based)"."""


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as lines:  # decoded line by line: a bad byte is a bad row, named by its line
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield (
                    number,
                    BadRow(
                        f"not UTF-8 text (byte 0x{raw[error.start]:02x} at byte {error.start + 1} "
                        "of the line); re-encode the file as UTF-8"
                    ),
                )
                continue
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not rows
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                yield number, BadRow(f"invalid JSON ({error.msg} at column {error.colno})")


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq  # only parquet needs pyarrow

    try:
        batches = pq.ParquetFile(path).iter_batches()
        index = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield index, record
                index += 1
    except (OSError, ValueError) as error:  # pyarrow's errors derive from these
        raise ValueError(f"{path}: not a readable parquet file ({error})") from error


_READERS: dict[str, _Reader] = {
    ".jsonl": _Reader(_jsonl_rows, "line {n} (1-based)"),
    ".parquet": _Reader(_parquet_rows, "row {n} (0-based)"),
}
"""Row readers by file extension."""


def reader_for(path: Path) -> _Reader:
    """The row reader of ``path``'s format (by extension); ValueError naming the file when it is
    missing or of a format none reads."""
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"{path}: unsupported data file extension {path.suffix!r}; use one of: {', '.join(_READERS)}")
    if not path.is_file():
        raise ValueError(f"{path}: data file not found; check data.train_files / data.heldout_files")
    return reader


def _where(uid: str) -> str:
    """``"file.jsonl line 3 (1-based)"`` for a uid ``"file.jsonl:3"``."""
    path, number = uid.rsplit(":", 1)
    reader = _READERS.get(Path(path).suffix.lower())
    unit = reader.unit.format(n=number) if reader else f"row {number}"
    return f"{path} {unit}"


# --------------------------------------------------------------------------- row checks


def _lookup(record: Mapping[str, Any], dotted: str) -> Any:
    """The value under ``a.b.c`` (nested mappings); BadRow when a level is missing or null."""
    value: Any = record
    for depth, part in enumerate(dotted.split(".")):
        if not isinstance(value, Mapping) or value.get(part) is None:
            missing = ".".join(dotted.split(".")[: depth + 1])
            raise BadRow(f"no value under {missing!r} (reading {dotted!r})")
        value = value[part]
    return value


def is_message(message: Any) -> bool:
    """Whether ``message`` is one chat turn: a mapping with text ``role`` and ``content``."""
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def check_prompt(prompt: Any, key: str) -> str | list[dict[str, str]]:
    """``prompt`` (column ``key``) as text or a chat of turns; BadRow when it is neither or empty."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"empty prompt in {key!r}")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_message(m) for m in prompt):
        if not any(m["content"].strip() for m in prompt):
            raise BadRow(f"chat prompt in {key!r} has only empty messages")
        if prompt[-1]["role"] == "assistant":  # the engine would write a second assistant turn after it
            raise BadRow(
                f"the chat prompt in {key!r} ends with an assistant message, which the model would answer "
                "with another; end it with the user's turn (an SFT target goes in sft.response_key, or as "
                "the last turn of a 'messages' row)"
            )
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise BadRow(
        f"{key!r} is of type {type(prompt).__name__}; expected text or a non-empty list of "
        f"{{'role': str, 'content': str}} messages"
    )


def optional_str(record: Mapping[str, Any], key: str) -> str | None:
    """``record[key]`` if present (text), else None; BadRow when it is not text."""
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRow(f"{key!r} is of type {type(value).__name__}; expected text")
    return value


def _sft_response(record: Mapping[str, Any], key: str | None) -> str | None:
    """The SFT target under ``key``, a column or a dotted path into one (verl's GSM8K parquet keeps
    the worked solution in ``extra_info.answer``)."""
    if key is None:
        return None
    try:
        value = _lookup(record, key) if key not in record else record[key]
    except BadRow:
        value = None
    if isinstance(value, list) and value and all(is_message(m) for m in value):
        if value[-1]["role"] != "assistant":
            raise BadRow(
                f"the turns in {key!r} end with a {value[-1]['role']!r} message; the last must be the assistant's"
            )
        return value
    if value is not None and not isinstance(value, str):
        raise BadRow(
            f"{key!r} is of type {type(value).__name__}; expected text or a list of messages (sft.response_key)"
        )
    if not value:
        raise BadRow(f"no SFT response in {key!r} (sft.response_key)")
    return value


def _from_messages(record: Mapping[str, Any], cfg: DataConfig, sft_key: str | None) -> Mapping[str, Any]:
    """A chat-format row (``messages``, the layout of OpenAI-style and most SFT sets) under the
    default ``data.prompt_key``: its turns before a final assistant turn are the prompt, and that
    turn the SFT target when the row has none of its own."""
    if cfg.prompt_key != DEFAULT_PROMPT_KEY or DEFAULT_PROMPT_KEY in record or MESSAGES_KEY not in record:
        return record
    messages = record[MESSAGES_KEY]
    if not (isinstance(messages, list) and messages and all(is_message(m) for m in messages)):
        return record  # check_prompt names what is wrong with it
    last = messages[-1]
    turns = messages[:-1] if last["role"] == "assistant" and len(messages) > 1 else messages
    row = {**record, DEFAULT_PROMPT_KEY: turns}
    if sft_key is not None and row.get(sft_key) is None and turns is not messages:
        row[sft_key] = last["content"]
    return row


def _make_row(uid: str, record: Any, cfg: DataConfig, sft_key: str | None) -> PromptRow:
    if isinstance(record, BadRow):
        raise record
    if not isinstance(record, Mapping):
        raise BadRow(f"a row must be an object of columns, not of type {type(record).__name__}")
    record = _from_messages(record, cfg, sft_key)
    if record.get(cfg.prompt_key) is None:
        raise BadRow(f"no prompt column {cfg.prompt_key!r} (data.prompt_key)")
    prompt = check_prompt(record[cfg.prompt_key], cfg.prompt_key)
    answer = _lookup(record, cfg.answer_key)
    used = {cfg.prompt_key, MESSAGES_KEY, cfg.answer_key.split(".")[0], DATA_SOURCE_KEY, sft_key}
    return PromptRow(
        uid=uid,
        prompt=prompt,
        answer=answer,
        data_source=optional_str(record, DATA_SOURCE_KEY),
        sft_response=_sft_response(record, sft_key),
        extra={k: v for k, v in record.items() if k not in used},
    )


# --------------------------------------------------------------------------- bad rows


class BadRows:
    """Applies ``data.on_bad_row`` to the bad rows of one file: log and count, or raise."""

    def __init__(self, source: str, cfg: DataConfig, fix: str) -> None:
        self.source, self.policy, self.fix = source, cfg.on_bad_row, fix
        self.count = 0

    def add(self, uid: str, reason: str) -> None:
        """Record a bad row; raise a ValueError in ``fail`` mode."""
        if self.policy == "fail":
            raise ValueError(f"{_where(uid)}: {reason}; {self.fix}, or set data.on_bad_row=skip to skip such rows")
        if self.count < _MAX_WARNINGS_PER_FILE:
            logger.warning("skipping %s: %s", _where(uid), reason)
        elif self.count == _MAX_WARNINGS_PER_FILE:
            logger.warning("%s: more bad rows; counting them without a warning each", self.source)
        self.count += 1

    def summarise(self) -> None:
        if self.count:
            logger.warning("%s: skipped %d bad rows", self.source, self.count)


def _read_file(path_text: str, cfg: DataConfig, sft_key: str | None, report: DataReport) -> list[PromptRow]:
    path = Path(path_text)
    reader = reader_for(path)
    bad = BadRows(path_text, cfg, "fix the row")
    rows = []
    for number, record in reader.rows(path):
        uid = f"{path_text}:{number}"
        try:
            rows.append(_make_row(uid, record, cfg, sft_key))
        except BadRow as reason:
            bad.add(uid, str(reason))
    bad.summarise()
    report.kept[path_text], report.skipped[path_text] = len(rows), bad.count
    if not rows:
        raise ValueError(
            f"{path_text}: no usable rows ({bad.count} bad, see the warnings above); check the "
            f"file and data.prompt_key={cfg.prompt_key!r}, data.answer_key={cfg.answer_key!r}"
        )
    return rows


def read_rows(
    paths: Sequence[str | os.PathLike], cfg: DataConfig, *, sft_key: str | None = None, report: DataReport | None = None
) -> list[PromptRow]:
    """The good rows of every file in ``paths`` (``.jsonl`` or ``.parquet``), in file order.

    A malformed row (invalid JSON, missing or empty prompt, missing answer, wrong types, a
    missing ``sft_key`` when one is asked for) is logged and skipped, or raises a ValueError
    naming the file and row, as ``cfg.on_bad_row`` says. A missing file, an unsupported
    extension or a file without one good row is a ValueError. ``report``, when given, receives
    the kept and skipped counts per file.
    """
    if not paths:
        raise ValueError("no data files given; set data.train_files (or leave it empty for the task)")
    report = report if report is not None else DataReport()
    rows = [row for path in paths for row in _read_file(os.fspath(path), cfg, sft_key, report)]
    logger.debug("read %d prompt rows from %d file(s), skipped %d bad rows", len(rows), len(paths), report.num_skipped)
    return rows


# --------------------------------------------------------------------------- preflight

PREVIEW_ROWS = 1000
"""Rows of each file that ``preview_files`` reads (preflight must take seconds, not a full pass)."""


def _columns(records: Sequence[Any]) -> str:
    seen = dict.fromkeys(k for r in records if isinstance(r, Mapping) for k in r)
    return ", ".join(map(str, seen)) or "none"


def _preview_file(
    path_text: str, key: str, cfg: DataConfig, sft_key: str | None, sources: Counter, no_chat_template: str | None
) -> None:
    path = Path(path_text)
    where = f"{key}={path_text}"
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(
            f"{where}: unsupported data file extension {path.suffix!r}; convert it to one of: {', '.join(_READERS)}"
        )
    if not path.is_file():
        raise ValueError(f"{where}: no such file (relative paths are read from {os.getcwd()}); fix the path")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{where}: the file is not readable by this user; fix its permissions")
    try:
        records = [(n, r) for (n, r), _ in zip(reader.rows(path), range(PREVIEW_ROWS))]
    except (OSError, ValueError) as error:  # UnicodeDecodeError, or the parquet reader's ValueError
        raise ValueError(f"{where}: cannot be read ({error}); fix or replace the file") from None
    if not records:
        raise ValueError(f"{where}: the file holds no rows; fill it or remove it from {key.split('[')[0]}")
    first_bad, good = None, 0
    for number, record in records:
        try:
            row = _make_row(f"{path_text}:{number}", record, cfg, sft_key)
        except BadRow as reason:
            if cfg.on_bad_row == "fail":  # what the run would stop at, said now
                raise ValueError(
                    f"{where}: {reader.unit.format(n=number)}: {reason}; fix the row, or set "
                    "data.on_bad_row=skip to skip such rows"
                ) from None
            first_bad = first_bad or f"{reader.unit.format(n=number)}: {reason}"
            continue
        if no_chat_template is not None and not isinstance(row.prompt, str):
            raise ValueError(
                f"{where}: {reader.unit.format(n=number)}: the prompt is a list of chat messages but "
                f"the model in {no_chat_template} has no chat template; use a chat (instruct) model, "
                "add its chat_template to tokenizer_config.json, or give plain-text prompts"
            )
        good += 1
        sources[row.data_source] += 1
    if not good:
        raise ValueError(
            f"{where}: none of its first {len(records)} rows is usable ({first_bad}); its columns: "
            f"{_columns([r for _, r in records])}; set data.prompt_key / data.answer_key (or "
            "sft.response_key) to the file's columns"
        )


def sft_key(cfg: HybridflowConfig) -> str | None:
    """The column the training rows must carry an SFT target in: ``sft.response_key`` when SFT runs."""
    return cfg.sft.response_key if cfg.sft.steps > 0 or cfg.run.mode == "sft" else None


def preview_files(
    cfg: DataConfig, *, sft_key: str | None, with_heldout: bool = True, no_chat_template: str | None = None
) -> Counter:
    """What preflight checks of ``data.train_files`` and ``data.heldout_files`` without reading them
    whole: each exists, is readable, holds rows, and its first ``PREVIEW_ROWS`` rows carry the
    configured columns (at least one good row; none bad under ``data.on_bad_row=fail``), and no
    chat prompt when the model (``no_chat_template``: its directory) has no chat template. Returns
    the training rows previewed per ``data_source``; ValueError naming the key and the fix."""
    sources: Counter = Counter()
    for index, path in enumerate(cfg.train_files):
        _preview_file(os.fspath(path), f"data.train_files[{index}]", cfg, sft_key, sources, no_chat_template)
    for index, path in enumerate(cfg.heldout_files if with_heldout else ()):
        _preview_file(os.fspath(path), f"data.heldout_files[{index}]", cfg, None, Counter(), no_chat_template)
    return sources


def preview_rows(cfg: HybridflowConfig, paths: Sequence[str], *, sft_key: str | None = None) -> list[PromptRow]:
    """The good rows among the first ``PREVIEW_ROWS`` of each file (``preview_files`` checked them)."""
    rows = []
    for path_text in map(os.fspath, paths):
        records = zip(reader_for(Path(path_text)).rows(Path(path_text)), range(PREVIEW_ROWS))
        for (number, record), _ in records:
            try:
                rows.append(_make_row(f"{path_text}:{number}", record, cfg.data, sft_key))
            except BadRow:
                continue  # counted by the run; preflight said the first one
    return rows


def few_rows_warning(rows: int, per_step: int) -> str:
    """What a data set smaller than one step's prompts means for the run."""
    return (
        f"data.train_files hold {rows} usable rows, fewer than run.prompts_per_step={per_step}: every step "
        "repeats rows to fill itself (groups of one prompt several times); lower run.prompts_per_step or add rows"
    )


@functools.lru_cache(maxsize=2)
def model_tokenizer(path: str):
    """The tokenizer of the model directory (or converted checkpoint) ``path``, loaded once per
    process: the launcher reads it to decide the data lengths and again to check the prompts."""
    from transformers import AutoTokenizer  # here: a second or more to import, needed only now

    from hfschema.model_source import model_source

    return AutoTokenizer.from_pretrained(str(model_source(path).files))


def tool_schemas(cfg: HybridflowConfig) -> list[dict] | None:
    """The function schemas of ``agentic.tools``, which the chat template shows the policy."""
    if not cfg.agentic.enabled:
        return None
    from hybridflow.agentic.engine import configured_tools  # here: the tools' modules are heavy

    return [tool.schema() for tool in configured_tools(cfg.agentic)] or None


# --------------------------------------------------------------------------- tokenising


def as_encodable(prompt: str | list[dict[str, str]], use_chat: bool, system_prompt: str | None = None) -> Any:
    """What ``encode_prompts`` takes: a chat when templating (``system_prompt`` first unless the
    chat has a system turn), else raw text."""
    if not use_chat:
        if not isinstance(prompt, str):
            raise BadRow(
                "a chat prompt needs a chat template, but data.apply_chat_template is off or the tokenizer has none"
            )
        return prompt
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and not any(m["role"] == "system" for m in chat):
        chat.insert(0, {"role": "system", "content": system_prompt})
    return chat


class TooLong(BadRow):
    """A prompt over ``data.max_prompt_length`` tokens."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"the prompt has {tokens} tokens, more than data.max_prompt_length={limit}")
        self.tokens = tokens


def _encode_row(row: PromptRow, tokenizer, cfg: DataConfig, use_chat: bool, tools) -> TokenizedPrompt:
    from hybridflow.rollout.tokens import encode_prompts  # here: it imports torch; preflight reads rows without

    try:
        (ids,) = encode_prompts(tokenizer, [as_encodable(row.prompt, use_chat, cfg.system_prompt)], tools=tools)
    except ValueError as error:  # e.g. a prompt that encodes to no tokens
        raise BadRow(str(error)) from error
    if len(ids) > cfg.max_prompt_length:
        raise TooLong(len(ids), cfg.max_prompt_length)
    return TokenizedPrompt(row=row, prompt_ids=tuple(ids))


def tokenize_rows(
    rows: Sequence[PromptRow], tokenizer, cfg: DataConfig, tools=None, *, name: str = "prompts", report=None
) -> tuple[list[TokenizedPrompt], int]:
    """Token ids of each row's prompt, and how many rows were skipped.

    With ``cfg.apply_chat_template`` and a tokenizer that has a chat template, a text prompt
    becomes one user turn (the template shows it ``tools``' schemas, if any) and the template
    ends in the assistant's turn; otherwise text is
    encoded as is. A prompt longer than ``cfg.max_prompt_length`` tokens is a bad row handled
    by ``cfg.on_bad_row``. No prompt left is a ValueError. ``report`` (a ``DataReport``) receives
    the token counts of the prompts skipped as too long.
    """
    use_chat = cfg.apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    bad = BadRows(name, cfg, "raise data.max_prompt_length or fix the row")
    encoded = []
    for row in rows:
        try:
            encoded.append(_encode_row(row, tokenizer, cfg, use_chat, tools))
        except BadRow as reason:
            bad.add(row.uid, str(reason))
            if isinstance(reason, TooLong) and report is not None:
                report.too_long.append(reason.tokens)
    bad.summarise()
    if rows and not encoded:
        raise ValueError(
            f"all {len(rows)} prompts were bad (see the warnings above); raise "
            f"data.max_prompt_length={cfg.max_prompt_length} or check the data"
        )
    return encoded, bad.count


# --------------------------------------------------------------------------- sampling


class PromptSampler:
    """Row indices of each RL step: epochs of seeded shuffles, a pure function of (seed, step).

    Step ``s`` takes positions ``s * batch_size ...`` of the endless sequence made of one
    permutation of all rows per epoch, so every row comes once per epoch and a resumed run
    (a new sampler, the same seed) draws the same prompts at the same step.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if n_rows < 1:
            raise ValueError(f"PromptSampler needs at least one row, got n_rows={n_rows}")
        if batch_size < 1:
            raise ValueError(f"PromptSampler batch_size={batch_size} must be >= 1")
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self._cached: tuple[int, list[int]] | None = None  # the last epoch's permutation

    def epoch(self, step: int) -> int:
        """The epoch the first prompt of ``step`` belongs to."""
        return step * self.batch_size // self.n_rows

    def _order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            order = list(range(self.n_rows))
            if self.shuffle:
                # A str seed is hashed (sha512) by random.Random: stable across runs and versions.
                random.Random(f"hybridflow.data:{self.seed}:{epoch}").shuffle(order)
            self._cached = (epoch, order)
        return self._cached[1]

    def batch(self, step: int) -> list[int]:
        """Row indices for RL step ``step`` (0-based); a batch may run into the next epoch."""
        if step < 0:
            raise ValueError(f"PromptSampler.batch step={step} must be >= 0")
        start = step * self.batch_size
        positions = range(start, start + self.batch_size)
        return [self._order(p // self.n_rows)[p % self.n_rows] for p in positions]


# --------------------------------------------------------------------------- writers


def _plain(row: Any) -> Mapping[str, Any]:
    return dataclasses.asdict(row) if dataclasses.is_dataclass(row) else row


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (mappings, or dataclasses) as JSON lines, atomically; return the path."""

    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(_plain(row), ensure_ascii=False) + "\n")

    return write_atomic(path, write)


def write_parquet(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (mappings, or dataclasses) as one parquet table, atomically; return the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([_plain(row) for row in rows])
    return write_atomic(path, lambda temporary: pq.write_table(table, temporary))
