"""``run.mode=rm``: a reward model trained on preference pairs and exported for ``reward_model.path``.

```
pairs: data.train_files (chosen / rejected columns) or the task's ──► ids: the prompt as RL prompts
       are encoded, the response and the end-of-turn token after it (an RL sample's tokens)
MegatronRewardModel: the actor's architecture under a score head, on the actor's layout; its body
       from the SFT warm-up (sft.steps > 0), model.path, or the seeded initialisation
rm.steps x Bradley-Terry (batches a function of (seed, step)) ──► held-out pair accuracy before / after
       every rm.checkpoint_every steps, at a checkpoint request and at the last:
<run>/checkpoints/rm_<step>   (the model and its optimizer state; a start goes on from the newest)
<run>/reward_model/megatron   (dist checkpoint, loads under any layout; hf_files/ beside it)
<run>/reward_model/hf         (transformers *ForSequenceClassification, num_labels=1)
```

Both exports are written under a temporary name and renamed once complete. The batches are a
function of the step, so a run stopped and started again trains as the uninterrupted one would.
A start from the last step's checkpoint trains nothing and writes the exports again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from hfschema.files import publish_directory, write_atomic
from hfschema.hf_config import SCORE_SUFFIX, SIDE_FILE_DIR, side_files
from hfschema.model import as_score_model
from hfschema.trainer import LAST_KEY, bradley_terry_loss
from hybridflow.data import BadRow, BadRows, PromptSampler
from hybridflow.preferences import PreferencePair, encode_pair, make_task_pairs, read_pairs
from hybridflow.runtime import report, stops
from hybridflow.runtime.session import DRIVER, Session, broadcast
from hybridflow.runtime.trainers import trainer_of

__all__ = ["EXPORT_DIR", "export_config", "train_reward_model"]

logger = logging.getLogger(__name__)

EXPORT_DIR = "reward_model"
"""The run directory's folder holding the trained reward model (``megatron/`` and ``hf/``)."""


def _pair_files(s: Session) -> tuple[list[str], list[str]]:
    """Training and held-out preference files: the user's, or the task's written by rank 0."""
    cfg = s.cfg
    paths = None
    if dist.get_rank() == DRIVER:
        train, heldout = list(cfg.data.train_files), list(cfg.data.heldout_files)
        if not train:
            t, h = make_task_pairs(cfg.task, cfg.data, s.run.out_dir / "data", seed=cfg.run.seed)
            train, heldout = [str(t)], heldout or [str(h)]
        paths = (train, heldout)
    return broadcast(paths)


def _encode(pairs: list[PreferencePair], s: Session, end_id: int, label: str) -> list[tuple[list, list]]:
    """Each pair's token ids; a pair too long is a bad row (``data.on_bad_row``)."""
    tokenizer, data = s.data.tokenizer, s.cfg.data
    use_chat = data.apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    bad = BadRows(label, data, "shorten the row or raise data.max_response_length")
    out = []
    for pair in pairs:
        try:
            out.append(encode_pair(pair, tokenizer, data, end_id, use_chat))
        except BadRow as reason:
            bad.add(pair.uid, str(reason))
    bad.summarise()
    return out


def _batch(pairs: list[tuple[list, list]], pad: int) -> dict[str, torch.Tensor]:
    """Rows chosen, rejected, chosen, ... right-padded, with the one-hot of each row's last token."""
    rows = [ids for pair in pairs for ids in pair]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    last = torch.zeros(len(rows), length)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        last[i, len(r) - 1] = 1.0
    return {"input_ids": ids, LAST_KEY: last}


def _accuracy(rm, pairs: list[tuple[list, list]], pad: int, multiple: int) -> float | None:
    """Fraction of ``pairs`` whose chosen response scores above the rejected one."""
    if not pairs:
        return None
    batch = _batch(pairs, pad)
    ids, lengths = batch["input_ids"], batch[LAST_KEY].argmax(dim=1) + 1
    rows, extra = len(ids), -len(ids) % multiple  # whole micro-batches on every DP rank
    ids, lengths = torch.cat([ids, ids[:1].expand(extra, -1)]), torch.cat([lengths, lengths[:1].expand(extra)])
    scores = rm.forward_scores({"input_ids": ids, "lengths": lengths}, None)[:rows]
    return float((scores[0::2] > scores[1::2]).float().mean())


