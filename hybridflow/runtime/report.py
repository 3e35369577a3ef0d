"""The end of a run: ``summary.json``, a reward-curve PNG and a one-screen summary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow.runtime.learning_signal import GROUPS_EQUAL, NO_ANSWER, without_signal
from hybridflow.runtime.state import RunState, write_json_atomic
from hybridflow.sample_files import one_line

__all__ = ["format_summary", "plot_rewards", "summarise", "summarise_async", "write_summary"]

logger = logging.getLogger(__name__)


def summarise(
    cfg,
    state: RunState,
    *,
    heldout_after_rl: float | None,
    wall_seconds: float,
    data_rows_skipped: dict[str, int],
    reward_errors: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The run's headline numbers, with what it left out: bad data rows skipped (by data set)
    and reward calls that raised (scored 0)."""
    history = state.history
    first, last = (history[0], history[-1]) if history else ({}, {})
    return {
        "run": cfg.run.name,
        "algorithm": cfg.algorithm.name,
        "mode": cfg.run.mode,
        "steps": state.step,
        "sft_steps": len(state.sft_losses),
        "sft_loss_first": state.sft_losses[0] if state.sft_losses else None,
        "sft_loss_last": state.sft_losses[-1] if state.sft_losses else None,
        "heldout_reward_after_sft": state.heldout_after_sft,
        "heldout_reward_after_rl": heldout_after_rl,
        "train_reward_first": first.get("reward/mean"),
        "train_reward_last": last.get("reward/mean"),
        "heldout": [list(x) for x in state.heldout],
        "wall_seconds": wall_seconds,
        "data_rows_skipped": dict(data_rows_skipped),
        "reward_errors": reward_errors,
        "changed_on_resume": state.changes,
        "learning_signal": summarise_signal(history),
        **extra,
    }


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    path = out_dir / "summary.json"
    write_json_atomic(path, summary)
    return path


