"""The RL driver loop: every rank walks the algorithm's graph once per step.

```
for step in steps:
    fields = {prompts, answers}                         (the same draw on every rank)
    for node in graph.topological_order():              generate, reward, old_logprob, ...,
        fields |= OPS[node.op](session, node, fields)   update_actor, sync_weights
    metrics -> MLflow; held-out score every run.heldout_every; checkpoint every run.checkpoint_every
```
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from hybridflow.runtime.ops import OPS, NonFiniteStep, current, heldout_reward
from hybridflow.runtime.session import Session

__all__ = ["FAULT_ENV", "train_rl"]

logger = logging.getLogger(__name__)

FAULT_ENV = "HYBRIDFLOW_FAULT_AT_STEP"
"""Testing hook: the process exits abruptly when this RL step starts (a crash mid-training)."""


def _inject_fault(step: int) -> None:
    if os.environ.get(FAULT_ENV) == str(step):
        logger.error("%s=%d: simulating a crash", FAULT_ENV, step)
        os._exit(17)


def _step_metrics(f: dict, times: dict[str, float], s: Session) -> dict[str, float]:
    ro, _ = f["responses"], f["scores"]
    scores = f["scores"]
    lengths = ro.batch["response_lengths"].float()
    metrics = {
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float(ro.batch["truncated"].float().mean()),
        "rollout/tokens_per_s": float(lengths.sum()) / max(ro.seconds, 1e-9),
        **f.get("actor_metrics", {}), **f.get("critic_metrics", {}), **f.get("rollout_weights", {}), **s.extras.pop("metrics", {}), **times,
    }
    metrics["timing/step"] = sum(times.values())
    return metrics


def run_step(s: Session, order, step: int) -> dict[str, float]:
    """One RL step through the graph; returns its metrics (same on every rank)."""
    s.extras["metrics"] = {}
    prompts = s.prompt_batch(step)
    f = {"prompts": prompts, "answers": [p.row.answer for p in prompts]}
    times = {}
    for node in order:
        started = time.perf_counter()
        f.update(OPS[node.op](s, node, f, step))
        times[f"timing/{node.name}"] = time.perf_counter() - started
    return _step_metrics(f, times, s)


def train_rl(s: Session, graph, *, save) -> None:
    """Steps ``s.state.step`` .. ``run.steps``; ``save(step)`` writes a checkpoint."""
    cfg, state = s.cfg, s.state
    order = graph.topological_order()
    bar = tqdm(range(state.step, cfg.run.steps), initial=state.step, total=cfg.run.steps, desc="rl",
               unit="step", disable=not s.is_driver)
    for step in bar:
        _inject_fault(step)
        try:
            metrics = run_step(s, order, step)
        except NonFiniteStep as error:
            if cfg.run.on_nan == "stop":
                raise
            logger.warning("%s; run.on_nan=skip: going on without this step", error)
            metrics = {"actor/skipped_step": 1.0}
        done = step + 1
        if cfg.run.heldout_every and done % cfg.run.heldout_every == 0 and done < cfg.run.steps:
            reward = heldout_reward(s)
            metrics["heldout/reward"] = reward
            state.heldout.append((done, reward))
        state.step = done
        state.history.append({"step": done, **metrics})
        s.tracker.log_metrics(metrics, step=done)
        bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
        if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == cfg.run.steps:
            save(done)
    dist.barrier()
