"""Advantage estimators: token rewards in, (advantages, returns) out, registered by name.

Shapes: ``B`` samples, ``T`` response tokens (right-padded). Every estimator has the signature

    fn(token_rewards [B, T], response_mask [B, T], *, index [B], cfg, values=None, baseline=None,
       split=None) -> (advantages [B, T], returns [B, T])          # both 0 outside the mask

``split`` (a ``losses.BatchSplit``) says the B rows are one data-parallel rank's share of the
batch, whole groups each: batch-wide statistics (whitening, GPG's valid fraction) then cover
every rank's rows, so each rank computes what one process would on the whole batch.

``index`` is the group id of each sample (the samples of one prompt share it; groups may be any
size and need not be contiguous). Rewards usually sit on the last response token
(``scores_to_token_rewards``); a sample's *score* is the sum of its token rewards.

Critic-free estimators return their advantages as the returns, except where noted; only
``gae`` produces returns a critic should regress on.
"""

import logging
from collections.abc import Callable
from typing import Optional, Protocol

import torch

from hybridflow.algorithms.losses import BatchSplit, as_bool_mask, masked_sum, masked_whiten, zero_padding
from hybridflow.config import AlgorithmConfig

__all__ = [
    "Estimator",
    "estimator_names",
    "get_estimator",
    "group_ids",
    "group_mean_std",
    "group_all_equal",
    "register_estimator",
    "return_to_go",
    "scores_to_token_rewards",
    "sequence_scores",
]

logger = logging.getLogger(__name__)

_EPS = 1e-6


class Estimator(Protocol):
    """An advantage estimator (see the module docstring for shapes)."""

    def __call__(
        self,
        token_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        index: torch.Tensor,
        cfg: AlgorithmConfig,
        values: Optional[torch.Tensor] = None,
        baseline: Optional[torch.Tensor] = None,
        split: Optional[BatchSplit] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: make an ``Estimator`` available to ``get_estimator(name)``."""

    def add(fn: Estimator) -> Estimator:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        return fn

    return add


def estimator_names() -> list[str]:
    """Registered advantage-estimator names."""
    return sorted(_ESTIMATORS)


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``; ValueError lists the valid names."""
    if name not in _ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r} (algorithm.adv_estimator); "
            f"registered: {', '.join(estimator_names())}"
        )
    return _ESTIMATORS[name]


