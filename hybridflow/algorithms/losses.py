"""Policy, value, KL, entropy and LM losses as plain tensor functions, and how they are averaged.

Shapes: ``B`` samples, ``T`` response tokens (right-padded); ``response_mask`` [B, T] is 1 (or
True) on real response tokens. Every function here reads only masked positions: whatever
sits in the padding (zeros, garbage, NaN) never changes a result or a gradient.

    log_prob, old_log_prob, advantages --get_policy_loss(name)--> loss_mat [B, T], metrics
    loss_mat, mask --agg_parts(mode)--> (numerator, denominator)   # per micro-batch
    sum(numerators) / sum(denominators) == agg_loss(whole batch)   # exactly, for every mode

The masked helpers (``masked_sum``, ``masked_mean``, ``masked_var``, ``masked_whiten``) live
here (with ``as_bool_mask`` and ``zero_padding``) and are shared with ``estimators`` and ``shaping``.
"""

import logging
from collections.abc import Callable
from typing import Optional, Protocol

import torch

from hybridflow.config import AlgorithmConfig

__all__ = [
    "LOSS_AGG_MODES",
    "BatchSplit",
    "PolicyLoss",
    "agg_loss",
    "as_bool_mask",
    "agg_parts",
    "compute_policy_loss",
    "entropy_loss",
    "get_policy_loss",
    "kl_penalty",
    "kl_penalty_names",
    "lm_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss_names",
    "register_policy_loss",
    "value_loss",
    "zero_padding",
]

logger = logging.getLogger(__name__)

# exp() of a log-ratio beyond this overflows or dominates the batch; PPO clips it anyway
_MAX_LOG_RATIO = 20.0


# ---------------------------------------------------------------- masked helpers


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (masks arrive as float 0/1 or bool)."""
    return mask if mask.dtype == torch.bool else mask != 0


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with padded positions set to 0 (``where``, not ``x * mask``: 0 * NaN is NaN)."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of x over masked positions (over ``dim``, or all of them)."""
    x = zero_padding(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x over masked positions; 0 where nothing is masked in."""
    count = as_bool_mask(mask).sum() if dim is None else as_bool_mask(mask).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all masked positions (Bessel-corrected by default; 0 for one element)."""
    count = as_bool_mask(mask).sum().to(x.dtype)
    centred = zero_padding(x - masked_mean(x, mask), mask)
    divisor = (count - 1 if unbiased else count).clamp(min=1)
    return (centred ** 2).sum() / divisor


class BatchSplit(Protocol):
    """A batch split over data-parallel ranks: ``sum`` adds a statistic over every rank's rows
    (``hybridflow.runtime.shares.Shard``); None where one process holds the whole batch."""

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8,
                  split: Optional[BatchSplit] = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked positions; 0 on the padding. With ``split``,
    mean and (Bessel-corrected) variance are those of the whole batch, in two passes as here."""
    if split is None:
        whitened = (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + eps)
        return zero_padding(whitened, mask)
    wide = torch.float64  # the sums cross ranks; keep them exact enough to match one process
    total, count = split.sum(torch.stack([masked_sum(x, mask).to(wide), as_bool_mask(mask).sum().to(wide)]))
    mean = (total / count.clamp(min=1)).to(x.dtype)
    centred = zero_padding(x - mean, mask)
    var = split.sum((centred.to(wide) ** 2).sum().reshape(1))[0] / (count - 1).clamp(min=1)
    return zero_padding((x - mean) * torch.rsqrt(var.to(x.dtype) + eps), mask)


# ---------------------------------------------------------------- loss aggregation

AggParts = Callable[[torch.Tensor, torch.Tensor, Optional[int]], tuple[torch.Tensor, torch.Tensor]]


def _token_mean_parts(loss_mat, mask, max_response_length):
    return masked_sum(loss_mat, mask), as_bool_mask(mask).sum().to(loss_mat.dtype)


def _sequence_sums(loss_mat, mask):
    """(per-sequence token sums, per-sequence token counts, which sequences have a token)."""
    counts = as_bool_mask(mask).sum(-1).to(loss_mat.dtype)
    return masked_sum(loss_mat, mask, dim=-1), counts, counts > 0


def _seq_mean_token_sum_parts(loss_mat, mask, max_response_length):
    sums, _, nonempty = _sequence_sums(loss_mat, mask)
    return sums.sum(), nonempty.sum().to(loss_mat.dtype)


def _seq_mean_token_mean_parts(loss_mat, mask, max_response_length):
    sums, counts, nonempty = _sequence_sums(loss_mat, mask)
    return (sums / counts.clamp(min=1)).sum(), nonempty.sum().to(loss_mat.dtype)


def _seq_mean_token_sum_norm_parts(loss_mat, mask, max_response_length):
    if max_response_length is None or max_response_length < 1:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' divides by the generation budget: "
                         f"pass max_response_length >= 1 (data.max_response_length), got {max_response_length}")
    sums, _, nonempty = _sequence_sums(loss_mat, mask)
    return sums.sum(), nonempty.sum().to(loss_mat.dtype) * max_response_length


_AGG_MODES: dict[str, AggParts] = {
    "token-mean": _token_mean_parts,
    "seq-mean-token-sum": _seq_mean_token_sum_parts,
    "seq-mean-token-mean": _seq_mean_token_mean_parts,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm_parts,
}
LOSS_AGG_MODES = tuple(_AGG_MODES)


def agg_parts(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *,
              max_response_length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the aggregated loss of one micro-batch.

    Summing both over the micro-batches of a batch and dividing gives exactly ``agg_loss`` of
    the whole batch, because every mode is a ratio of two sums over samples:

    - ``token-mean``: sum of masked token losses / number of masked tokens;
    - ``seq-mean-token-sum``: sum of per-sequence token sums / number of sequences;
    - ``seq-mean-token-mean``: sum of per-sequence token means / number of sequences;
    - ``seq-mean-token-sum-norm``: sum of per-sequence token sums /
      (number of sequences * ``max_response_length``), Dr. GRPO's constant normaliser.

    Sequences with no masked token count in no denominator: they would only dilute the mean.
    """
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of: {', '.join(LOSS_AGG_MODES)}")
    return _AGG_MODES[mode](loss_mat, mask, max_response_length)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *,
             max_response_length: Optional[int] = None) -> torch.Tensor:
    """The scalar loss of ``loss_mat`` averaged under ``mode`` (see ``agg_parts``); 0 if all is padding."""
    numerator, denominator = agg_parts(loss_mat, mask, mode, max_response_length=max_response_length)
    return numerator / denominator.clamp(min=1)


