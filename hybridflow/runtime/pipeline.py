"""Asynchronous RL on separate placement, the actor ranks' side: batches started ahead on the
engine ranks, collected steps later (``async_rl.mode`` one_step_off | async).

```
actor ranks (every one calls it; rank 0's announcements)       engine ranks (engine_ranks.serve)
step k   rollout(k): [start k, at the start step]  ─────────►   generate batch k, keep it
                     collect k  ◄──── samples, to their DP ranks ─  deliver batch k
                     start k+1 .. k+L not yet started ──────►     generate them, one after another,
                                                                  with the weights they hold now
                     [advance k: partial rollouts] ─────────►     with version k: batch k+1 to its
                                                                  end, the later batches started
                                                                  by older versions a segment on
         old log-probs, advantages, update (version k -> k+1)
         sync_weights: push version k+1 ─────────────────────►    (after the batches before it)
         end_step: ("intervals",) ◄── when the engines generated ─  overlap of generation and training
```

Every batch's samples carry the version they were started under (``pending``); the trainer
admits the step's samples by ``staleness.admit`` and logs the ``async/...`` metrics. The engine
log-probs are the behaviour policy: ``algorithm.rollout_correction`` reweights the samples
against the trainer's old (proximal) log-probs. At a checkpoint the pending batches are saved
beside it with their versions (``async_rl.resume=checkpoint``) or left to be regenerated (drop).

Partial rollouts (``async_rl.partial_rollout``, K >= 2): a batch started ahead generates at most
``segment_tokens`` per request. At each later step, while the actor trains, its unfinished
requests continue a segment further with that step's weights, the ones the last push brought
(``replicas.advance``); at the step before its collection they run to their end. So generation
still overlaps training, and the later tokens come from newer weights than the batch started
with. Each token keeps the version that sampled it (``RolloutSample.segments``, the trainer's
``token_versions``); a sample's staleness is its oldest token's, the batch's start version, so
still within K.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridflow.runtime import replicas, staleness

if TYPE_CHECKING:
    from hybridflow.runtime.session import RunContext, RunData

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline:
    """The actor side of the async buffer, alike on every actor rank."""

    def __init__(self, run: RunContext, data: RunData, resume_from: Path | None) -> None:
        self.run, self.data, self.cfg = run, data, run.cfg.async_rl
        self.channel = run.channel
        self.lag = self.cfg.lag
        self.pending: dict[int, int] = {}
        """batch -> the policy version it was started under (generated or generating)."""
        self.window: list[float] = []
        """This step's [start, training start, training end] (``time.time()``)."""
        self.versions = torch.zeros(0, dtype=torch.long)
        saved = {int(b): int(v) for b, v in run.state.async_buffer}
        if saved and resume_from is not None and self.cfg.resume == "checkpoint":
            self.channel.announce(("load_buffer", str(resume_from)))
            self.channel.barrier()
            self.pending = saved
        elif saved:
            logger.info(
                "async_rl.resume=drop: regenerating the %d pending batch(es) with the resumed weights", len(saved)
            )

    def _start(self, batch: int, version: int) -> None:
        from hybridflow.runtime.ops import engine_prompts, sampling, step_seed

        cfg = self.run.cfg
        ids = engine_prompts(self.data.prompt_batch(batch))
        partial = self.cfg.partial_rollout
        # a batch trained before the next push is generated whole
        segment = self.cfg.segment_tokens if partial and batch > version else None
        # the seed sync mode uses for this step: a batch's samples depend on its version only
        self.channel.announce(
            (
                "start",
                batch,
                ids,
                sampling(cfg, self.data.stop_ids),
                step_seed(cfg.run.seed, batch),
                segment,
                version if partial else None,
            )
        )
        self.pending[batch] = version

    def rollout(self, step: int) -> tuple[replicas.ReplicaOutput, int]:
        """Batch ``step``'s samples (this DP rank's) and the version that generated them; the
        batches up to ``step + lag`` are started before it returns."""
        self.window = [time.time()]
        cfg = self.run.cfg
        before, after = staleness.starts(step, lag=self.lag, steps=cfg.run.steps, pending=self.pending)
        for batch in before:
            self._start(batch, step)
        num_prompts = cfg.run.prompts_per_step
        self.channel.announce(("collect", step, num_prompts))
        out = replicas.collect(
            cfg, None, num_prompts=num_prompts, channel=self.channel, shard=self.run.shard, device=self.run.device
        )
        version = self.pending.pop(step)
        for batch in after:
            self._start(batch, step)
        if self.cfg.partial_rollout and self.pending:
            self.channel.announce(("advance", step, self.cfg.segment_tokens))
        self.window.append(time.time())
        return out, version

    def admit(self, step: int, version: int, total: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(keep [N], weight [N], metrics) of batch ``step``'s N samples for the trainer at ``step``."""
        self.versions = torch.full((total,), version, dtype=torch.long)
        keep, weight = staleness.admit(
            self.versions, step, self.lag, on_stale=self.cfg.on_stale, stale_weight=self.cfg.stale_weight
        )
        metrics = staleness.staleness_metrics(self.versions, step, self.lag)
        metrics.update(
            {
                "async/buffer_batches": float(len(self.pending)),
                "async/policy_version": float(step),
                "async/dropped_samples": float((~keep).sum()),
                "async/downweighted_samples": float((weight < 1).sum()),
            }
        )
        return keep, weight, metrics

    def training_done(self) -> None:
        """The update is over (the push comes next)."""
        if len(self.window) == 2:
            self.window.append(time.time())

    def end_step(self, trained_tokens: float) -> dict[str, float]:
        """The step's overlap of generation with training, and each side's tokens/s."""
        self.training_done()
        self.channel.announce(("intervals",))
        busy = [i for part in self.channel.gather([]) for i in part]
        start, train_start, train_end = self.window
        wall = max(time.time() - start, 1e-9)
        trained = max(train_end - train_start, 1e-9)
        overlap = staleness.overlap_seconds(busy, (train_start, train_end))
        return {
            "async/overlap_fraction": overlap / wall,
            "async/overlap_seconds": overlap,
            "async/training_tokens_per_s": trained_tokens / trained,
        }

    def save(self, directory: Path) -> list[list[int]]:
        """Save the pending batches beside a checkpoint (``async_rl.resume=checkpoint``; every actor
        rank calls it); returns what the run state records: [batch, version] pairs."""
        if self.cfg.resume != "checkpoint" or not self.pending:
            return []
        self.channel.announce(("save_buffer", str(directory)))
        self.channel.barrier()
        return [[b, v] for b, v in sorted(self.pending.items())]