# ---------------------------------------------------------------- token / sequence helpers


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token rewards holding each score on its sample's last response token, 0 elsewhere.

    A sample with an empty mask gets no reward at all: there is no token to put it on.
    """
    mask = as_bool_mask(response_mask)
    if mask.shape[-1] == 0:  # no response column (a step that kept no sample): nowhere to put one
        return torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=-1).values
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    placed = torch.where(last >= 0, scores, torch.zeros_like(scores))
    return rewards.scatter(-1, last.clamp(min=0).unsqueeze(-1), placed.unsqueeze(-1))


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] score of each sample: the sum of its masked token rewards."""
    return masked_sum(token_rewards, response_mask, dim=-1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T], the value on every masked token and 0 on the padding."""
    return zero_padding(per_sample.unsqueeze(-1).expand(response_mask.shape), response_mask)


def _discounted_backward(
    deltas: torch.Tensor, response_mask: torch.Tensor, decay: torch.Tensor | float
) -> torch.Tensor:
    """acc_t = delta_t + decay * acc_next, run right to left over the masked tokens only.

    Unmasked positions inside a response (a tool's output in a multi-turn sample) are skipped:
    they neither add to the sum nor decay it. ``decay`` is a float or a [B] tensor.
    """
    mask = as_bool_mask(response_mask)
    deltas = zero_padding(deltas, response_mask)
    acc = torch.zeros_like(deltas[:, 0])
    out = torch.zeros_like(deltas)
    for t in reversed(range(deltas.shape[-1])):
        candidate = deltas[:, t] + decay * acc
        acc = torch.where(mask[:, t], candidate, acc)
        out[:, t] = torch.where(mask[:, t], candidate, torch.zeros_like(candidate))
    return out


def return_to_go(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, T] discounted sum of the masked rewards from each token to the end of its response."""
    return _discounted_backward(token_rewards, response_mask, gamma)


# ---------------------------------------------------------------- group statistics


def group_ids(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(dense group id in [0, num_groups) of each sample, num_groups) for arbitrary ids."""
    _, inverse = torch.unique(index, return_inverse=True)
    return inverse, (int(inverse.max().item()) + 1 if inverse.numel() else 0)


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_mean_std(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([B] mean, [B] std, [B] size) of each sample's group.

    The std is Bessel-corrected (the sample std, as ``torch.std``); a group of one has std 0.
    Each estimator decides what a group of one means for it.
    """
    inverse, num_groups = group_ids(index)
    size = _group_sum(torch.ones_like(scores), inverse, num_groups)
    mean = _group_sum(scores, inverse, num_groups) / size
    squares = _group_sum((scores - mean[inverse]) ** 2, inverse, num_groups)
    std = torch.sqrt(squares / (size - 1).clamp(min=1))
    return mean[inverse], std[inverse], size[inverse]


def _group_extreme(x: torch.Tensor, inverse: torch.Tensor, num_groups: int, reduce: str) -> torch.Tensor:
    """[num_groups] max (``reduce="amax"``) or min (``"amin"``) of x over each group."""
    start = -torch.inf if reduce == "amax" else torch.inf
    empty = torch.full((num_groups,), start, dtype=x.dtype, device=x.device)
    return empty.scatter_reduce(0, inverse, x, reduce=reduce)


def group_all_equal(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B] bool: the sample's group has one score only (exact equality; true for groups of one)."""
    inverse, num_groups = group_ids(index)
    high = _group_extreme(scores, inverse, num_groups, "amax")
    low = _group_extreme(scores, inverse, num_groups, "amin")
    return (high == low)[inverse]


def _peer_mean_std(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group mean and std, with mean 0 and std 1 for a group of one: with no peers there is no
    baseline to subtract, and the lone score passes through unchanged."""
    mean, std, size = group_mean_std(scores, index)
    alone = size < 2
    return torch.where(alone, torch.zeros_like(mean), mean), torch.where(alone, torch.ones_like(std), std)


# ---------------------------------------------------------------- estimators


def _adaptive_lam(response_mask: torch.Tensor, cfg: AlgorithmConfig, dtype: torch.dtype) -> torch.Tensor | float:
    """The actor's lambda: ``cfg.lam``, or VAPO's ``1 - 1 / (alpha * length)`` per sequence.

    Clamped to [0, 1]: a sequence shorter than 1 / alpha would get a negative lambda.
    """
    alpha = cfg.length_adaptive_lam_alpha
    if alpha is None:
        return cfg.lam
    if alpha <= 0:
        raise ValueError(f"algorithm.length_adaptive_lam_alpha={alpha} must be > 0 (VAPO uses 0.05) or null")
    lengths = as_bool_mask(response_mask).sum(-1).clamp(min=1).to(dtype)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def _gae(token_rewards, values, response_mask, gamma: float, lam) -> torch.Tensor:
    """Unwhitened GAE advantages; the value after a response's last token is 0."""
    mask = as_bool_mask(response_mask)
    values = zero_padding(values, response_mask)
    # V of the next masked token; masked-out positions pass their successor's value through
    next_values = torch.zeros_like(values)
    upcoming = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        next_values[:, t] = upcoming
        upcoming = torch.where(mask[:, t], values[:, t], upcoming)
    deltas = token_rewards + gamma * next_values - values
    return _discounted_backward(deltas, response_mask, gamma * lam)


@register_estimator("gae")
def gae(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """Generalised advantage estimation over the response tokens, with VAPO's two lambdas built in.

    - returns = GAE(``cfg.critic_lam``, or ``cfg.lam`` when unset) + values: the critic's target;
    - advantages = GAE(actor lambda), whitened over the batch's masked tokens, where the actor
      lambda is ``cfg.lam``, or per sequence ``1 - 1 / (alpha * length)`` when
      ``cfg.length_adaptive_lam_alpha`` is set (VAPO's length-adaptive GAE).

    With neither knob set this is standard PPO GAE. ``values`` [B, T] is required.
    """
    if values is None:
        raise ValueError(
            "the gae estimator needs the critic's values [B, T]: run a critic "
            "(algorithm ppo/vapo) or pick a critic-free algorithm.adv_estimator"
        )
    values = values.detach()
    critic_lam = cfg.lam if cfg.critic_lam is None else cfg.critic_lam
    actor_lam = _adaptive_lam(response_mask, cfg, values.dtype)
    critic_advantages = _gae(token_rewards, values, response_mask, cfg.gamma, critic_lam)
    returns = zero_padding(critic_advantages + values, response_mask)
    same_lam = isinstance(actor_lam, float) and actor_lam == critic_lam
    actor_advantages = (
        critic_advantages if same_lam else _gae(token_rewards, values, response_mask, cfg.gamma, actor_lam)
    )
    return masked_whiten(actor_advantages, response_mask, split=split), returns


@register_estimator("grpo")
def grpo(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """GRPO: (score - group mean) / (group std + eps), or score - group mean when
    ``cfg.norm_adv_by_std`` is false (Dr. GRPO).

    The std is the sample std (Bessel-corrected). A group of one has mean 0 and std 1: with no
    peers its score is its advantage. Returns = advantages.
    """
    scores = sequence_scores(token_rewards, response_mask)
    mean, std = _peer_mean_std(scores, index)
    centred = scores - mean
    advantages = _broadcast(centred / (std + _EPS) if cfg.norm_adv_by_std else centred, response_mask)
    return advantages, advantages


@register_estimator("rloo")
def rloo(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """RLOO: score minus the mean score of the other samples of the group.

    That is ``n / (n - 1) * (score - group mean)`` for a group of n; a group of one has no other
    sample and gets advantage 0. Returns = advantages.
    """
    scores = sequence_scores(token_rewards, response_mask)
    mean, _, size = group_mean_std(scores, index)
    factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    advantages = _broadcast(factor * (scores - mean), response_mask)
    return advantages, advantages


@register_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None
):
    """REINFORCE++: return-to-go of the token rewards (``cfg.gamma``), whitened over the batch's
    masked tokens. Returns = the unwhitened return-to-go."""
    returns = return_to_go(token_rewards, response_mask, cfg.gamma)
    return masked_whiten(returns, response_mask, split=split), returns


@register_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None
):
    """REINFORCE++ with a group baseline: score - group mean, broadcast, then whitened over the
    batch's masked tokens. A group of one has no baseline (mean 0), as in ``grpo``.
    Returns = advantages."""
    scores = sequence_scores(token_rewards, response_mask)
    mean, _ = _peer_mean_std(scores, index)
    advantages = masked_whiten(_broadcast(scores - mean, response_mask), response_mask, split=split)
    return advantages, advantages


@register_estimator("remax")
def remax(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """ReMax: score minus ``baseline`` [B] (the score of the greedy response to the same prompt),
    broadcast over the response. Returns = return-to-go (``cfg.gamma``) minus the baseline, which
    equals the advantages when gamma is 1 and the score sits on the last token."""
    if baseline is None:
        raise ValueError(
            "the remax estimator needs baseline [B], the greedy response's score: "
            "generate the greedy rollout or pick another algorithm.adv_estimator"
        )
    scores = sequence_scores(token_rewards, response_mask)
    advantages = _broadcast(scores - baseline, response_mask)
    returns = zero_padding(
        return_to_go(token_rewards, response_mask, cfg.gamma) - baseline.unsqueeze(-1), response_mask
    )
    return advantages, returns


@register_estimator("gpg")
def gpg(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """GPG: alpha * (score - group mean), with alpha = B / B_valid.

    B_valid counts the samples of groups whose scores are not all equal; the others carry no
    gradient, and alpha scales the rest up so the batch-mean loss keeps its size. alpha = 1 when
    no group is valid (every advantage is 0 then). A group of one is not valid and its
    advantage is 0 (it is centred on its own score). No std normalisation: ``cfg.norm_adv_by_std``
    is ignored. Returns = advantages.
    """
    scores = sequence_scores(token_rewards, response_mask)
    mean, _, _ = group_mean_std(scores, index)
    counts = torch.tensor([scores.shape[0], int((~group_all_equal(scores, index)).sum())], dtype=torch.float64)
    total, num_valid = (split.sum(counts) if split is not None else counts).tolist()
    alpha = total / num_valid if num_valid else 1.0
    advantages = _broadcast(alpha * (scores - mean), response_mask)
    return advantages, advantages


@register_estimator("opo")
def opo(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """OPO ("On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585; verl's
    ``compute_opo_outcome_advantage``): score minus the group's length-weighted mean score,
    ``sum_j |y_j| s_j / sum_j |y_j|`` with ``|y|`` the masked response length.

    That is the variance-minimising baseline when each token's gradient has about the same
    norm, so a sample weighs in proportion to its length. A group of one has baseline 0 (its
    score passes through, as in verl); no std normalisation (``cfg.norm_adv_by_std`` is
    ignored). Returns = advantages.
    """
    scores = sequence_scores(token_rewards, response_mask)
    lengths = as_bool_mask(response_mask).sum(-1).to(scores.dtype)
    inverse, num_groups = group_ids(index)
    total_length = _group_sum(lengths, inverse, num_groups)
    weighted_mean = _group_sum(lengths * scores, inverse, num_groups) / total_length.clamp(min=1)
    size = _group_sum(torch.ones_like(scores), inverse, num_groups)
    group_baseline = torch.where(size > 1, weighted_mean, torch.zeros_like(weighted_mean))
    advantages = _broadcast(scores - group_baseline[inverse], response_mask)
    return advantages, advantages


def _best_of_group(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] bool: the sample is its group's best, the first in batch order on a tie;
    [B] the group's best minus its second-best score)."""
    inverse, num_groups = group_ids(index)
    best = _group_extreme(scores, inverse, num_groups, "amax")
    positions = torch.arange(scores.shape[0], device=scores.device)
    at_best = torch.where(scores == best[inverse], positions, scores.shape[0])
    first = torch.full((num_groups,), scores.shape[0], device=scores.device).scatter_reduce(
        0, inverse, at_best, reduce="amin"
    )
    is_best = positions == first[inverse]
    runner_up = _group_extreme(torch.where(is_best, -torch.inf, scores), inverse, num_groups, "amax")
    return is_best, (best - runner_up)[inverse]


@register_estimator("grpo_passk")
def grpo_passk(token_rewards, response_mask, *, index, cfg: AlgorithmConfig, values=None, baseline=None, split=None):
    """Pass@k advantages (arXiv 2503.19595; verl's ``compute_grpo_passk_outcome_advantage``):
    only each group's best response learns, with advantage best - second-best score, divided by
    (group std + eps) when ``cfg.norm_adv_by_std``; every other response gets 0.

    The std is the sample std (Bessel-corrected), as in ``grpo``. A tie for the best gives 0
    (all-equal scores: 0 everywhere). A group of one has no second-best: ValueError, as in verl.
    Returns = advantages.
    """
    scores = sequence_scores(token_rewards, response_mask)
    _, std, size = group_mean_std(scores, index)
    if bool((size < 2).any()):
        raise ValueError(
            "the grpo_passk estimator compares each group's best response with its "
            f"second best, but a group has {int(size.min())} sample(s): set rollout.n >= 2"
        )
    is_best, gap = _best_of_group(scores, index)
    scale = std + _EPS if cfg.norm_adv_by_std else torch.ones_like(std)
    advantages = _broadcast(torch.where(is_best, gap / scale, torch.zeros_like(gap)), response_mask)
    return advantages, advantages
