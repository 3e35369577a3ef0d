"""What every trainer backend promises the runtime: a step's result, the loss function's shape, and
the optimizer's semantics (megatron-core's, so that a run means the same on either backend).

Legend: B rows, T tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .train import TrainConfig

if TYPE_CHECKING:  # the schema itself imports no torch
    import torch

__all__ = [
    "BACKEND_CALLS",
    "LAST_KEY",
    "SCORE_CHUNK_TOKENS",
    "Batch",
    "LossFn",
    "StepResult",
    "bradley_terry_loss",
    "copy_matching",
    "decays",
    "lr_at",
]

BACKEND_CALLS = (
    "adapter_push",
    "build_critic",
    "build_frozen",
    "build_policy",
    "build_reward_model",
    "copy_weights",
    "data_coords",
    "device",
    "export_hf",
    "init_default_group",
    "initialize",
    "layout_groups",
    "load",
    "load_pretrained",
    "load_reward_model",
    "load_score_body",
    "named_parameters",
    "save",
    "teardown",
)
"""What a trainer backend's module defines: the calls ``hybridflow.runtime.trainers.TrainerBackend``
names (each backend's ``__all__``; ``tests/test_boundaries.py`` holds the three alike)."""

SCORE_CHUNK_TOKENS = 4096
"""Tokens whose logits a backend that scores in chunks (FSDP2) holds at once: 4096 x 150K fp32
logits are 2.5 GB, a fraction of a training GPU's memory (the memory estimate counts them)."""

Batch = Mapping[str, "torch.Tensor"]
"""``input_ids`` [B, T] and the runtime's fields [B, ...]; rows right-padded."""

LossFn = Callable[[Any, Any, Batch], tuple[Any, Any, dict[str, Any]]]
"""loss_fn(logprobs [b, T], entropy [b, T], micro-batch) -> (summed loss, token count, metrics). The
step divides the summed loss by the token count of the whole global batch. Metrics are averaged
weighted by the token count, or by ``metrics["weight"]`` when the loss gives one (a loss summed
without a divisor reports a count of 0)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float
    """Loss per counted token over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step."""
    num_tokens: int
    """Tokens counted by the loss over the global batch."""
    metrics: dict[str, float]
    """Token-weighted means of the loss function's metrics."""
    applied: bool = True
    """False when the loss or a gradient was not finite: the optimizer did not step."""


def lr_at(train: TrainConfig, step: int, *, peak: float | None = None) -> float:
    """The learning rate of optimizer step ``step`` (0-based), as megatron-core's
    ``OptimizerParamScheduler`` sets it for the megatron backend: linear warmup from 0 (the first
    warmup step's rate is 0), then constant, or linear / cosine decay to ``min_lr`` over
    ``lr_decay_steps``. ``peak``: another peak (the critic's ``critic_lr``)."""
    top = train.lr if peak is None else peak
    warmup = train.lr_warmup_steps
    if warmup and step <= warmup:
        return top * step / warmup
    if train.lr_schedule == "constant":
        return top
    decay_steps = max(train.lr_decay_steps, warmup + 1)
    if step > decay_steps:
        return train.min_lr
    ratio = (step - warmup) / (decay_steps - warmup)
    coeff = 1.0 - ratio if train.lr_schedule == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return train.min_lr + coeff * (top - train.min_lr)


def decays(name: str, shape: tuple[int, ...]) -> bool:
    """Whether weight decay applies to a parameter: not to biases nor to one-dimensional ones
    (norms), as megatron-core's optimizer leaves them."""
    return not name.endswith(".bias") and len(shape) > 1


LAST_KEY = "last_token_mask"
"""Batch key of a ``[B, T]`` one-hot marking each row's pooled token (a reward model's training
batches: rows chosen, rejected, chosen, ...)."""


def bradley_terry_loss(values_BT, _unused, micro: Batch) -> tuple:
    """A reward model's ``LossFn``: -log sigmoid(r_chosen - r_rejected) summed over the
    micro-batch's pairs (rows 2i, 2i+1), averaged over pairs by the step; metrics: pair accuracy
    and the mean margin."""
    import torch
    import torch.nn.functional as F

    scores = (values_BT * micro[LAST_KEY]).sum(dim=1)
    margin = scores[0::2] - scores[1::2]
    pairs = torch.tensor(margin.numel(), device=margin.device)
    metrics = {"accuracy": (margin > 0).float().mean(), "margin": margin.mean(), "weight": pairs}
    return -F.logsigmoid(margin).sum(), pairs, metrics


def copy_matching(target: Mapping[str, Any], source: Mapping[str, Any]) -> list[str]:
    """Copy each tensor of ``source`` into ``target``'s tensor of the same name and shape (a
    backend's parameters, this rank's parts of them, in place); returns the names of ``target``'s
    tensors left as they were."""
    import torch

    skipped = []
    with torch.no_grad():
        for name, param in target.items():
            if name in source and source[name].shape == param.shape:
                param.copy_(source[name])
            else:
                skipped.append(name)
    return skipped
