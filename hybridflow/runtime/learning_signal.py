"""Is there anything to learn from? The learning signal of every RL step, watched from step 1.

    reward op ──► signal_metrics(scores, groups, no_answer)
                    signal/groups_equal      share of prompt groups whose rewards are all equal:
                                             group-normalised advantages are 0 there (GRPO,
                                             DAPO, RLOO ...), the step learns nothing from them
                    signal/no_answer         share of responses with no answer in the format
                                             their scorer reads (``rewards.Scored.no_answer``)
                    signal/groups_no_answer  share of groups where no response had one
    run_step ──► no_signal_warning(...)  after ``checks.no_signal_steps`` steps in a row without
                                         signal: one warning naming the reward function, why
                                         (no answer in its format, or every answer alike), an
                                         example response and the fixes

A run that starts from an instruct model its scorer cannot read (it answers "So, the answer is
7." where verl's GSM8K check wants "#### 7") scores every response 0: every advantage is 0, the
gradient is 0, and the weights never move. Nothing fails, so it must be said.
"""

from __future__ import annotations

import torch

from hybridflow.config import HybridflowConfig
from hybridflow.rewards import function_name

__all__ = ["GROUPS_EQUAL", "NO_ANSWER", "clip_warning", "no_signal_warning", "signal_metrics", "without_signal"]

GROUPS_EQUAL = "signal/groups_equal"
NO_ANSWER = "signal/no_answer"
GROUPS_NO_ANSWER = "signal/groups_no_answer"
CLIP_RATIO = "response_length/clip_ratio"
_SHOWN_CHARS = 160  # of the example response


def signal_metrics(scores: torch.Tensor, groups: torch.Tensor, no_answer: torch.Tensor) -> dict[str, float]:
    """The three shares above for one step's [N] rewards, group ids and no-answer flags. Groups
    of one sample (rollout.n=1) have no peers to differ from: the batch then counts as one group."""
    if len(scores) == 0:
        return {}
    _, inverse, size = torch.unique(groups, return_inverse=True, return_counts=True)
    if int(size.max()) < 2:
        inverse, size = torch.zeros_like(inverse), size.sum().reshape(1)
    count = len(size)
    high = torch.full((count,), -torch.inf).scatter_reduce(0, inverse, scores.float(), "amax")
    low = torch.full((count,), torch.inf).scatter_reduce(0, inverse, scores.float(), "amin")
    answered = torch.zeros(count).index_add_(0, inverse, (~no_answer).float())
    plural = size > 1
    return {
        GROUPS_EQUAL: float((high == low)[plural].float().mean()),
        NO_ANSWER: float(no_answer.float().mean()),
        GROUPS_NO_ANSWER: float((answered == 0)[plural].float().mean()),
    }


def without_signal(metrics: dict[str, float]) -> bool:
    """Whether a step's every group had equal rewards (a step without the metric, skipped: no)."""
    return metrics.get(GROUPS_EQUAL, 0.0) >= 1.0


def _streak(history: list[dict[str, float]], metrics: dict[str, float]) -> int:
    """Steps in a row without signal, ending with this one (``metrics``)."""
    count = 0
    for step in [metrics, *reversed(history)]:
        if not without_signal(step):
            break
        count += 1
    return count


def no_signal_warning(
    cfg: HybridflowConfig, history: list[dict[str, float]], metrics: dict[str, float], ro, sft_losses=()
) -> str | None:
    """The warning when this step makes ``checks.no_signal_steps`` in a row without signal (once
    per streak; ``history``: the steps before), else None. ``ro``: the step's rollout, whose
    first text on this rank is the example; ``sft_losses``: the warm-up's, when one ran."""
    needed = cfg.checks.no_signal_steps
    if not needed or _streak(history, metrics) != needed:
        return None
    names = sorted({function_name(source, cfg.reward) for source in ro.sources}) or [cfg.reward.function]
    scorer = f"reward function {', '.join(repr(n) for n in names)}"
    if metrics.get(NO_ANSWER, 0.0) >= 0.5:
        why = (
            f"{metrics[NO_ANSWER]:.0%} of the responses hold no answer in the format the {scorer} reads, "
            "so every one scores alike"
        )
        teach = (
            f"the warm-up ran ({len(sft_losses)} steps, loss {sft_losses[0]:.3f} -> {sft_losses[-1]:.3f}) without "
            "teaching it the format: give it more sft.steps or a higher sft.lr, and check that its targets "
            f"({cfg.sft.response_key}) end in that format"
            if sft_losses
            else "teach the model the format first (sft.steps=N with sft.response_key naming a worked solution "
            "that ends in it, e.g. extra_info.answer in verl's GSM8K parquet)"
        )
        other = "score with a function that reads what the model writes (reward.function=math_verify, or your own)"
        fixes = f"{teach}, or {other}"
    else:
        why = f"every response of a group gets the same score from the {scorer} (all right or all wrong)"
        fixes = (
            "give prompts of a difficulty the model sometimes solves, sample more varied responses "
            "(raise rollout.n or rollout.temperature), drop such groups and sample again "
            "(algorithm.filter_groups=true), or check the scorer on a few responses by hand"
        )
    example = ro.texts[0] if ro.texts else ""
    shown = example if len(example) <= _SHOWN_CHARS else example[:_SHOWN_CHARS] + "..."
    answer = f" (expected {ro.answers[0]!r})" if ro.texts else ""
    steps = f"{needed} steps in a row" if needed > 1 else "1 step"
    return (
        f"no learning signal for {steps}: {why}; the advantages are 0 and the weights do not "
        f"move. Example response: {shown!r}{answer}. Fix: {fixes}"
    )


def clip_warning(cfg: HybridflowConfig, history: list[dict[str, float]], metrics: dict[str, float]) -> str | None:
    """The warning the first time a step's responses hit ``data.max_response_length`` at or above
    ``checks.response_clip_ratio`` (once a run: ``history`` holds the steps before), else None.
    A cut response has no final answer for the scorer and teaches the model to ramble on."""
    limit = cfg.checks.response_clip_ratio
    ratio = metrics.get(CLIP_RATIO)
    if not limit or ratio is None or ratio < limit or any(h.get(CLIP_RATIO, 0.0) >= limit for h in history):
        return None
    return (
        f"{ratio:.0%} of this step's responses hit data.max_response_length={cfg.data.max_response_length} "
        f"tokens before they finished (checks.response_clip_ratio={limit:g}): a cut response rarely holds "
        "the final answer; raise data.max_response_length (its memory: hybridflow plan), or shape long "
        "responses down with algorithm.overlong_buffer_len"
    )
