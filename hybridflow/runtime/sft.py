"""Supervised fine-tuning of the actor: the RL warm-up, or a whole run with ``run.mode=sft``.

Each example is the prompt (chat template, ending in the assistant's turn) followed by the
target response and the end-of-turn token; the loss is the mean negative log-likelihood of the
response tokens and the end-of-turn token (the prompt is context only), so the model learns to
answer and to stop. A multi-turn target (assistant turns with tool or user messages between
them) is laid out as a multi-turn rollout is (``hybridflow.agentic.trajectory``): each assistant
turn's tokens and end token trained, the messages between them in the chat template's form and
not trained. Batches are drawn like RL prompts: a pure function of (seed, step).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from tqdm import tqdm

from hybridflow.data import PromptSampler, TokenizedPrompt
from hybridflow.runtime.batch import pad_rows

__all__ = ["run_sft", "sft_batch", "sft_train_config"]

logger = logging.getLogger(__name__)


def sft_train_config(cfg):
    """The actor's optimizer settings with SFT's learning rate (constant) and batch size."""
    return dataclasses.replace(
        cfg.train,
        lr=cfg.sft.lr,
        min_lr=0.0,
        lr_schedule="constant",
        lr_warmup_steps=0,
        global_batch_size=cfg.sft.batch_size,
    )


def _target(response, tokenizer, end_id: int) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of an SFT target after the prompt: one answer, or a multi-turn one."""
    if isinstance(response, str):
        answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [end_id]
        return answer, [1] * len(answer)
    from hybridflow.agentic.trajectory import ObservationRenderer

    renderer, ids, mask, between = ObservationRenderer(tokenizer, end_id), [], [], []
    for message in response:
        if message["role"] != "assistant":
            between.append(message)
            continue
        if between:
            observed = renderer.render(between)
            ids, mask, between = ids + observed, mask + [0] * len(observed), []
        turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [end_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
    return ids, mask


def sft_batch(rows: list[TokenizedPrompt], tokenizer, end_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``loss_mask`` [B, T] (right padding) of prompt + response + end token."""
    seqs, masks = [], []
    for row in rows:
        answer, trained = _target(row.row.sft_response, tokenizer, end_id)
        seqs.append(list(row.prompt_ids) + answer)
        masks.append([0] * len(row.prompt_ids) + trained)
    length = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), length)
    for i, (seq, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids, "loss_mask": mask}


def _nll(logp, entropy, micro):
    mask = micro["loss_mask"]
    tokens = mask.sum()
    return -(logp * mask).sum(), tokens, {"entropy": (entropy * mask).sum() / tokens.clamp(min=1)}


def run_sft(
    policy,
    rows: list[TokenizedPrompt],
    tokenizer,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    end_id: int,
    row_multiple: int,
    start: int = 0,
    on_step=None,
) -> list[float]:
    """Train ``policy`` for SFT steps ``start`` .. ``steps - 1``; returns the loss of each.
    ``on_step(step, result)`` follows each step; a true return stops SFT there (a checkpoint
    request). Step k's batch is a function of (seed, k), so a resumed SFT draws what an
    uninterrupted one would."""
    usable = [r for r in rows if r.row.sft_response]
    if not usable:
        raise ValueError("SFT needs targets: no training row has the column named by sft.response_key")
    sampler = PromptSampler(len(usable), batch_size, seed + 17)
    losses = []
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="sft", unit="step", disable=dist.get_rank() != 0)
    for step in bar:
        batch, _ = pad_rows(sft_batch([usable[i] for i in sampler.batch(step)], tokenizer, end_id), row_multiple)
        result = policy.train_step(batch, _nll)
        if not result.applied:
            raise FloatingPointError(
                f"SFT step {step}: the loss or a gradient is not finite; stopped "
                "before applying it (no checkpoint written)"
            )
        losses.append(result.loss)
        bar.set_postfix(loss=f"{result.loss:.3f}")
        if on_step is not None and on_step(step, result):
            break
    return losses
