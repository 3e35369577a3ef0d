"""The RL driver loop: every rank walks the ExecutionPlan's stages once per step.

```
plan = lower(cfg)                                       the plan `hybridflow plan` prints
enter(plan.start_mode)
for step in steps:
    fields = {prompts, answers}                         (the same draw on every rank)
    for stage in plan.stages:                           generate, reward, old_logprob, ...,
        enter(stage.switch.target)                      colocation switch, when the plan has one
        out = OPS[stage.node.op](session, stage.node, Inputs(stage.node, fields), step)
        fields |= out.fields; metrics |= out.metrics    (the node's outputs; what it measured)
    metrics -> MLflow; held-out score every run.heldout_every; checkpoint every run.checkpoint_every
```

What one step's ops hand each other is in ``fields`` only: the graph's edges (``step.Inputs``
refuses an op any other field); the session holds what lives longer (``session``).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch.distributed as dist
from tqdm import tqdm

from hybridflow.algorithms.shaping import KL_COEF_NEXT
from hybridflow.runtime import gates, startup_clock, stops, switches
from hybridflow.runtime.learning_signal import GROUPS_EQUAL, clip_warning, no_signal_warning
from hybridflow.runtime.ops import OPS, Heldout, NonFiniteStep, heldout_reward, heldout_teacher_kl
from hybridflow.runtime.progress import write_progress
from hybridflow.runtime.recovery import METRIC as RESTARTS
from hybridflow.runtime.samples import RECORD_KEYS, StepView, chosen, local_records
from hybridflow.runtime.session import Session, gather_to_driver
from hybridflow.runtime.step import Inputs, Produced, Step, StepUndo
from hybridflow.sample_files import HELDOUT_COLUMNS, HELDOUT_PATTERN, STEP_PATTERN

__all__ = ["heldout", "run_step", "train_rl"]

logger = logging.getLogger(__name__)


def _step_metrics(f: dict, measured: dict[str, float], times: dict[str, float]) -> dict[str, float]:
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
        **measured,
        **times,
    }
    metrics["timing/step"] = sum(times.values())
    return metrics


def _checked(node, returned: Produced) -> dict:
    """The fields of ``returned`` if they are exactly those ``node`` declares (the graph's checks
    rely on it)."""
    if set(returned.fields) != set(node.outputs):
        raise AssertionError(
            f"op {node.op!r} of node {node.name!r} returned fields {sorted(returned.fields)}; "
            f"the node declares {sorted(node.outputs)}"
        )
    return returned.fields


def run_step(s: Session, stages, step: Step) -> dict[str, float]:
    """One RL step through the plan's stages; returns its metrics (same on every rank)."""
    began = time.perf_counter()
    prompts = s.data.prompt_batch(step.index)
    f = {"prompts": prompts, "answers": [p.row.answer for p in prompts]}
    measured, times, errors = {}, {}, 0
    restarts = s.engines.restarts
    restarted = restarts.used if restarts is not None else 0
    record = not s.run.executed_stages
    for index, stage in enumerate(stages, 1):
        started = time.perf_counter()
        if stage.switch is not None:  # from where the last stage left: the planned switch, unless a step was skipped
            switches.enter(s, stage.switch.target)
        try:
            produced = OPS[stage.node.op](s, stage.node, Inputs(stage.node, f), step)
        except Exception as error:  # the record and the last line name the stage and step it broke
            _mark_stage(error, f"{stage.node.name}, step {step.index + 1}")
            raise
        f.update(_checked(stage.node, produced))
        measured.update(produced.metrics)
        errors += produced.reward_errors
        times[f"timing/{stage.node.name}"] = time.perf_counter() - started
        if record:
            s.run.executed_stages.extend(stage.describe(index))
    if restarts is not None and restarts.used > restarted:  # lost engines replaced within the step
        measured[RESTARTS] = float(restarts.used - restarted)
    metrics = _step_metrics(f, measured, times)
    metrics["reward/errors"] = float(errors)
    _record_step(s, stages, f, step)
    history = s.run.state.history
    cut = None if s.cfg.agentic.enabled else clip_warning(s.cfg, history, metrics)  # multi-turn warns per turn
    silent = no_signal_warning(s.cfg, history, metrics, f["responses"], s.run.state.sft_losses)
    for warning in (silent, cut):
        if warning and s.run.is_driver:
            logger.warning("step %d: %s", step.index + 1, warning)
    if s.pipeline is not None:  # how much generation overlapped training (asks the engine ranks)
        trained = f["kept"].fields["responses"] if "kept" in f else f["responses"]
        metrics.update(s.pipeline.end_step(float(trained.lengths.sum())))
    metrics["timing/step_wall"] = time.perf_counter() - began  # the stages and what runs between them
    return metrics


