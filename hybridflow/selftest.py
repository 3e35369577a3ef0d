"""``hybridflow selftest``: the smallest real job, run on every rank under torchrun.

It builds the config's actor with megatron-core under the actor's layout, trains it for a few
steps on a synthetic next-token task (sequences that count upwards modulo the vocabulary, so
the loss can fall fast), saves a distributed checkpoint with optimizer state, loads it into a
fresh policy and checks the log-probs match, then writes ``selftest.json`` and prints a
summary. It exits non-zero when the loss did not fall or the reload differs.

    torchrun --standalone --nproc-per-node N -m hybridflow.selftest CONFIG [k=v ...]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from hfschema.files import write_atomic
from hybridflow.config import HybridflowConfig, load_config
from hybridflow.lowering import trainer_text
from hybridflow.runtime.trainers import trainer_of

logger = logging.getLogger("hybridflow.selftest")


def counting_batch(rows: int, length: int, vocab: int, step: int) -> dict[str, torch.Tensor]:
    """Rows of consecutive token ids (mod vocab) from seeded random starts."""
    starts = torch.randint(0, vocab, (rows, 1), generator=torch.Generator().manual_seed(step))
    ids = (starts + torch.arange(length)) % vocab
    mask = torch.ones(rows, length)
    mask[:, 0] = 0
    return {"input_ids": ids, "loss_mask": mask}


def next_token_loss(logp, entropy, micro):
    mask = micro["loss_mask"]
    tokens = mask.sum()
    return -(logp * mask).sum(), tokens, {"entropy": (entropy * mask).sum() / tokens.clamp(min=1)}


def _policy(cfg: HybridflowConfig):
    """The actor's trainer under its layout, randomly initialised (model.path's weights are not read)."""
    trainer = trainer_of(cfg)
    pg = trainer.initialize(cfg.actor.parallel, seed=cfg.run.seed, prefix="actor.parallel")
    random = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="random"))
    return trainer.build_policy(random, cfg.train, pg, model_dir=_model_dir(cfg))


def _model_dir(cfg: HybridflowConfig) -> Path:
    """The model's directory (its config and tokenizer; no weights), written by rank 0 into the
    output directory as a run writes it."""
    from hybridflow.runtime.model_dir import run_model_dir

    path = Path(cfg.run.output_dir) / "model"
    if dist.get_rank() == 0:
        run_model_dir(cfg.model, path, seed=cfg.run.seed)
    dist.barrier()
    return path


def _train(cfg: HybridflowConfig, policy, steps: int, length: int) -> list[float]:
    losses = []
    bar = tqdm(range(steps), desc="selftest", disable=dist.get_rank() != 0, unit="step")
    for step in bar:
        batch = counting_batch(cfg.train.global_batch_size, length, cfg.model.vocab_size, step)
        result = policy.train_step(batch, next_token_loss)
        losses.append(result.loss)
        bar.set_postfix(loss=f"{result.loss:.3f}", grad_norm=f"{result.grad_norm:.2f}")
    return losses


def run(cfg: HybridflowConfig, *, steps: int, length: int = 32) -> dict:
    """Train, save, reload and compare; returns the summary (same on every rank)."""
    start = time.time()
    policy = _policy(cfg)
    train_start = time.time()
    losses = _train(cfg, policy, steps, length)
    train_seconds = time.time() - train_start
    probe = counting_batch(cfg.train.global_batch_size, length, cfg.model.vocab_size, 10_000)
    logp, _ = policy.forward_logprobs(probe)
    ckpt = Path(cfg.run.output_dir) / "checkpoints" / f"step_{steps}"
    trainer_of(cfg).save(policy, ckpt, with_optimizer=True, step=steps)
    reloaded = _policy(cfg)
    trainer_of(cfg).load(reloaded, ckpt, with_optimizer=True)
    reload_diff = (reloaded.forward_logprobs(probe)[0] - logp).abs().max().item()
    wall = time.time() - start
    tokens = steps * cfg.train.global_batch_size * (length - 1)
    return {
        "layout": trainer_text(cfg, cfg.actor.parallel),
        "steps": steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_fell": losses[-1] < losses[0],
        "reload_max_logprob_diff": reload_diff,
        "reload_ok": reload_diff < 1e-5,
        "checkpoint": str(ckpt),
        "train_tokens_per_s": tokens / train_seconds,
        "wall_seconds": wall,
    }


def _report(summary: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_atomic(out_dir / "selftest.json", json.dumps(summary, indent=2))
    lines = [
        "hybridflow selftest",
        f"  layout        {summary['layout']}",
        f"  loss          {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {summary['steps']} steps",
        f"  reload        max |dlogp| = {summary['reload_max_logprob_diff']:.2e}",
        f"  checkpoint    {summary['checkpoint']}",
        f"  throughput    {summary['train_tokens_per_s']:.0f} tokens/s, {summary['wall_seconds']:.1f} s",
        f"  summary       {path}",
        f"  result        {'OK' if summary['loss_fell'] and summary['reload_ok'] else 'FAILED'}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    steps = int(os.environ.get("HYBRIDFLOW_SELFTEST_STEPS", "8"))
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(argv[0], argv[1:])
    trainer_of(cfg).init_default_group()
    summary = run(cfg, steps=steps)
    if dist.get_rank() == 0:
        _report(summary, Path(cfg.run.output_dir))
    trainer_of(cfg).teardown()
    dist.destroy_process_group()
    return 0 if summary["loss_fell"] and summary["reload_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
