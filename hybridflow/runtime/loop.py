"""The RL driver loop: every rank walks the ExecutionPlan's stages once per step.

```
plan = lower(cfg)                                       the plan `hybridflow plan` prints
enter(plan.start_mode)
for step in steps:
    fields = {prompts, answers}                         (the same draw on every rank)
    for stage in plan.stages:                           generate, reward, old_logprob, ...,
        enter(stage.switch.target)                      colocation switch, when the plan has one
        fields |= OPS[stage.node.op](session, stage.node, fields)       update_actor, sync_weights
    metrics -> MLflow; held-out score every run.heldout_every; checkpoint every run.checkpoint_every
```
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
from tqdm import tqdm

from hybridflow.algorithms.shaping import KL_COEF_NEXT
from hybridflow.runtime import gates, stops, switches
from hybridflow.runtime.ops import OPS, NonFiniteStep, current, heldout_reward
from hybridflow.runtime.progress import write_progress
from hybridflow.runtime.session import Session, StepUndo

__all__ = ["train_rl"]

logger = logging.getLogger(__name__)


def _step_metrics(f: dict, times: dict[str, float], s: Session) -> dict[str, float]:
    ro, scores = f["responses"], f["scores"]  # every sample's numbers, on every rank
    lengths = ro.lengths.float()
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float(ro.truncated.float().mean()),
        "rollout/tokens_per_s": float(lengths.sum()) / max(ro.seconds, 1e-9),
        **f.get("actor_metrics", {}),
        **f.get("critic_metrics", {}),
        **f.get("rollout_weights", {}),
        **s.step_metrics,
        **times,
    }
    metrics["timing/step"] = sum(times.values())
    return metrics


def _checked(node, returned: dict) -> dict:
    """``returned`` if it holds exactly the fields ``node`` declares (the graph's checks rely on it)."""
    if set(returned) != set(node.outputs):
        raise AssertionError(
            f"op {node.op!r} of node {node.name!r} returned fields {sorted(returned)}; "
            f"the node declares {sorted(node.outputs)}"
        )
    return returned


def run_step(s: Session, stages, step: int) -> dict[str, float]:
    """One RL step through the plan's stages; returns its metrics (same on every rank)."""
    s.step_metrics, s.stale_weights = {}, None
    began = time.perf_counter()
    prompts = s.prompt_batch(step)
    f = {"prompts": prompts, "answers": [p.row.answer for p in prompts]}
    times = {}
    record = not s.executed_stages
    for index, stage in enumerate(stages, 1):
        started = time.perf_counter()
        if stage.switch is not None:  # from where the last stage left: the planned switch, unless a step was skipped
            switches.enter(s, stage.switch.target)
        f.update(_checked(stage.node, OPS[stage.node.op](s, stage.node, f, step)))
        times[f"timing/{stage.node.name}"] = time.perf_counter() - started
        if record:
            s.executed_stages.extend(stage.describe(index))
    metrics = _step_metrics(f, times, s)
    if s.pipeline is not None:  # how much generation overlapped training (asks the engine ranks)
        metrics.update(s.pipeline.end_step(float(current(f)[0].lengths.sum())))
    metrics["timing/step_wall"] = time.perf_counter() - began  # the stages and what runs between them
    return metrics


def _steer_kl(s: Session, metrics: dict[str, float]) -> None:
    """After an applied step, the in-reward KL coefficient moves by the KL it measured (adaptive
    controller; a fixed one stays), and the step records where it left it (resume reads it)."""
    if "actor/reward_kl" in metrics:
        metrics[KL_COEF_NEXT] = s.kl_reward.update(
            metrics["actor/reward_kl"], int(metrics["actor/reward_kl_responses"])
        )


def _updates_per_step(s: Session) -> int:
    """Optimizer updates one RL step makes (every trained role, every epoch and mini-batch)."""
    roles = sum(role is not None for role in (s.actor, s.critic))
    return roles * s.algo.ppo_epochs * s.algo.mini_batches


def _skip(s: Session, error: NonFiniteStep) -> dict[str, float]:
    """A step with a non-finite update leaves no trace: the updates it made before are rolled
    back, and an engine that dropped its weights for training gets the (unchanged) ones back."""
    undone = s.undo.rollback()
    logger.warning(
        "%s; run.on_nan=skip: going on without this step%s",
        error,
        " (its earlier updates rolled back)" if undone else "",
    )
    if s.sync is not None and s.sync.engine_drops_weights:
        switches.enter(s, "sync")
        s.sync.push()
    return {"actor/skipped_step": 1.0, "actor/rolled_back": float(undone)}


def train_rl(s: Session, plan, *, save) -> bool:
    """Steps ``s.state.step`` .. ``run.steps`` of ``plan`` (an ``ExecutionPlan``); ``save(step)``
    writes a checkpoint. False: stopped early after a checkpoint asked for (``stops``)."""
    cfg, state = s.cfg, s.state
    if plan.start_mode is not None:
        switches.enter(s, plan.start_mode)
    bar = tqdm(
        range(state.step, cfg.run.steps),
        initial=state.step,
        total=cfg.run.steps,
        desc="rl",
        unit="step",
        disable=not s.is_driver,
    )
    if s.is_driver:
        write_progress(s.out_dir, phase="rl", done=state.step, total=cfg.run.steps)
    for step in bar:
        s.undo = StepUndo(cfg.run.on_nan == "skip" and _updates_per_step(s) > 1)
        try:
            metrics = run_step(s, plan.stages, step)
            _steer_kl(s, metrics)
        except NonFiniteStep as error:
            if cfg.run.on_nan == "stop":
                raise
            metrics = _skip(s, error)
        metrics.update(gates.apply(cfg.checks, metrics, step))  # before this step's checkpoint
        done = step + 1
        if cfg.run.heldout_every and done % cfg.run.heldout_every == 0 and done < cfg.run.steps:
            reward = heldout_reward(s)
            metrics["heldout/reward"] = reward
            state.heldout.append((done, reward))
        state.step = done
        state.history.append({"step": done, **metrics})
        s.tracker.log_metrics(metrics, step=done)
        bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
        if s.is_driver:
            write_progress(s.out_dir, phase="rl", done=done, total=cfg.run.steps)
        saved = (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == cfg.run.steps
        requested = done < cfg.run.steps and stops.checkpoint_requested(
            s.out_dir, is_driver=s.is_driver, group=s.shard.group
        )
        if saved or requested:
            switches.enter(s, "train")  # the optimizer state back on the device, as it is saved
            save(done)
        if requested:
            if s.is_driver:
                stops.done_request(s.out_dir)
                logger.warning("checkpointed step %d as %s asked; stopping", done, stops.REQUEST_FILE)
            return False
    dist.barrier()
    return True