def _mark_stage(error: Exception, where: str) -> None:
    """``error.failed_stage``: the innermost stage it escaped (the worker's record reads it)."""
    if getattr(error, "failed_stage", None) is None:
        with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attributes
            error.failed_stage = where


def _step_view(stages, f: dict) -> StepView | None:
    """What a step's samples are read from: the rollout trained on with its rewards, the other
    score sources the reward mixed in, the per-token fields the algorithm computed."""
    if "responses" not in f or "scores" not in f:
        return None
    per_token = {k: f[k] for k in ("advantages", "old_logprobs") if k in f}
    if "kept" in f:  # dynamic sampling trained on the groups it kept
        kept = f["kept"].fields
        return StepView(kept["responses"], kept["scores"], {}, per_token)
    scores = {}
    for node in (stage.node for stage in stages if stage.node.op == "reward"):
        if node.option("scores_field") == "scores":
            for name in ("model", "judge"):
                field = node.option(f"{name}_scores_field", None)
                if field in f:
                    scores[name] = f[field]
    return StepView(f["responses"], f["scores"], scores, per_token)


def _write_samples(
    s: Session, view: StepView, positions: list[int], name: str, *, step: int, version: int
) -> list[dict] | None:
    """Each DP leader's records of ``positions`` gathered on the driver, which writes them and
    returns them (None on the other ranks)."""
    mine = []
    if s.run.shard.leader:
        multi_turn = s.cfg.agentic.enabled
        mine = local_records(
            view, positions, step=step, version=version, tokenizer=s.data.tokenizer, multi_turn=multi_turn
        )
    parts = gather_to_driver(mine, group=s.run.shard.group)
    if parts is None or s.run.samples is None:
        return None
    records = sorted((record for part in parts for record in part), key=lambda r: r["sample"])
    s.run.samples.write(name, records)
    return records


def _record_step(s: Session, stages, f: dict, step: Step) -> None:
    """``run.samples_per_step`` of the step's samples to ``samples/step_NNNNNN.jsonl``."""
    view = _step_view(stages, f)
    count = s.cfg.run.samples_per_step
    if view is None or count <= 0:
        return
    positions = chosen(view.rollout.groups, count)
    done = step.index + 1
    records = _write_samples(s, view, positions, STEP_PATTERN.format(done), step=done, version=step.index)
    if records:  # a table per step in wandb; MLflow keeps the held-out ones (a file each)
        s.run.tracker.log_table(f"samples/step_{done:06d}", records, RECORD_KEYS, mlflow=False)


def _record_heldout(s: Session, scored: Heldout, step: int) -> None:
    """Every held-out prompt's greedy response, its answer and score, to ``samples/heldout_step_NNNNNN.jsonl``."""
    if scored.rollout is None:
        return
    view = StepView(scored.rollout, scored.scores, {}, {})
    positions = list(range(scored.rollout.total))
    records = _write_samples(s, view, positions, HELDOUT_PATTERN.format(step), step=step, version=step)
    if records:  # and as a table in the trackers, one per scoring
        s.run.tracker.log_table(f"heldout/step_{step:06d}", records, HELDOUT_COLUMNS)


def _steer_kl(s: Session, metrics: dict[str, float]) -> None:
    """After an applied step, the in-reward KL coefficient moves by the KL it measured (adaptive
    controller; a fixed one stays), and the step records where it left it (resume reads it)."""
    if "actor/reward_kl" in metrics:
        metrics[KL_COEF_NEXT] = s.models.kl_reward.update(
            metrics["actor/reward_kl"], int(metrics["actor/reward_kl_responses"])
        )


def _skip(s: Session, error: NonFiniteStep, undo: StepUndo) -> dict[str, float]:
    """A step with a non-finite update leaves no trace: the updates it made before are rolled
    back, and an engine that dropped its weights for training gets the (unchanged) ones back."""
    undone = undo.rollback()
    logger.warning(
        "%s; run.on_nan=skip: going on without this step%s",
        error,
        " (its earlier updates rolled back)" if undone else "",
    )
    sync = s.engines.sync
    if sync is not None and sync.engine_drops_weights:
        switches.enter(s, "sync")
        sync.push()
    return {"actor/skipped_step": 1.0, "actor/rolled_back": float(undone)}