def export_config(files: Path, out: Path, pad_id: int | None) -> None:
    """``files``'s config.json as a one-label ``*ForSequenceClassification`` (and its tokenizer
    and chat template) into ``out``: what transformers and ``reward_model.path`` read."""
    out.mkdir(parents=True, exist_ok=True)
    for f in side_files(files):
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((files / "config.json").read_text())
    classes = config.get("architectures") or []
    base = classes[0].removesuffix("ForCausalLM") if classes else config["model_type"].title().replace("_", "")
    config.update(architectures=[base + SCORE_SUFFIX], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if config.get("pad_token_id") is None and pad_id is not None:  # transformers pools past padding by it
        config["pad_token_id"] = pad_id
    write_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")


def _build(s: Session, sft_export: Path | None, resume_from: Path | None):
    """The reward model: from its checkpoint ``resume_from`` (with the optimizer state) when the
    run state says steps were done, else its body from the SFT export, model.path, or the seeded
    init."""
    from hfschema.model_source import model_source

    cfg, trainer = s.cfg, trainer_of(s.cfg)
    micro = 2 * max(1, cfg.train.micro_batch_size // 2)  # both rows of a pair in one micro-batch
    train = dataclasses.replace(
        cfg.train,
        lr=cfg.rm.lr,
        min_lr=0.0,
        lr_schedule="constant",
        lr_warmup_steps=0,
        micro_batch_size=micro,
        global_batch_size=2 * cfg.rm.batch_size,
    )
    rows_per_rank = 2 * cfg.rm.batch_size // cfg.actor.parallel.dp
    if (2 * cfg.rm.batch_size) % cfg.actor.parallel.dp or rows_per_rank % micro:
        raise ValueError(
            f"rm.batch_size={cfg.rm.batch_size} pairs ({2 * cfg.rm.batch_size} rows) do not split into "
            f"actor.parallel.dp={cfg.actor.parallel.dp} ranks of micro-batches of {micro} rows (pairs whole); "
            f"set rm.batch_size to a multiple of {cfg.actor.parallel.dp * micro // 2}"
        )
    body = sft_export or (Path(cfg.model.path) if cfg.model.pretrained else None)
    rm = trainer.build_reward_model(as_score_model(cfg.model), cfg, train, s.models.pg)
    if s.run.state.rm_step:  # resume_from is the reward model's newest checkpoint
        trainer.load(rm, resume_from / "actor", with_optimizer=True)
    elif body is not None:
        source = model_source(body)
        if source.kind != "hf":
            raise ValueError(
                f"model.path={body}: run.mode=rm starts a reward model from a Hugging Face directory; "
                "convert it first with `hybridflow convert mcore-to-hf`"
            )
        trainer.load_score_body(rm, source)
    return rm, micro


def train_reward_model(s: Session, sft_export: Path | None, resume_from: Path | None, save: Callable) -> dict:
    """Train, measure and export the reward model; returns the run's summary (every rank), or {}
    when a checkpoint request stopped it (saved first). ``save(name, model)`` writes
    ``checkpoints/<name>`` with the model's optimizer state and the run state."""
    cfg = s.cfg
    started = time.time()
    train, heldout = _read_pairs(s)
    rm, micro = _build(s, sft_export, resume_from)
    pad = s.data.tokenizer.pad_token_id
    multiple = cfg.actor.parallel.dp * micro
    state, start = s.run.state, s.run.state.rm_step
    if start == 0:
        state.rm_heldout_before = _accuracy(rm, heldout, pad, multiple)
    if not _train_steps(s, rm, train, pad, save):
        return {}
    after = _accuracy(rm, heldout, pad, multiple)
    export = _export(s, rm, pad)
    summary = {
        "run": cfg.run.name,
        "mode": "rm",
        "rm_steps": cfg.rm.steps,
        "rm_started_at_step": start,
        "train_pairs": len(train),
        "heldout_pairs": len(heldout),
        "rm_loss_first": state.rm_losses[0],
        "rm_loss_last": state.rm_losses[-1],
        "heldout_pair_accuracy_before": state.rm_heldout_before,
        "heldout_pair_accuracy_after": after,
        "reward_model_hf": str(export / "hf"),
        "reward_model_megatron": str(export / "megatron"),
        "wall_seconds": s.run.wall_before + time.time() - started,
        "mlflow_run_id": s.run.tracker.run_id,
    }
    if s.run.is_driver:
        report.write_summary(s.run.out_dir, summary)
        s.run.tracker.log_metrics({"rm/heldout_pair_accuracy": after or 0.0}, step=cfg.rm.steps)
        sys.stdout.write(_format(summary) + "\n")
    return summary


def _read_pairs(s: Session) -> tuple[list, list]:
    """The encoded training and held-out pairs; ValueError when no training pair fits."""
    cfg = s.cfg
    train_files, heldout_files = _pair_files(s)
    end_id = _end_id(s)
    keys = {"chosen_key": cfg.rm.chosen_key, "rejected_key": cfg.rm.rejected_key}
    train = _encode(read_pairs(train_files, cfg.data, **keys), s, end_id, "rm train")
    heldout = []
    if heldout_files and cfg.rm.heldout_pairs:
        rows = read_pairs(heldout_files, cfg.data, **keys)
        heldout = _encode(rows[: cfg.rm.heldout_pairs], s, end_id, "rm held-out")
    if not train:
        raise ValueError(
            f"{', '.join(train_files)}: no preference pair fits data.max_prompt_length + max_response_length"
        )
    return train, heldout


def _train_steps(s: Session, rm, train: list, pad: int | None, save: Callable) -> bool:
    """The steps from ``rm_step`` on, checkpointed as ``rm.checkpoint_every`` and the last step
    say; False when a checkpoint request stopped them (saved first)."""
    cfg, state = s.cfg, s.run.state
    sampler = PromptSampler(len(train), cfg.rm.batch_size, cfg.run.seed + 29)
    start, steps = state.rm_step, cfg.rm.steps
    bar = tqdm(range(start, steps), desc="rm", unit="step", initial=start, total=steps, disable=not s.run.is_driver)
    for step in bar:
        result = rm.train_step(_batch([train[i] for i in sampler.batch(step)], pad), bradley_terry_loss)
        if not result.applied:
            raise FloatingPointError(
                f"rm step {step}: the loss or a gradient is not finite; stopped before applying it"
            )
        state.rm_losses.append(result.loss)
        done = state.rm_step = step + 1
        accuracy = result.metrics.get("accuracy") or 0.0
        s.run.tracker.log_metrics({"rm/loss": result.loss, "rm/accuracy": accuracy}, step=step)
        bar.set_postfix(loss=f"{result.loss:.3f}", acc=f"{accuracy:.2f}")
        scheduled, requested = stops.checkpoint_due(
            s.run.out_dir,
            done=done,
            total=steps,
            every=cfg.rm.checkpoint_every,
            is_driver=s.run.is_driver,
            group=s.run.shard.group,
        )
        if scheduled or requested:
            save(f"rm_{done:06d}", rm)
        if requested:
            if s.run.is_driver:
                stops.done_request(s.run.out_dir)
                logger.warning("checkpointed reward-model step %d as %s asked; stopping", done, stops.REQUEST_FILE)
            return False
    return True


def _end_id(s: Session) -> int:
    """The token after a response: the chat's end of turn, else the end of text (SFT's rule)."""
    tokenizer = s.data.tokenizer
    if tokenizer.chat_template:
        return tokenizer.convert_tokens_to_ids("<|im_end|>")
    return s.data.stop_ids[-1] if s.data.stop_ids else tokenizer.eos_token_id


def _export(s: Session, rm, pad: int | None) -> Path:
    """``<run>/reward_model``: the trainer's checkpoint (config and tokenizer in hf_files/) and its
    transformers directory, written under a temporary name and renamed when complete."""
    trainer = trainer_of(s.cfg)
    final = s.run.out_dir / EXPORT_DIR
    staging = final.with_name(final.name + ".tmp")
    if s.run.is_driver:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    trainer.save(rm, staging / "megatron", with_optimizer=False, step=0)
    if s.run.is_driver:
        files = staging / "megatron" / SIDE_FILE_DIR
        export_config(s.engines.model_dir, files, pad)
        trainer.export_hf(staging / "megatron", staging / "hf", hf_config=files)
        publish_directory(staging, final)
        logger.info("exported the reward model to %s", final / "hf")
    dist.barrier()
    return final


def _format(summary: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{x:.3f}"

    return "\n".join(
        [
            f"reward model trained: {summary['rm_steps']} steps on {summary['train_pairs']} pairs, "
            f"loss {summary['rm_loss_first']:.3f} -> {summary['rm_loss_last']:.3f}",
            f"held-out pair accuracy ({summary['heldout_pairs']} pairs): {pct(summary['heldout_pair_accuracy_before'])}"
            f" -> {pct(summary['heldout_pair_accuracy_after'])}",
            f"reward_model.path={summary['reward_model_hf']}",
        ]
    )
