"""Rollout correction: importance weights between the engine that sampled and the trainer.

The engine (SGLang, bf16 kernels, its own batching) samples from a policy that differs slightly
from the trainer's recomputation of the same weights; under asynchronous RL it may be a step or
more behind. PPO's ratio is taken against the trainer's ``old_log_prob``, so the samples are off
its distribution by ``w = pi_old / pi_rollout``. Rollout correction reweights or drops them:

    log_w = old_log_prob - rollout_log_prob                  per token (clamped to +-20)
    level   token      w_t = exp(log_w_t)
            sequence   w   = exp(sum_t log_w_t)              one weight for the whole sample
            geometric  w   = exp(mean_t log_w_t)             the length-normalised sequence ratio
    mode    tis        weight = min(w, upper)                truncated importance sampling
            mis        weight = w where lower <= w <= upper, else the token / sample is dropped
            mask       weight = 1, dropped outside [lower, upper] (rejection only)

The weights are constants (no gradient flows through them): they scale each token's policy
loss, and dropped tokens leave the loss and its normaliser. ``lower`` None means no lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybridflow.algorithms.losses import as_bool_mask, masked_mean, zero_padding
from hybridflow.config import CORRECTION_LEVELS, CORRECTION_MODES

__all__ = ["CORRECTION_LEVELS", "CORRECTION_MODES", "Correction", "rollout_correction"]

_MAX_LOG_W = 20.0


@dataclass(frozen=True)
class Correction:
    """What ``rollout_correction`` gives the policy loss."""

    weights: torch.Tensor
    """[B, T] per-token factor on the policy loss (0 in the padding and on dropped tokens)."""
    keep: torch.Tensor
    """[B, T] float mask: the response tokens that stay in the loss."""
    metrics: dict[str, torch.Tensor]
    """``rollout_corr/...``: weight mean / max, dropped fraction, mean log-ratio, k3 KL."""


def _log_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    token = torch.clamp(zero_padding(old_log_prob.detach() - rollout_log_prob.detach(), mask), -_MAX_LOG_W, _MAX_LOG_W)
    if level == "token":
        return token
    m = as_bool_mask(mask).to(token.dtype)
    total = (token * m).sum(-1, keepdim=True)
    if level == "geometric":
        total = total / m.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.clamp(total, -_MAX_LOG_W, _MAX_LOG_W).expand_as(token)


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    level: str = "token",
    upper: float = 2.0,
    lower: Optional[float] = None,
) -> Correction:
    """The weights and kept tokens of one correction (module docstring)."""
    if mode not in CORRECTION_MODES or level not in CORRECTION_LEVELS:
        raise ValueError(
            f"rollout correction mode {mode!r} / level {level!r}: choose a mode of "
            f"{CORRECTION_MODES} and a level of {CORRECTION_LEVELS}"
        )
    m = as_bool_mask(response_mask)
    log_w = _log_weights(old_log_prob, rollout_log_prob, response_mask, level)
    w = torch.exp(log_w)
    inside = (w <= upper) & (w >= (lower if lower is not None else 0.0))
    if mode == "tis":
        keep, weights = m, torch.clamp(w, max=upper)
    else:
        keep = m & inside
        weights = w if mode == "mis" else torch.ones_like(w)
    keep_f = keep.to(w.dtype)
    token_log_w = _log_weights(old_log_prob, rollout_log_prob, response_mask, "token")
    metrics = {
        "rollout_corr/weight_mean": masked_mean(weights * keep_f, m),
        "rollout_corr/weight_max": (w * m).max() if m.any() else torch.zeros(()),
        "rollout_corr/dropped_fraction": masked_mean((~keep & m).to(w.dtype), m),
        "rollout_corr/log_ratio_mean": masked_mean(token_log_w, m),
        # k3 estimate of KL(rollout || old) per token: exp(d) - 1 - d with d = old - rollout
        "rollout_corr/kl_k3": masked_mean(torch.expm1(token_log_w) - token_log_w, m),
    }
    return Correction(weights=zero_padding(weights, keep_f), keep=keep_f, metrics=metrics)