def _step_line(metrics: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows of a step: its reward and the share of groups that carried a
    learning signal (a run whose groups all score alike learns nothing, however long it runs)."""
    line = {"reward": f"{metrics.get('reward/mean', float('nan')):.3f}"}
    if GROUPS_EQUAL in metrics:
        line["signal"] = f"{1.0 - metrics[GROUPS_EQUAL]:.0%}"
    if metrics.get("heldout/reward") is not None:
        line["heldout"] = f"{metrics['heldout/reward']:.3f}"
    return line


def heldout(s: Session, step: int, *, announce: bool = False) -> float | None:
    """The held-out score with the engines' current weights (None: no held-out prompts); its
    reward errors join the run's count. With a distillation teacher, the held-out KL to it is
    recorded too (``state.heldout_teacher_kl``, ``heldout/teacher_kl``). ``announce``: say what
    runs and what it scored (the first scoring waits for the engine's warm-up: no silent minute;
    later ones show in the step bar and the summary)."""
    count, driver = len(s.data.heldout_prompts), s.run.is_driver and announce
    if count and driver:
        logger.info("held-out: scoring %d prompts (greedy) at step %d ...", count, step)
    started = time.perf_counter()
    scored = heldout_reward(s)
    reward, errors = scored.reward, scored.errors
    _record_heldout(s, scored, step)
    if reward is not None and driver:
        logger.info("held-out: reward %.3f over %d prompts in %.0f s", reward, count, time.perf_counter() - started)
    s.run.state.reward_errors += errors
    kl = heldout_teacher_kl(s)
    if kl is not None:
        s.run.state.heldout_teacher_kl.append((step, kl))
        s.run.tracker.log_metrics({"heldout/teacher_kl": kl}, step=step)
    return reward


def train_rl(s: Session, plan, *, save) -> bool:
    """Steps ``state.step`` .. ``run.steps`` of ``plan`` (an ``ExecutionPlan``); ``save(step)``
    writes a checkpoint. False: stopped early after a checkpoint asked for (``stops``)."""
    run = s.run
    cfg, state = run.cfg, run.state
    if plan.start_mode is not None:
        switches.enter(s, plan.start_mode)
    bar = tqdm(
        range(state.step, cfg.run.steps),
        initial=state.step,
        total=cfg.run.steps,
        desc="rl",
        unit="step",
        disable=not run.is_driver,
    )
    if run.is_driver:
        write_progress(run.out_dir, phase="rl", done=state.step, total=cfg.run.steps)
    started = state.step
    for step in bar:
        undo = StepUndo(cfg.run.on_nan == "skip" and s.models.updates_per_step() > 1)
        try:
            metrics = run_step(s, plan.stages, Step(step, undo))
            _steer_kl(s, metrics)
        except NonFiniteStep as error:
            if cfg.run.on_nan == "stop":
                raise
            metrics = _skip(s, error, undo)
        metrics.update(gates.apply(cfg.checks, metrics, step))  # before this step's checkpoint
        done = step + 1
        if cfg.run.heldout_every and done % cfg.run.heldout_every == 0 and done < cfg.run.steps:
            reward = heldout(s, done)
            metrics["heldout/reward"] = reward
            state.heldout.append((done, reward))
        state.reward_errors += int(metrics.get("reward/errors", 0))
        state.step = done
        state.history.append({"step": done, **metrics})
        run.tracker.log_metrics(metrics, step=done)
        bar.set_postfix(_step_line(metrics))
        if run.is_driver:
            write_progress(run.out_dir, phase="rl", done=done, total=cfg.run.steps)
            if done == started + 1:  # this start's first RL step (benchmarks/startup.py)
                startup_clock.mark("first_step")
                startup_clock.write(run.out_dir)
        saved, requested = stops.checkpoint_due(
            run.out_dir,
            done=done,
            total=cfg.run.steps,
            every=cfg.run.checkpoint_every,
            is_driver=run.is_driver,
            group=run.shard.group,
        )
        if saved or requested:
            switches.enter(s, "train")  # the optimizer state back on the device, as it is saved
            save(done)
        if requested:
            if run.is_driver:
                stops.done_request(run.out_dir)
                logger.warning("checkpointed step %d as %s asked; stopping", done, stops.REQUEST_FILE)
            return False
    dist.barrier()
    return True