# ---------------------------------------------------------------- policy losses

PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig],
                      tuple[torch.Tensor, dict[str, torch.Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make ``fn(old_log_prob, log_prob, advantages, response_mask, cfg)`` a policy loss.

    The function returns ``(loss_mat [B, T], metrics)``; metrics are detached scalars and hold
    at least ``clipfrac`` and ``ppo_kl``.
    """

    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn

    return add


def policy_loss_names() -> list[str]:
    """Registered policy-loss names."""
    return sorted(_POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ValueError lists the valid names."""
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r} (algorithm.policy_loss); "
                         f"registered: {', '.join(policy_loss_names())}")
    return _POLICY_LOSSES[name]


def _clean_inputs(old_log_prob, log_prob, advantages, mask):
    """Inputs with zeroed padding, old log-probs detached: the rollout policy is a constant."""
    return (zero_padding(old_log_prob.detach(), mask), zero_padding(log_prob, mask),
            zero_padding(advantages.detach(), mask))


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.float(), mask).detach()


def _ppo_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(old_log_prob - log_prob, mask).detach()


def _clipped_surrogate(ratio, advantages, cfg: AlgorithmConfig):
    """max(-A r, -A clip(r, 1 - low, 1 + high)) and where the clipped branch is the larger."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("vanilla")
def vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """PPO's clipped surrogate, asymmetric clip (1 - clip_ratio_low, 1 + clip_high), dual clip.

    The dual clip bounds the loss of a negative-advantage token at ``clip_ratio_c * |A|``: a
    ratio far above 1 on a bad token would otherwise give an unbounded step.
    ``clipfrac_lower`` is the fraction of masked tokens where that bound is active.
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(_log_ratio(old_log_prob, log_prob))
    clip_loss, clipped = _clipped_surrogate(ratio, advantages, cfg)
    dual_bound = -advantages * cfg.clip_ratio_c
    dual_active = (advantages < 0) & (clip_loss > dual_bound)
    loss_mat = torch.where(dual_active, dual_bound, clip_loss)
    metrics = {"clipfrac": _fraction(clipped, response_mask),
               "clipfrac_lower": _fraction(dual_active, response_mask),
               "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask)}
    return zero_padding(loss_mat, response_mask), metrics


@register_policy_loss("gspo")
def gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """GSPO: one importance ratio per sequence, the exp of its mean token log-ratio, clipped.

    Written per token as ``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])``: the value is the
    sequence ratio ``s_i`` at every token and each token's gradient is ``s_i * grad logp_t``.
    Aggregated with ``seq-mean-token-mean`` that is GSPO's sequence gradient exactly.
    Clipped at (1 - clip_ratio_low, 1 + clip_high) like PPO, no dual clip; GSPO's clip ranges
    are far narrower than PPO's (the paper uses 3e-4 / 4e-4).
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    sequence_log_ratio = masked_mean(log_prob - old_log_prob, response_mask, dim=-1)
    token_log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    loss_mat, clipped = _clipped_surrogate(ratio, advantages, cfg)
    metrics = {"clipfrac": _fraction(clipped, response_mask),
               "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask)}
    return zero_padding(loss_mat, response_mask), metrics


@register_policy_loss("cispo")
def cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """CISPO: ``-sg[min(r, 1 + clip_high)] * A * logp``.

    The importance weight is clipped and detached, so no token's gradient is dropped (PPO's
    clip zeroes it); it only scales the REINFORCE gradient of ``logp``. Only the upper bound is
    applied, as MiniMax-M1 found best (they set the lower one out of reach); ``clipfrac`` is the
    fraction of tokens whose weight hit it.
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(_log_ratio(old_log_prob, log_prob)).detach()
    upper = 1.0 + cfg.clip_high
    loss_mat = -torch.clamp(ratio, max=upper) * advantages * log_prob
    metrics = {"clipfrac": _fraction(ratio > upper, response_mask),
               "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask)}
    return zero_padding(loss_mat, response_mask), metrics


def _unclipped_metrics(old_log_prob, log_prob, response_mask):
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return {"clipfrac": zero, "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask)}


@register_policy_loss("gpg")
def gpg_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """GPG: the plain policy gradient ``-A * logp``, no ratio and no clip (``clipfrac`` is 0)."""
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    loss_mat = -advantages * log_prob
    return zero_padding(loss_mat, response_mask), _unclipped_metrics(old_log_prob, log_prob, response_mask)


@register_policy_loss("reinforce")
def reinforce_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """REINFORCE through the importance ratio, ``-A * r``, unclipped.

    On-policy (r = 1) its gradient is ``-A * grad logp``, the same as ``gpg``; off-policy the
    ratio corrects for the rollout policy without PPO's trust region.
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    loss_mat = -advantages * torch.exp(_log_ratio(old_log_prob, log_prob))
    return zero_padding(loss_mat, response_mask), _unclipped_metrics(old_log_prob, log_prob, response_mask)


def compute_policy_loss(name: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                        advantages: torch.Tensor, response_mask: torch.Tensor, cfg: AlgorithmConfig, *,
                        loss_agg_mode: str, max_response_length: Optional[int] = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar policy loss ``name`` aggregated under ``loss_agg_mode``, and its metrics."""
    loss_mat, metrics = get_policy_loss(name)(old_log_prob, log_prob, advantages, response_mask, cfg)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, max_response_length=max_response_length)
    return loss, metrics


# ---------------------------------------------------------------- KL penalties


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio ** 2


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # Schulman's unbiased, always >= 0 estimator in the reference-over-actor ratio; the
    # exponent is clamped so exp cannot overflow, the result clamped to [-10, 10] as is common
    # (it is never below 0) so one wild token cannot dominate the loss
    ref_minus_logp = torch.clamp(-log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.clamp(torch.exp(ref_minus_logp) - ref_minus_logp - 1.0, -10.0, 10.0)


_KL_PENALTIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3,
}


def kl_penalty_names() -> list[str]:
    """Accepted ``kind`` values of ``kl_penalty``."""
    return sorted(_KL_PENALTIES)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(actor || reference) from the two log-probs of the sampled tokens.

    ``k1``: logp - ref; ``abs``: |logp - ref|; ``mse``/``k2``: 0.5 (logp - ref)^2;
    ``low_var_kl``/``k3``: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    if kind not in _KL_PENALTIES:
        raise ValueError(f"unknown KL kind {kind!r} (algorithm.kl_type); choose one of: "
                         f"{', '.join(kl_penalty_names())}")
    return _KL_PENALTIES[kind](log_prob - ref_log_prob)


# ---------------------------------------------------------------- value, entropy, LM losses


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, *, clip: float, loss_agg_mode: str,
               max_response_length: Optional[int] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss ``0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2)``.

    ``vf_clipfrac`` is the fraction of masked tokens where the clipped term is the larger.
    """
    loss_mat, metrics = value_loss_terms(values, old_values, returns, response_mask, clip=clip)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, max_response_length=max_response_length)
    return loss, metrics


def value_loss_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                     response_mask: torch.Tensor, *, clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``value_loss`` before aggregation: the per-token loss ``[B, T]`` and ``vf_clipfrac``
    (for callers that aggregate across micro-batches with ``agg_parts``)."""
    values = zero_padding(values, response_mask)
    old_values = zero_padding(old_values.detach(), response_mask)
    returns = zero_padding(returns.detach(), response_mask)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss_mat = zero_padding(0.5 * torch.maximum(unclipped_error, clipped_error), response_mask)
    return loss_mat, {"vf_clipfrac": _fraction(clipped_error > unclipped_error, response_mask)}


def entropy_loss(entropy: torch.Tensor, mask: torch.Tensor, mode: str, *,
                 max_response_length: Optional[int] = None) -> torch.Tensor:
    """Token entropy aggregated under ``mode``; positive, so the caller subtracts ``entropy_coef`` times it."""
    return agg_loss(entropy, mask, mode, max_response_length=max_response_length)


def lm_loss(log_prob: torch.Tensor, response_mask: torch.Tensor, positive: torch.Tensor, mode: str, *,
            max_response_length: Optional[int] = None) -> torch.Tensor:
    """VAPO's positive-example LM loss: the NLL of the tokens of samples with ``positive`` [B] true.

    Aggregated under ``mode`` over those samples only; 0 when no sample is positive.
    """
    positive_mask = as_bool_mask(response_mask) & positive.bool().unsqueeze(-1)
    return agg_loss(-log_prob, positive_mask, mode, max_response_length=max_response_length)
