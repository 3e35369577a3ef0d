"""What the policy wrote, on disk: each RL step's samples and each held-out scoring's generations.

RL is debugged by reading responses. Every RL step writes ``run.samples_per_step`` of its samples
(whole prompt groups, the first ones of the step's shuffled prompts: a group shows what the
advantage compared) to ``<run>/samples/step_NNNNNN.jsonl``; every held-out scoring writes every
held-out prompt's greedy response to ``<run>/samples/heldout_step_NNNNNN.jsonl``. One JSON object a
line (``RECORD_KEYS``), the text as the reward function was given it, so its score can be
recomputed from the file. Files are written whole (temporary file, then rename): a resumed run
that repeats a step rewrites that step's file, never appends twice. ``run.samples_budget_mb``
bounds the directory: the oldest step files go first (held-out files are kept). A write that
fails (a full disk) is said once and training goes on: samples are for reading, not resuming.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfschema.files import write_atomic
from hybridflow.sample_files import SAMPLES_DIR

logger = logging.getLogger(__name__)

RECORD_KEYS = (
    "step",  # the RL step that sampled it (0: held-out scoring before RL)
    "sample",  # position among the step's samples
    "group",  # its prompt's group (GRPO compares a group's rewards)
    "data_source",
    "prompt",  # as the data row has it: text, or chat messages
    "response",  # the text the reward function scored (a trajectory's last turn)
    "answer",  # the reference answer the reward function was given
    "reward",  # the step's reward (rule, reward model and judge mixed as reward.* weights say)
    "scores",  # each source's score where the step had more than the rule: {"model": x, "judge": y}
    "prompt_tokens",
    "response_tokens",
    "finish_reason",  # stop, or length when it hit data.max_response_length
    "advantage",  # mean over its response tokens (None where the algorithm computes none)
    "policy_version",  # the weights' version that sampled it (the step it was generated for, minus lag)
    "logprob_diff",  # mean |engine - trainer| log-prob over its response tokens (None: not computed)
    "trajectory",  # multi-turn: the whole response with tool calls and tool answers; else None
)


@dataclass(frozen=True)
class StepView:
    """What a step's samples are read from: its rollout, rewards and per-token fields."""

    rollout: Any
    """The ``Rollout`` trained on (after dynamic sampling's filter, where it ran)."""
    rewards: torch.Tensor
    """[N] the step's reward of every sample of ``rollout``."""
    scores: dict[str, torch.Tensor]
    """Other score sources [N] by name (model, judge)."""
    fields: dict[str, torch.Tensor]
    """This rank's [B, T] tensors present in the step: advantages, old_logprobs."""


def chosen(groups: torch.Tensor, count: int) -> list[int]:
    """Positions of the samples recorded: whole groups in their order, up to ``count`` samples."""
    if count <= 0 or not len(groups):
        return []
    order = list(dict.fromkeys(groups.tolist()))  # the groups as the step drew them
    size = math.ceil(len(groups) / len(order))
    keep = set(order[: max(1, math.ceil(count / size))])
    return [i for i, g in enumerate(groups.tolist()) if g in keep][:count]


def _mean_over_response(x_BT: torch.Tensor, mask_BT: torch.Tensor, row: int) -> float | None:
    m = mask_BT[row].bool()
    return float(x_BT[row][m].double().mean()) if m.any() else None


def local_records(
    view: StepView, positions: list[int], *, step: int, version: int, tokenizer, multi_turn: bool
) -> list[dict]:
    """This rank's rows among ``positions`` as records; ``version``: the policy version that
    sampled them when generated for the trainer's current one (``Rollout.behind`` is subtracted)."""
    ro = view.rollout
    local = ro.local_index(torch.tensor(positions, dtype=torch.long)) if positions else torch.empty(0)
    batch, out = ro.batch, []
    mask = batch["response_mask"]
    for position, row in zip(positions, local.tolist()):
        if row < 0:
            continue
        advantage = view.fields.get("advantages")
        old = view.fields.get("old_logprobs")
        response_ids = batch["input_ids"][row][mask[row].bool()].tolist()
        out.append({
            "step": step,
            "sample": position,
            "group": int(ro.groups[position]),
            "data_source": ro.sources[row],
            "prompt": ro.prompts[row],
            "response": ro.texts[row],
            "answer": _plain(ro.answers[row]),
            "reward": float(view.rewards[position]),
            "scores": {name: float(v[position]) for name, v in view.scores.items()},
            "prompt_tokens": int(batch["prompt_lengths"][row]),
            "response_tokens": int(ro.lengths[position]),
            "finish_reason": "length" if bool(ro.truncated[position]) else "stop",
            "advantage": None if advantage is None else _mean_over_response(advantage, mask, row),
            "policy_version": version - ro.behind,
            "logprob_diff": None if old is None else _mean_over_response((old - batch["logprobs"]).abs(), mask, row),
            "trajectory": tokenizer.decode(response_ids, skip_special_tokens=False) if multi_turn else None,
        })  # fmt: skip
    return out


def _plain(value: Any) -> Any:
    """A JSON-able answer (numpy scalars and arrays from parquet become numbers and lists)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return value.tolist() if hasattr(value, "tolist") else str(value)


class SampleWriter:
    """The driver's writer of ``<run>/samples/``: whole files, a size budget, one warning."""

    def __init__(self, out_dir: Path, *, budget_mb: float) -> None:
        self.dir = Path(out_dir) / SAMPLES_DIR
        self.budget = int(budget_mb * (1 << 20))
        self.failed = False
        self.trimmed = False

    def write(self, name: str, records: list[dict]) -> Path | None:
        """``records`` as ``samples/<name>`` (JSONL, sorted by sample); None when the write failed."""
        if self.failed:
            return None
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sorted(records, key=lambda r: r["sample"]))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = write_atomic(self.dir / name, text)
            self._trim()
        except OSError as error:
            self.failed = True
            logger.warning("samples: could not write %s (%s); training goes on without writing samples", name, error)
            return None
        return path

    def _trim(self) -> None:
        """The oldest step files out until the directory is within its budget."""
        steps = sorted(self.dir.glob("step_*.jsonl"))
        sizes = {p: p.stat().st_size for p in self.dir.glob("*.jsonl")}
        total = sum(sizes.values())
        while total > self.budget and len(steps) > 1:
            oldest = steps.pop(0)
            total -= sizes[oldest]
            oldest.unlink()
            if not self.trimmed:
                self.trimmed = True
                logger.info("samples: over run.samples_budget_mb, the oldest step files are removed from now on")
