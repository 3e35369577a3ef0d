"""Policy, value, KL, entropy and LM losses as plain tensor functions, and how they are averaged.

Shapes: ``B`` samples, ``T`` response tokens (right-padded); ``response_mask`` [B, T] is 1 (or
True) on real response tokens. Every function here reads only masked positions: whatever
sits in the padding (zeros, garbage, NaN) never changes a result or a gradient.

    log_prob, old_log_prob, advantages --get_policy_loss(name)--> loss_mat [B, T], metrics
    loss_mat, mask --agg_parts(mode)--> (numerator, denominator)            # per micro-batch
    sum(numerators) / max(sum(denominators), 1) == agg_loss(whole batch)    # exactly, every mode

The masked helpers (``masked_sum``, ``masked_mean``, ``masked_var``, ``masked_whiten``) live
here (with ``as_bool_mask`` and ``zero_padding``) and are shared with ``estimators`` and ``shaping``.
"""

import hashlib
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

# k3's exponent is clamped to this so exp cannot overflow (the policy losses' clamp is
# AlgorithmConfig.log_ratio_clamp)
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
    return (centred**2).sum() / divisor


class BatchSplit(Protocol):
    """A batch split over data-parallel ranks: ``sum`` adds a statistic over every rank's rows
    (``hybridflow.runtime.shares.Shard``); None where one process holds the whole batch."""

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8, split: Optional[BatchSplit] = None
) -> torch.Tensor:
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


def _token_sum_parts(loss_mat, mask, max_response_length):
    # a denominator of 0 on every micro-batch: divided by max(total, 1), the plain global sum
    return masked_sum(loss_mat, mask), torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)


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
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' divides by the generation budget: "
            f"pass max_response_length >= 1 (data.max_response_length), got {max_response_length}"
        )
    sums, _, nonempty = _sequence_sums(loss_mat, mask)
    return sums.sum(), nonempty.sum().to(loss_mat.dtype) * max_response_length


_AGG_MODES: dict[str, AggParts] = {
    "token-mean": _token_mean_parts,
    "token-sum": _token_sum_parts,
    "seq-mean-token-sum": _seq_mean_token_sum_parts,
    "seq-mean-token-mean": _seq_mean_token_mean_parts,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm_parts,
}
LOSS_AGG_MODES = tuple(_AGG_MODES)