def plot_rewards(out_dir: Path, state: RunState) -> Path | None:
    """Training reward per step and held-out reward points, as ``reward_curve.png``."""
    if not state.history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in state.history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h.get("reward/mean", float("nan")) for h in state.history], label="train reward (mean)")
    if state.heldout:
        ax.plot([s for s, _ in state.heldout], [r for _, r in state.heldout], "o-", label="held-out reward (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "reward_curve.png"
    tmp = out_dir / "reward_curve.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


PANELS = (
    "reward: train (mean) and held-out (greedy)",
    "response length (mean) and clip ratio",
    "entropy of the policy",
    "KL and clip fraction",
    "grad norm",
    "step time by stage (s)",
)
"""The run figure's panels, in order: the curves a user reads first."""
_SERIES = {  # panel -> (metric, label) drawn on its left axis; a right axis where noted
    PANELS[1]: (("response_length/mean", "length (tokens)"),),
    PANELS[2]: (("actor/entropy", "entropy"),),
    PANELS[3]: (
        ("actor/ppo_kl", "KL(old || new)"),
        ("actor/kl_loss", "KL to the reference"),
        ("actor/reward_kl", "KL in the reward"),
    ),
    PANELS[4]: (("actor/grad_norm", "grad norm"),),
}
_RIGHT = {PANELS[1]: ("response_length/clip_ratio", "clip ratio"), PANELS[3]: ("actor/clipfrac", "clip fraction")}


def run_figure(state: RunState):
    """The run's figure: one panel per ``PANELS`` entry over the RL steps (a Matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = state.history
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9))
    for ax, title in zip(axes.flat, PANELS):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    reward = axes.flat[0]
    reward.plot(steps, [h.get("reward/mean", float("nan")) for h in history], label="train")
    if state.heldout:
        reward.plot([s for s, _ in state.heldout], [r for _, r in state.heldout], "o-", label="held-out")
    for ax, title in zip(axes.flat[1:5], PANELS[1:5]):
        for key, label in _SERIES[title]:
            if any(key in h for h in history):
                ax.plot(steps, [h.get(key, float("nan")) for h in history], label=label)
        if title in _RIGHT:
            key, label = _RIGHT[title]
            twin = ax.twinx()
            twin.plot(steps, [h.get(key, float("nan")) for h in history], "--", color="tab:red", label=label)
            twin.set_ylabel(label, color="tab:red")
    stages = sorted({k for h in history for k in h if k.startswith("timing/")} - {"timing/step", "timing/step_wall"})
    if stages:
        values = [[h.get(k, 0.0) for h in history] for k in stages]
        axes.flat[5].stackplot(steps, values, labels=[k.removeprefix("timing/") for k in stages])
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def plot_run(out_dir: Path, state: RunState) -> Path | None:
    """``run.png``: the run's figure (``run_figure``), written whole; None before the first RL step."""
    if not state.history:
        return None
    import matplotlib.pyplot as plt

    fig = run_figure(state)
    path, tmp = out_dir / "run.png", out_dir / "run.tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)
    return path


def _fmt(value: Any) -> str:
    return "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))


def _format_left_out(summary: dict[str, Any]) -> str:
    """What the run did not use, always shown: a clean run says so, a lossy one cannot hide it."""
    skipped, errors = summary["data_rows_skipped"], summary["reward_errors"]
    rows = f"{sum(skipped.values())} bad data rows"
    if any(skipped.values()):
        rows += " (" + ", ".join(f"{name} {count}" for name, count in skipped.items()) + "; see data.on_bad_row)"
    scored = f"{errors} reward errors" + (" (scored 0; see reward.on_error)" if errors else "")
    return f"  left out     {rows}, {scored}"


def summarise_signal(history: list[dict[str, float]]) -> dict[str, float | int] | None:
    """The learning signal over the run (``runtime/learning_signal.py``): the mean share of groups
    whose rewards differed, the steps where none did, the mean share of responses without an
    answer in the scorer's format."""
    rows = [h for h in history if GROUPS_EQUAL in h]
    if not rows:
        return None
    return {
        "groups_with_signal_mean": sum(1.0 - h[GROUPS_EQUAL] for h in rows) / len(rows),
        "steps_without_signal": sum(without_signal(h) for h in rows),
        "no_answer_mean": sum(h.get(NO_ANSWER, 0.0) for h in rows) / len(rows),
    }


def _format_signal(signal: dict[str, Any] | None) -> list[str]:
    if not signal:
        return []
    line = (
        f"  signal       {signal['groups_with_signal_mean']:.0%} of groups had rewards that differed (mean); "
        f"{signal['steps_without_signal']} steps had none"
    )
    if signal["no_answer_mean"]:
        line += f"; {signal['no_answer_mean']:.0%} of responses held no answer in the scorer's format"
    return [line]


def _format_examples(examples: dict[str, Any] | None) -> list[str]:
    """The last held-out scoring's solved and failed example, a line each."""
    if not examples:
        return []
    lines = []
    for kind in ("solved", "failed"):
        example = examples[kind]
        shown = one_line(example) if example else f"none of the {examples['count']} held-out responses"
        lines.append(f"  {kind:<12} {shown}")
    return lines


def _format_wall(summary: dict[str, Any]) -> str:
    line = f"  wall time    {summary['wall_seconds']:.0f} s"
    starts = summary.get("wall_seconds_per_start") or []
    if len(starts) > 1:  # a resumed run: the total alone would hide where the time went
        line += f" over {len(starts)} starts ({', '.join(f'{s:.0f}' for s in starts)} s; this one last)"
    return line


def format_summary(summary: dict[str, Any], out_dir: Path) -> str:
    """The one-screen summary printed at the end of ``hybridflow train``."""
    lines = [
        f"hybridflow train: {summary['run']} ({summary['algorithm']}, mode {summary['mode']})",
        f"  SFT          {summary['sft_steps']} steps, loss {_fmt(summary['sft_loss_first'])} -> "
        f"{_fmt(summary['sft_loss_last'])}",
        f"  RL           {summary['steps']} steps, train reward {_fmt(summary['train_reward_first'])} -> "
        f"{_fmt(summary['train_reward_last'])}",
        f"  held-out     {'after SFT' if summary['sft_steps'] else 'before RL'} "
        f"{_fmt(summary['heldout_reward_after_sft'])}, after RL {_fmt(summary['heldout_reward_after_rl'])}",
        *_format_signal(summary.get("learning_signal")),
        *_format_examples(summary.get("heldout_examples")),
        _format_left_out(summary),
        _format_wall(summary),
        f"  outputs      {out_dir}/summary.json, run.png, samples/, checkpoints/",
    ]
    moe = summary.get("moe")
    if moe:
        m = moe["metrics"]
        mismatch = m.get("moe/train/topk_mismatch", {}).get("mean")
        lines.append(
            f"  MoE          routing replay {moe['routing_replay']}, load max/mean "
            f"{_fmt(m.get('moe/train/load_max_mean', {}).get('last'))}, top-k mismatch in training "
            f"{_fmt(mismatch)} (mean)"
        )
    ar = summary.get("async_rl")
    if ar:
        lines.append(
            f"  async RL     {ar['mode']} (max staleness {ar['max_staleness']}), staleness mean "
            f"{_fmt(ar['staleness_mean'])} max {_fmt(ar['staleness_max'])}, generation overlapping "
            f"training {_fmt(ar['overlap_fraction_mean'])} of step time"
        )
        if ar.get("partial_rollout"):
            lines.append(
                f"               partial rollouts: {_fmt(ar['partial_samples'])} samples spanned a weight "
                f"update; token staleness mean {_fmt(ar['token_staleness_mean'])}"
            )
    ag = summary.get("agentic")
    if ag:
        lines.append(
            f"  multi-turn   {_fmt(ag['turns_mean'])} turns and {_fmt(ag['tool_calls_per_trajectory'])} tool calls "
            f"per trajectory (mean); tool errors {ag['tool_errors']:.0f}, timeouts {ag['tool_timeouts']:.0f}, "
            f"malformed calls {ag['malformed_calls']:.0f}, turns cut at their budget {ag['truncated_turns']:.0f}; "
            f"observations {_fmt(ag['observation_token_share'])} of response tokens"
        )
    if summary.get("mlflow_uri"):
        lines.append(f"  MLflow       run {summary.get('mlflow_run_id')} at {summary['mlflow_uri']}")
    if summary.get("tensorboard_dir"):
        lines.append(f"  TensorBoard  tensorboard --logdir {summary['tensorboard_dir']}")
    return "\n".join(lines)


def summarise_agentic(history: list[dict[str, float]]) -> dict[str, float | None]:
    """Multi-turn rollouts over the run: per-trajectory means and the totals of what failed."""
    rows = [h for h in history if "agentic/turns_mean" in h]

    def mean(key: str) -> float | None:
        return sum(h[key] for h in rows) / len(rows) if rows else None

    totals = ("tool_errors", "tool_timeouts", "malformed_calls", "truncated_observations", "truncated_turns")
    return {
        "turns_mean": mean("agentic/turns_mean"),
        "tool_calls_per_trajectory": mean("agentic/tool_calls_per_trajectory"),
        "observation_token_share": mean("agentic/observation_token_share"),
        **{name: sum(h[f"agentic/{name}"] for h in rows) for name in totals},
    }


def summarise_async(async_rl, history: list[dict[str, float]]) -> dict[str, Any]:
    """Asynchronous RL over the run: mode, K, sample staleness and overlap of generation with training."""

    def mean(key: str) -> float | None:
        values = [h[key] for h in history if key in h]
        return sum(values) / len(values) if values else None

    out = {
        "mode": async_rl.mode,
        "max_staleness": async_rl.lag,
        "staleness_mean": mean("async/staleness_mean"),
        "staleness_max": max((h.get("async/staleness_max", 0.0) for h in history), default=None),
        "overlap_fraction_mean": mean("async/overlap_fraction"),
        "dropped_samples": sum(h.get("async/dropped_samples", 0.0) for h in history),
    }
    if async_rl.partial_rollout:
        out.update(
            partial_rollout=True,
            token_staleness_mean=mean("async/token_staleness_mean"),
            partial_samples=sum(h.get("async/partial_samples", 0.0) for h in history),
        )
    return out
