"""Synthetic verifiable tasks: prompt files a tiny model can learn, scored by a known verifier.

```
task.name ──► TASKS[name]: sample(cfg, rng) -> TaskItem(question, answer, solution)
                           corrupt(item, rng) -> a plausible wrong response
make_task_files(task cfg, data cfg, out_dir, seed)
   held-out: heldout_size distinct questions      (rng "heldout": independent of train_size)
   train:    train_size rows, questions never held out (repeats allowed), and for a fraction
             task.sft_noise of them a wrong sft_response
   ──► <name>_train.jsonl, <name>_heldout.jsonl, then <name>_meta.json (the signature:
       task cfg, seed, column keys); a later call with the same signature reuses the files
```

Each row has the layout ``hybridflow.data`` reads, e.g. for arithmetic::

    {"prompt": "7+12=", "reward_model": {"ground_truth": 19}, "data_source": "arithmetic",
     "sft_response": "19"}

``data_source`` is the task's name, which is also the name of its reward function, so
under ``reward.function=auto`` (the default) ``rewards.score_responses`` scores these rows with
the task's verifier; an explicit ``reward.function`` scores them instead (preflight warns).

Why noisy demonstrations: SFT on them can at best imitate the mixture of right and wrong
answers, so held-out accuracy plateaus below 1; reward from the verifier is what RL adds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfschema.files import write_atomic
from hybridflow.config import DataConfig, SFTConfig, TaskConfig
from hybridflow.data import DATA_SOURCE_KEY, write_jsonl
from hybridflow.rewards import countdown

__all__ = [
    "TASKS",
    "Task",
    "TaskItem",
    "get_task",
    "make_task_files",
    "register_task",
    "task_corpus",
]

logger = logging.getLogger(__name__)

_SIGNATURE_VERSION = 1  # bump when a generator's output changes for the same config and seed
_CORPUS_ITEMS = 256


@dataclass(frozen=True, kw_only=True)
class TaskItem:
    """One generated problem."""

    question: str
    """The prompt text (short: the tiny model's context is small)."""
    answer: Any
    """The reference answer the task's reward function takes."""
    solution: str | list[dict[str, str]]
    """A correct response: the clean SFT demonstration (a list of messages: a multi-turn one)."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """A task generator, registered by name in ``TASKS``."""

    sample: Callable[[TaskConfig, random.Random], TaskItem]
    """A random problem."""
    corrupt: Callable[[TaskItem, random.Random], Any]
    """A plausible but wrong response to a problem (the noisy SFT demonstration)."""


TASKS: dict[str, Task] = {}
"""Task generators by name; a task's name is also its rows' data_source and reward name."""


def register_task(name: str, task: Task) -> Task:
    """Register ``task`` under ``name``; its rows get ``data_source=name``."""
    if name in TASKS and TASKS[name] is not task:
        raise ValueError(f"task {name!r} is already registered")
    TASKS[name] = task
    return task


def get_task(name: str) -> Task:
    """The task registered as ``name``."""
    if name not in TASKS:
        raise ValueError(f"task.name={name!r} is not one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]


# --------------------------------------------------------------------------- arithmetic


def _arithmetic_sample(cfg: TaskConfig, rng: random.Random) -> TaskItem:
    a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand)
    op = rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a  # non-negative answers: one less thing for a tiny model to learn
    value = a + b if op == "+" else a - b
    return TaskItem(question=f"{a}{op}{b}=", answer=value, solution=str(value))


def _arithmetic_corrupt(item: TaskItem, rng: random.Random) -> str:
    # off by one or two, the kind of slip a model makes; never negative, never right
    deltas = [d for d in (-2, -1, 1, 2) if item.answer + d >= 0]
    return str(item.answer + rng.choice(deltas))


register_task("arithmetic", Task(sample=_arithmetic_sample, corrupt=_arithmetic_corrupt))


# --------------------------------------------------------------------------- multiply (a tool task)


def _multiply_sample(cfg: TaskConfig, rng: random.Random) -> TaskItem:
    low = max(2, cfg.max_operand // 10)
    a, b = rng.randint(low, cfg.max_operand), rng.randint(low, cfg.max_operand)
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    turns = [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]
    return TaskItem(question=f"{a}*{b}=", answer=a * b, solution=turns)


def _multiply_corrupt(item: TaskItem, rng: random.Random) -> list[dict[str, str]]:
    # a guess without the calculator: near the product, never it; only the tool gets it right,
    # so RL has to make the policy use it
    guess = item.answer + rng.choice([-1, 1]) * rng.randint(1, max(1, item.answer // 50))
    return [{"role": "assistant", "content": str(guess)}]


register_task("multiply", Task(sample=_multiply_sample, corrupt=_multiply_corrupt))


# --------------------------------------------------------------------------- max


def _max_sample(cfg: TaskConfig, rng: random.Random) -> TaskItem:
    a, b = rng.sample(range(cfg.max_operand + 1), 2)  # distinct: the answer is never ambiguous
    return TaskItem(question=f"max({a},{b})=", answer=max(a, b), solution=str(max(a, b)))


def _max_corrupt(item: TaskItem, rng: random.Random) -> str:
    # the smaller operand: every wrong demonstration makes the same mistake, so imitation
    # learns the comparison but the wrong preference, and only the verifier can flip it
    a, b = (int(x) for x in item.question[4:-2].split(","))
    return str(min(a, b))


register_task("max", Task(sample=_max_sample, corrupt=_max_corrupt))


# --------------------------------------------------------------------------- countdown

_COUNTDOWN_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _countdown_equation(numbers: list[int], rng: random.Random) -> tuple[str, int]:
    """A random equation using each of ``numbers`` (three) once with + - *, and its value."""
    x, y, z = rng.sample(numbers, 3)
    inner, outer = rng.choice("+-*"), rng.choice("+-*")
    if rng.random() < 0.5:
        value = _COUNTDOWN_OPS[outer](_COUNTDOWN_OPS[inner](x, y), z)
        return f"({x}{inner}{y}){outer}{z}", value
    value = _COUNTDOWN_OPS[outer](x, _COUNTDOWN_OPS[inner](y, z))
    return f"{x}{outer}({y}{inner}{z})", value


def _countdown_sample(cfg: TaskConfig, rng: random.Random) -> TaskItem:
    for _ in range(1000):  # a positive target comes within a few draws
        numbers = sorted(rng.randint(1, cfg.max_operand) for _ in range(3))
        equation, target = _countdown_equation(numbers, rng)
        if target > 0:
            # sorted numbers make the question canonical: one problem, one question text
            question = f"Make {target} with {' '.join(map(str, numbers))}"
            return TaskItem(question=question, answer={"target": target, "numbers": numbers}, solution=equation)
    raise AssertionError("no positive countdown target in 1000 draws")


def _countdown_corrupt(item: TaskItem, rng: random.Random) -> str:
    # one operator swapped: still an equation over the given numbers, with the wrong value
    text = item.solution
    swaps = [
        text[:i] + op + text[i + 1 :]
        for i, c in enumerate(text)
        if c in _COUNTDOWN_OPS
        for op in _COUNTDOWN_OPS
        if op != c
    ]
    rng.shuffle(swaps)
    wrong = [s for s in swaps if countdown(s, item.answer) < 1.0]
    return wrong[0] if wrong else f"{text}+1"  # +1 always misses: the value moves by one


register_task("countdown", Task(sample=_countdown_sample, corrupt=_countdown_corrupt))


# --------------------------------------------------------------------------- splits


def _max_draws(size: int) -> int:
    return 20 * size + 10_000  # far above what a space a few times larger than size needs


def _heldout_items(task: Task, cfg: TaskConfig, rng: random.Random) -> list[TaskItem]:
    items: dict[str, TaskItem] = {}
    for _ in range(_max_draws(cfg.heldout_size)):
        item = task.sample(cfg, rng)
        items.setdefault(item.question, item)
        if len(items) == cfg.heldout_size:
            return list(items.values())
    raise ValueError(
        f"task {cfg.name!r}: found only {len(items)} distinct questions for "
        f"task.heldout_size={cfg.heldout_size}; lower task.heldout_size or raise task.max_operand"
    )


def _train_items(task: Task, cfg: TaskConfig, rng: random.Random, held_out: set[str]) -> list[TaskItem]:
    items: list[TaskItem] = []
    for _ in range(_max_draws(cfg.train_size)):
        item = task.sample(cfg, rng)
        if item.question not in held_out:
            items.append(item)
            if len(items) == cfg.train_size:
                return items
    raise ValueError(
        f"task {cfg.name!r}: the held-out split takes (nearly) every question; lower "
        f"task.heldout_size={cfg.heldout_size} or raise task.max_operand={cfg.max_operand}"
    )


def _sft_responses(task: Task, items: list[TaskItem], noise: float, rng: random.Random) -> list[Any]:
    """Each item's solution, but a wrong response for exactly round(noise * len) of them."""
    noisy = set(rng.sample(range(len(items)), round(noise * len(items))))
    return [task.corrupt(item, rng) if i in noisy else item.solution for i, item in enumerate(items)]


# --------------------------------------------------------------------------- files


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``"a.b"``."""
    for part in reversed(dotted.split(".")[1:]):
        value = {part: value}
    return {dotted.split(".")[0]: value}


@dataclass(frozen=True, kw_only=True)
class _Layout:
    prompt_key: str
    answer_key: str
    sft_key: str

    def row(self, name: str, item: TaskItem, sft_response: str) -> dict[str, Any]:
        return {
            self.prompt_key: item.question,
            **_nested(self.answer_key, item.answer),
            DATA_SOURCE_KEY: name,
            self.sft_key: sft_response,
        }


def _signature(cfg: TaskConfig, layout: _Layout, seed: int) -> dict[str, Any]:
    return {
        "version": _SIGNATURE_VERSION,
        "task": dataclasses.asdict(cfg),
        "seed": seed,
        "layout": dataclasses.asdict(layout),
    }


def _generate(cfg: TaskConfig, seed: int) -> tuple[list[TaskItem], list[TaskItem], list[str]]:
    """Held-out items, train items and the train SFT responses; a function of (cfg, seed)."""
    task = get_task(cfg.name)
    heldout = _heldout_items(task, cfg, random.Random(f"hybridflow.tasks:{cfg.name}:{seed}:heldout"))
    train_rng = random.Random(f"hybridflow.tasks:{cfg.name}:{seed}:train")
    train = _train_items(task, cfg, train_rng, {item.question for item in heldout})
    return heldout, train, _sft_responses(task, train, cfg.sft_noise, train_rng)


def _reusable(meta: Path, paths: tuple[Path, Path], signature: dict[str, Any]) -> bool:
    if not (meta.is_file() and all(p.is_file() for p in paths)):
        return False
    try:
        return json.loads(meta.read_text()) == json.loads(json.dumps(signature))
    except (OSError, json.JSONDecodeError):
        return False


def make_task_files(
    cfg: TaskConfig, data_cfg: DataConfig, out_dir: str | os.PathLike, *, seed: int, sft_key: str | None = None
) -> tuple[Path, Path]:
    """Write the task's train and held-out jsonl files into ``out_dir``; return their paths.

    Rows use ``data_cfg.prompt_key`` and ``data_cfg.answer_key`` (nested for dotted keys) and
    ``sft_key`` (default: ``SFTConfig.response_key``'s default). The files are a function of
    (cfg, seed): existing files with the same signature in ``<name>_meta.json`` are reused,
    anything else is regenerated, each file written atomically and the signature last. Call it
    on one rank and let the others wait: ranks writing at once write the same bytes, though.
    """
    layout = _Layout(
        prompt_key=data_cfg.prompt_key,
        answer_key=data_cfg.answer_key,
        sft_key=sft_key if sft_key is not None else SFTConfig().response_key,
    )
    out = Path(out_dir)
    paths = (out / f"{cfg.name}_train.jsonl", out / f"{cfg.name}_heldout.jsonl")
    meta, signature = out / f"{cfg.name}_meta.json", _signature(cfg, layout, seed)
    if _reusable(meta, paths, signature):
        logger.info("reusing the %s task files in %s", cfg.name, out)
        return paths
    meta.unlink(missing_ok=True)  # files half rewritten must not pass for the old signature
    heldout, train, responses = _generate(cfg, seed)
    write_jsonl(paths[0], [layout.row(cfg.name, i, r) for i, r in zip(train, responses)])
    write_jsonl(paths[1], [layout.row(cfg.name, i, i.solution) for i in heldout])
    write_atomic(meta, json.dumps(signature, indent=2) + "\n")
    logger.info(
        "wrote the %s task: %d train rows (sft_noise=%g), %d held-out rows, in %s",
        cfg.name,
        len(train),
        cfg.sft_noise,
        len(heldout),
        out,
    )
    return paths


def task_corpus(cfg: TaskConfig) -> list[str]:
    """Sample texts of the task (chat role names, questions, solutions) for training a
    tokenizer whose merges suit the task's digits, operators and phrasing."""
    task, rng = get_task(cfg.name), random.Random(f"hybridflow.tasks:{cfg.name}:corpus")
    items = [task.sample(cfg, rng) for _ in range(_CORPUS_ITEMS)]
    return ["system user assistant tool"] + [text for i in items for text in (i.question, *_texts(i.solution))]


def _texts(solution: str | list[dict[str, str]]) -> list[str]:
    return [solution] if isinstance(solution, str) else [m["content"] for m in solution]