def agg_parts(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, max_response_length: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the aggregated loss of one micro-batch.

    Summing both over the micro-batches of a batch and dividing the numerator by
    max(denominator, 1) gives exactly ``agg_loss`` of the whole batch, because every mode is a
    ratio of two sums over samples:

    - ``token-mean``: sum of masked token losses / number of masked tokens;
    - ``token-sum``: sum of masked token losses, unnormalised (verl's ``token-sum``: the global
      batch's token sum). Its denominator is 0 on every micro-batch, so the max(.., 1) makes it
      the plain sum; Megatron's per-token-loss scaling likewise skips a token count of 0;
    - ``seq-mean-token-sum``: sum of per-sequence token sums / number of sequences;
    - ``seq-mean-token-mean``: sum of per-sequence token means / number of sequences;
    - ``seq-mean-token-sum-norm``: sum of per-sequence token sums /
      (number of sequences * ``max_response_length``), Dr. GRPO's constant normaliser.

    Sequences with no masked token count in no denominator: they would only dilute the mean.
    """
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of: {', '.join(LOSS_AGG_MODES)}")
    return _AGG_MODES[mode](loss_mat, mask, max_response_length)


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, max_response_length: Optional[int] = None
) -> torch.Tensor:
    """The scalar loss of ``loss_mat`` averaged under ``mode`` (see ``agg_parts``); 0 if all is padding."""
    numerator, denominator = agg_parts(loss_mat, mask, mode, max_response_length=max_response_length)
    return numerator / denominator.clamp(min=1)


# ---------------------------------------------------------------- policy losses

PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]
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
        raise ValueError(
            f"unknown policy loss {name!r} (algorithm.policy_loss); registered: {', '.join(policy_loss_names())}"
        )
    return _POLICY_LOSSES[name]


def _clean_inputs(old_log_prob, log_prob, advantages, mask):
    """Inputs with zeroed padding, old log-probs detached: the rollout policy is a constant."""
    return (
        zero_padding(old_log_prob.detach(), mask),
        zero_padding(log_prob, mask),
        zero_padding(advantages.detach(), mask),
    )


def _clamp_log_ratio(log_ratio: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """``log_ratio`` clamped to +/- ``cfg.log_ratio_clamp`` (None: as it is)."""
    bound = cfg.log_ratio_clamp
    return log_ratio if bound is None else torch.clamp(log_ratio, -bound, bound)


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    """log(pi / pi_old) of the sampled tokens, clamped as ``cfg.log_ratio_clamp`` says."""
    return _clamp_log_ratio(log_prob - old_log_prob, cfg)


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
    ratio = torch.exp(_log_ratio(old_log_prob, log_prob, cfg))
    clip_loss, clipped = _clipped_surrogate(ratio, advantages, cfg)
    dual_bound = -advantages * cfg.clip_ratio_c
    dual_active = (advantages < 0) & (clip_loss > dual_bound)
    loss_mat = torch.where(dual_active, dual_bound, clip_loss)
    metrics = {
        "clipfrac": _fraction(clipped, response_mask),
        "clipfrac_lower": _fraction(dual_active, response_mask),
        "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask),
    }
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
    ratio = torch.exp(_clamp_log_ratio(token_log_ratio, cfg))
    loss_mat, clipped = _clipped_surrogate(ratio, advantages, cfg)
    metrics = {"clipfrac": _fraction(clipped, response_mask), "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask)}
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
    ratio = torch.exp(_log_ratio(old_log_prob, log_prob, cfg)).detach()
    upper = 1.0 + cfg.clip_high
    loss_mat = -torch.clamp(ratio, max=upper) * advantages * log_prob
    metrics = {
        "clipfrac": _fraction(ratio > upper, response_mask),
        "ppo_kl": _ppo_kl(old_log_prob, log_prob, response_mask),
    }
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
    loss_mat = -advantages * torch.exp(_log_ratio(old_log_prob, log_prob, cfg))
    return zero_padding(loss_mat, response_mask), _unclipped_metrics(old_log_prob, log_prob, response_mask)


# ---------------------------------------------------------------- covariance-selected losses
# Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
# Models" (arXiv 2505.22617): entropy falls where a token's log-prob and advantage covary, so
# both losses act on the few tokens of largest covariance (A - mean A) * (logp - mean logp).


def _covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] detached (A - mean A) * (logp - mean logp), the means over the masked tokens."""
    advantages, log_prob = advantages.detach(), log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


def _selection_generator(seed: int, *tensors: torch.Tensor) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and the bytes of ``tensors``: the same micro-batch
    draws alike in every run, and different micro-batches draw independently. Fed only what is
    constant to the update (old log-probs, advantages), so the loss is a fixed, piecewise
    smooth function of the current log-probs."""
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8)
    for tensor in tensors:
        digest.update(tensor.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


def _bool_at(flat_positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    chosen = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    chosen[flat_positions] = True
    return chosen.view(like.shape)


def _draw(candidates: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Bool mask of ``count`` of the true entries of ``candidates`` (all if fewer), uniformly."""
    positions = candidates.flatten().nonzero().squeeze(-1)
    order = torch.randperm(positions.numel(), generator=generator)[:count].to(positions.device)
    return _bool_at(positions[order], candidates)


def _largest(scores: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """Bool mask of the ``count`` masked entries of largest ``scores``; ties go to the earlier
    entry (row-major), so the choice is deterministic."""
    mask = as_bool_mask(mask)
    ranked = scores.masked_fill(~mask, -torch.inf).flatten()
    order = torch.sort(ranked, descending=True, stable=True).indices[:count]
    return _bool_at(order, scores) & mask


def _token_budget(fraction: float, mask: torch.Tensor) -> int:
    """max(int(fraction * masked tokens), 1), as verl counts; 0 when nothing is masked in."""
    tokens = int(as_bool_mask(mask).sum())
    return max(int(fraction * tokens), 1) if tokens else 0


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """Clip-Cov: PPO's clipped surrogate (no dual clip) with a few high-covariance tokens detached.

    Candidates are the masked tokens PPO's clip left alone whose covariance term lies strictly
    in (``clip_cov_lb``, ``clip_cov_ub``); ``max(int(clip_cov_ratio * tokens), 1)`` of them
    (all, if fewer) are drawn uniformly and their loss set to 0, so they carry no gradient.
    Statistics and budget are per call (per micro-batch), as in verl's
    ``compute_policy_loss_clip_cov``. ``clipfrac`` is the fraction of masked tokens drawn (verl's
    ``pg_clipfrac`` here), not PPO's clip fraction.

    Differences from verl: the draw uses a generator seeded from ``cfg.clip_cov_seed`` and a hash
    of the micro-batch's old log-probs and advantages instead of the global RNG, so a run is
    reproducible (the draw has the same distribution; a micro-batch draws alike in each of its
    PPO epochs, among the candidates of that epoch); the log-ratio is clamped to
    ``cfg.log_ratio_clamp`` (verl does not clamp here: None gives verl's values where
    |log r| > 20).
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    mask = as_bool_mask(response_mask)
    clip_loss, clipped = _clipped_surrogate(torch.exp(_log_ratio(old_log_prob, log_prob, cfg)), advantages, cfg)
    covariance = _covariance(advantages, log_prob, mask)
    candidates = mask & ~clipped & (covariance > cfg.clip_cov_lb) & (covariance < cfg.clip_cov_ub)
    generator = _selection_generator(cfg.clip_cov_seed, old_log_prob, advantages)
    dropped = _draw(candidates, _token_budget(cfg.clip_cov_ratio, mask), generator)
    loss_mat = torch.where(dropped, torch.zeros_like(clip_loss), clip_loss)
    metrics = {"clipfrac": _fraction(dropped, mask), "ppo_kl": _ppo_kl(old_log_prob, log_prob, mask)}
    return zero_padding(loss_mat, mask), metrics


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """KL-Cov: the unclipped surrogate ``-A r``, plus ``ppo_kl_coef * |log r|`` on the
    ``max(int(kl_cov_ratio * tokens), 1)`` masked tokens of largest covariance term.

    As verl's ``compute_policy_loss_kl_cov``: no ratio clip; statistics and the top-k are per
    call (per micro-batch). Ties in the top-k (e.g. every advantage equal, covariance 0
    everywhere) go to the earlier token. Metrics: ``ppo_kl`` is the signed mean of
    log(pi_old / pi), as for every policy loss here; ``ppo_kl_abs`` is the mean of |log r|, the
    value verl reports as ``ppo_kl`` for this loss; ``clipfrac`` is the fraction of tokens
    penalised (verl reports none). The log-ratio is clamped to ``cfg.log_ratio_clamp`` (verl does
    not clamp here: set it to None for verl's values where |log r| > 20).
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    mask = as_bool_mask(response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob, cfg)
    penalised = _largest(_covariance(advantages, log_prob, mask), mask, _token_budget(cfg.kl_cov_ratio, mask))
    penalty = torch.where(penalised, cfg.ppo_kl_coef * log_ratio.abs(), torch.zeros_like(log_ratio))
    loss_mat = -advantages * torch.exp(log_ratio) + penalty
    metrics = {
        "clipfrac": _fraction(penalised, mask),
        "ppo_kl": _ppo_kl(old_log_prob, log_prob, mask),
        "ppo_kl_abs": masked_mean((log_prob - old_log_prob).abs(), mask).detach(),
    }
    return zero_padding(loss_mat, mask), metrics


# ---------------------------------------------------------------- soft and sequence trust regions


@register_policy_loss("sapo")
def sapo_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """SAPO ("Soft Adaptive Policy Optimization", arXiv 2511.20347): PPO's hard clip replaced by
    a smooth gate, ``-f(r) * A`` with ``f(r) = 4 / tau * sigmoid(tau * (r - 1))``.

    ``tau`` is ``sapo_tau_pos`` where A > 0 and ``sapo_tau_neg`` elsewhere. At r = 1 the gradient
    is that of ``-A r`` (f'(1) = 1); away from it the gradient fades instead of stopping, faster
    for the larger tau. As verl's ``compute_policy_loss_sapo`` (which also clamps log r at 20,
    here ``cfg.log_ratio_clamp``); verl always aggregates it with ``seq-mean-token-mean``, here
    the run's ``loss_agg_mode`` decides. No clip: ``clipfrac`` is 0.
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(_log_ratio(old_log_prob, log_prob, cfg))
    tau = torch.where(advantages > 0, ratio.new_tensor(cfg.sapo_tau_pos), ratio.new_tensor(cfg.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = -gate * advantages
    return zero_padding(loss_mat, response_mask), _unclipped_metrics(old_log_prob, log_prob, response_mask)


@register_policy_loss("gmpo")
@register_policy_loss("geo_mean")
def gmpo_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """GMPO ("Geometric-Mean Policy Optimization", arXiv 2507.20673; verl's ``geo_mean``): one
    ratio per sequence, the geometric mean of its token ratios, ``L_i = -mean_t(A) * exp(mean_t
    log r'_t)``.

    Each token's log-ratio is clipped in log space to [-clip_ratio_low, clip_high] on the
    pessimistic side only: ``log r' = sign(A) * min(sign(A) log r, sign(A) clip(log r))`` (a token
    with A = 0 adds 0 to the mean). Written per token like ``gspo``: every token carries the value
    ``L_i`` and its own share of the gradient, so ``seq-mean-token-mean`` gives verl's sequence
    mean exactly (verl divides by every row, empty ones too; here empty rows count for nothing).
    The paper clips at 0.4 (its (e^-0.4, e^0.4)); verl reuses the PPO clip ratios, as here.
    ``clipfrac`` / ``clipfrac_lower``: masked tokens with log r outside the range and A > 0 / A < 0.
    verl does not clamp log r here; ``cfg.log_ratio_clamp`` does (None: as verl).
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    mask = as_bool_mask(response_mask)
    log_ratio = _log_ratio(old_log_prob, log_prob, cfg)
    clipped = torch.clamp(log_ratio, -cfg.clip_ratio_low, cfg.clip_high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    sequence_log_ratio = masked_mean(pessimistic, mask, dim=-1)
    token_log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + pessimistic - pessimistic.detach()
    loss_mat = -masked_mean(advantages, mask, dim=-1).unsqueeze(-1) * torch.exp(token_log_ratio)
    outside = log_ratio != clipped
    metrics = {
        "clipfrac": _fraction(outside & (advantages > 0), mask),
        "clipfrac_lower": _fraction(outside & (advantages < 0), mask),
        "ppo_kl": _ppo_kl(old_log_prob, log_prob, mask),
    }
    return zero_padding(loss_mat, mask), metrics


# ---------------------------------------------------------------- divergence trust region (DPPO)
# Qi et al., 2026, "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv
# 2602.04879), as verl's compute_policy_loss_dppo_tv / _dppo_kl: the trust region is a bound on
# a divergence between the old and new distributions over {sampled token, everything else}.


def _tv_inside(old_log_prob, log_prob, advantages, cfg: AlgorithmConfig) -> torch.Tensor:
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    return torch.where(advantages > 0, change <= cfg.clip_high, change >= -cfg.clip_ratio_low)


def _binary_kl_inside(old_log_prob, log_prob, advantages, cfg: AlgorithmConfig) -> torch.Tensor:
    # KL(old || new) of the two-outcome distributions; the 1e-8 are verl's
    old_prob, prob = torch.exp(old_log_prob), torch.exp(log_prob)
    kl = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    up = (kl <= cfg.clip_high) | (prob <= old_prob)
    down = (kl <= cfg.clip_ratio_low) | (prob >= old_prob)
    return torch.where(advantages > 0, up, down)


def _dppo(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig, inside_region):
    """``-A * sg[min(r, clip_ratio_c)] * logp`` on tokens inside the region, 0 (no gradient) outside.

    A token is outside when its probability has already moved, in the direction its advantage
    pushes, past the divergence bound (clip_high for A > 0, clip_ratio_low otherwise: divergence
    thresholds here, not ratio clips); the region is detached. ``clipfrac``: tokens outside;
    ``clipfrac_lower``: tokens inside whose importance weight hit ``clip_ratio_c``.
    """
    old_log_prob, log_prob, advantages = _clean_inputs(old_log_prob, log_prob, advantages, response_mask)
    mask = as_bool_mask(response_mask)
    ratio = torch.exp(_log_ratio(old_log_prob, log_prob, cfg)).detach()
    inside = inside_region(old_log_prob, log_prob.detach(), advantages, cfg)
    weighted = -advantages * torch.clamp(ratio, max=cfg.clip_ratio_c) * log_prob
    loss_mat = torch.where(inside, weighted, torch.zeros_like(weighted))
    metrics = {
        "clipfrac": _fraction(~inside, mask),
        "clipfrac_lower": _fraction(inside & (ratio > cfg.clip_ratio_c), mask),
        "ppo_kl": _ppo_kl(old_log_prob, log_prob, mask),
    }
    return zero_padding(loss_mat, mask), metrics


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """DPPO-Binary-TV: inside while p - p_old <= clip_high (A > 0) or >= -clip_ratio_low (A <= 0).

    The paper's recipe: thresholds 0.15, ``clip_ratio_c`` 1e4 (the weight barely truncated);
    the defaults here (0.2, 3.0) are verl's. See ``_dppo`` for the loss and metrics.
    """
    return _dppo(old_log_prob, log_prob, advantages, response_mask, cfg, _tv_inside)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(old_log_prob, log_prob, advantages, response_mask, cfg: AlgorithmConfig):
    """DPPO-Binary-KL: inside while the binary KL(old || new) is within the bound, or the token
    moved against its advantage's push (p <= p_old for A > 0, p >= p_old otherwise).

    The paper's recipe: thresholds 0.05, ``clip_ratio_c`` 1e4. See ``_dppo``.
    """
    return _dppo(old_log_prob, log_prob, advantages, response_mask, cfg, _binary_kl_inside)


def compute_policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    loss_agg_mode: str,
    max_response_length: Optional[int] = None,
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
    return 0.5 * log_ratio**2


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # Schulman's unbiased, always >= 0 estimator in the reference-over-actor ratio; the
    # exponent is clamped so exp cannot overflow, the result clamped to [-10, 10] as is common
    # (it is never below 0) so one wild token cannot dominate the loss
    ref_minus_logp = torch.clamp(-log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.clamp(torch.exp(ref_minus_logp) - ref_minus_logp - 1.0, -10.0, 10.0)


def _straight_through(estimator: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``estimator``'s value with k2's gradient: k1 and k3 are unbiased estimates of the KL, but
    their gradients are not unbiased estimates of its gradient; k2's is (on-policy)."""

    def kl(log_ratio: torch.Tensor) -> torch.Tensor:
        backward = _k2(log_ratio)
        return backward - backward.detach() + estimator(log_ratio).detach()

    return kl


_KL_PENALTIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}
_KL_PENALTIES |= {f"{kind}+": _straight_through(_KL_PENALTIES[kind]) for kind in ("k1", "abs", "low_var_kl", "k3")}


def kl_penalty_names() -> list[str]:
    """Accepted ``kind`` values of ``kl_penalty``."""
    return sorted(_KL_PENALTIES)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(actor || reference) from the two log-probs of the sampled tokens.

    ``k1``: logp - ref; ``abs``: |logp - ref|; ``mse``/``k2``: 0.5 (logp - ref)^2;
    ``low_var_kl``/``k3``: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    ``k1+``, ``abs+``, ``low_var_kl+``, ``k3+``: that estimator's value with the gradient of k2,
    ``(logp - ref) * grad logp`` (verl's ``+`` kinds, straight through).
    """
    if kind not in _KL_PENALTIES:
        raise ValueError(
            f"unknown KL kind {kind!r} (algorithm.kl_type); choose one of: {', '.join(kl_penalty_names())}"
        )
    return _KL_PENALTIES[kind](log_prob - ref_log_prob)


# ---------------------------------------------------------------- value, entropy, LM losses


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip: float,
    loss_agg_mode: str,
    max_response_length: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss ``0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2)``.

    ``vf_clipfrac`` is the fraction of masked tokens where the clipped term is the larger.
    """
    loss_mat, metrics = value_loss_terms(values, old_values, returns, response_mask, clip=clip)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, max_response_length=max_response_length)
    return loss, metrics


def value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor, *, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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


def entropy_loss(
    entropy: torch.Tensor, mask: torch.Tensor, mode: str, *, max_response_length: Optional[int] = None
) -> torch.Tensor:
    """Token entropy aggregated under ``mode``; positive, so the caller subtracts ``entropy_coef`` times it."""
    return agg_loss(entropy, mask, mode, max_response_length=max_response_length)


def lm_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    positive: torch.Tensor,
    mode: str,
    *,
    max_response_length: Optional[int] = None,
) -> torch.Tensor:
    """VAPO's positive-example LM loss: the NLL of the tokens of samples with ``positive`` [B] true.

    Aggregated under ``mode`` over those samples only; 0 when no sample is positive.
    """
    positive_mask = as_bool_mask(response_mask) & positive.bool().unsqueeze(-1)
    return agg_loss(-log_prob, positive_mask, mode, max_response_length=max_response_length)
