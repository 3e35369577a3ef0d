"""A run's samples on disk, read without starting anything heavy (no torch): where they are, which
steps they cover, and a step's records picked as ``hybridflow samples`` shows them.

The runtime writes them (``hybridflow.runtime.samples``): ``<run>/samples/step_NNNNNN.jsonl`` per
RL step, ``<run>/samples/heldout_step_NNNNNN.jsonl`` per held-out scoring (step 0: before RL).
"""

from __future__ import annotations

import json
import random
import re
import textwrap
from pathlib import Path
from typing import Any

SAMPLES_DIR = "samples"
STEP_PATTERN, HELDOUT_PATTERN = "step_{:06d}.jsonl", "heldout_step_{:06d}.jsonl"
_STEP = re.compile(r"^(heldout_)?step_(\d{6})\.jsonl$")
PICKS = ("best", "worst", "random", "first")
HELDOUT_COLUMNS = ("step", "sample", "data_source", "prompt", "response", "answer", "reward", "response_tokens")
"""A held-out scoring's table in the trackers."""


def read(path: Path) -> list[dict]:
    """The records of one samples file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def steps(run_dir: Path, *, heldout: bool = False) -> list[int]:
    """The steps with a samples file (held-out scorings with ``heldout``), in order."""
    found = []
    for path in (Path(run_dir) / SAMPLES_DIR).glob("*.jsonl"):
        match = _STEP.match(path.name)
        if match and bool(match.group(1)) == heldout:
            found.append(int(match.group(2)))
    return sorted(found)


def step_file(run_dir: Path, step: int | None, *, heldout: bool = False) -> Path:
    """The samples file of ``step`` (None: the last); ValueError naming the steps there are."""
    there = steps(run_dir, heldout=heldout)
    kind = "held-out scorings" if heldout else "RL steps"
    if not there:
        raise ValueError(
            f"{Path(run_dir) / SAMPLES_DIR}: no samples of {kind} (a run writes them from its first step; "
            "run.samples_per_step=0 turns them off)"
        )
    chosen = there[-1] if step is None else step
    if chosen not in there:
        raise ValueError(f"no samples of step {chosen}: the {kind} with samples are {ranges(there)}")
    return Path(run_dir) / SAMPLES_DIR / (HELDOUT_PATTERN if heldout else STEP_PATTERN).format(chosen)


def ranges(values: list[int]) -> str:
    """``1-5, 8, 10-12``."""
    parts, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


def pick(records: list[dict], how: str, count: int, *, source: str | None = None, seed: int = 0) -> list[dict]:
    """``count`` records by reward (best, worst), at random (seeded) or as written (first),
    of ``data_source`` ``source`` only when given."""
    if how not in PICKS:
        raise ValueError(f"--pick {how}: choose one of {', '.join(PICKS)}")
    pool = [r for r in records if source is None or r.get("data_source") == source]
    if source is not None and not pool:
        sources = sorted({str(r.get("data_source")) for r in records})
        raise ValueError(f"no samples with data_source {source!r} here; there are: {', '.join(sources)}")
    if how == "best":
        pool = sorted(pool, key=lambda r: -r["reward"])
    elif how == "worst":
        pool = sorted(pool, key=lambda r: r["reward"])
    elif how == "random":
        pool = random.Random(seed).sample(pool, len(pool))
    return pool[:count]


def heldout_examples(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The held-out scoring at ``step``: its best generation as ``solved`` (None when every one
    scored 0 or less), its worst as ``failed`` (None when every one scored the top score, above 0),
    and ``count``; None without that scoring's file."""
    path = Path(run_dir) / SAMPLES_DIR / HELDOUT_PATTERN.format(step)
    records = read(path) if path.exists() else []
    if not records:
        return None
    best, worst = max(records, key=lambda r: r["reward"]), min(records, key=lambda r: r["reward"])
    keep = ("prompt", "response", "answer", "reward")
    solved = best["reward"] > 0
    failed = best["reward"] > worst["reward"] or not solved
    return {
        "solved": {k: best[k] for k in keep} if solved else None,
        "failed": {k: worst[k] for k in keep} if failed else None,
        "count": len(records),
    }


def one_line(example: dict, width: int = 88) -> str:
    """An example generation on one line: prompt -> response (expected, reward)."""
    prompt = textwrap.shorten(prompt_text(example["prompt"]), width=width // 2, placeholder=" ...")
    response = textwrap.shorten(
        " ".join(str(example["response"]).split()) or "(empty)", width=width // 2, placeholder=" ..."
    )
    return f"{prompt} -> {response!r} (expected {example['answer']}, reward {example['reward']:.3f})"


def prompt_text(prompt) -> str:
    """A prompt as one string: its text, or a chat's turns as ``role: content``."""
    if isinstance(prompt, str):
        return prompt
    return " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)


def describe(record: dict, *, width: int = 100, lines: int = 12) -> list[str]:
    """A record as a few lines: its numbers, the prompt cut to a line, the response's first lines."""
    numbers = [f"reward {record['reward']:.3f}"]
    numbers += [f"{name} {value:.3f}" for name, value in (record.get("scores") or {}).items()]
    if record.get("advantage") is not None:
        numbers.append(f"advantage {record['advantage']:+.3f}")
    numbers.append(f"tokens {record['prompt_tokens']}+{record['response_tokens']} ({record['finish_reason']})")
    if record.get("logprob_diff") is not None:
        numbers.append(f"logprob diff {record['logprob_diff']:.1e}")
    head = f"step {record['step']} sample {record['sample']} [{record.get('data_source')}] " + ", ".join(numbers)
    prompt = textwrap.shorten(prompt_text(record["prompt"]), width=width - 10, placeholder=" ...")
    body = record["trajectory"] if record.get("trajectory") else record["response"]
    shown = body.splitlines() or [""]
    out = [head, f"  prompt:   {prompt}", f"  expected: {record.get('answer')}"]
    out += [f"  {'response: ' if i == 0 else '          '}{line}" for i, line in enumerate(shown[:lines])]
    if len(shown) > lines:
        out.append(f"            ... {len(shown) - lines} more lines")
    return out
