"""Reward shaping and sample selection applied between scoring and advantage estimation.

scores [B] --overlong_penalty-->  + length penalty (DAPO)
scores [B] --filter_groups-->     keep [B] (DAPO dynamic sampling)
scores [B] --pf_ppo_resample-->   indices [B] (PF-PPO policy filtration)
token rewards [B, T] --kl_in_reward--> token rewards - coef * KL(actor || reference)
measured KL --AdaptiveKLController.update--> next step's coef (Ziegler et al.)
"""

import logging
import math
from collections.abc import Callable
from typing import Optional

import torch

from hybridflow.algorithms.estimators import group_all_equal
from hybridflow.algorithms.losses import kl_penalty, masked_mean, zero_padding
from hybridflow.config import PF_PPO_MODES

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KL_COEF_NEXT",
    "PF_PPO_MODES",
    "filter_groups",
    "kl_controller",
    "kl_in_reward",
    "overlong_penalty",
    "pf_ppo_resample",
    "pf_ppo_weights",
]

logger = logging.getLogger(__name__)


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong penalty [B], added to the scores.

    0 up to ``max_response_length - buffer_len`` tokens, then falling linearly to
    ``-penalty_factor`` at the full budget (and no lower). ``buffer_len == 0`` turns it off.
    """
    if not 0 <= buffer_len <= max_response_length:
        raise ValueError(
            f"algorithm.overlong_buffer_len={buffer_len} must be in [0, data.max_response_length={max_response_length}]"
        )
    lengths = response_lengths.to(torch.get_default_dtype())
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    excess = lengths - (max_response_length - buffer_len)
    return torch.clamp(-excess / buffer_len * penalty_factor, min=-penalty_factor, max=0.0)


def filter_groups(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: keep [B] is false for every sample of a group whose scores are all
    equal (exactly), since GRPO-style advantages are 0 there and the group only dilutes the batch.

    A group of one is dropped too: it has no peer to compare with.
    """
    keep = ~group_all_equal(scores, index)
    logger.debug("dynamic sampling keeps %d of %d samples", int(keep.sum()), keep.numel())
    return keep


# ---------------------------------------------------------------- PF-PPO


def _uniform_over(selected: torch.Tensor) -> torch.Tensor:
    weights = selected.to(torch.get_default_dtype())
    return weights / weights.sum()


def _pow_weights(scores: torch.Tensor, pow: float) -> torch.Tensor:
    magnitude = scores.abs().to(torch.get_default_dtype()) ** pow
    total = magnitude.sum()
    # all-zero scores carry no preference: fall back to uniform rather than divide by 0
    return magnitude / total if total > 0 else torch.full_like(magnitude, 1.0 / magnitude.numel())


def _max_min_weights(scores: torch.Tensor, pow: float) -> torch.Tensor:
    return _uniform_over((scores == scores.max()) | (scores == scores.min()))


def _max_random_weights(scores: torch.Tensor, pow: float) -> torch.Tensor:
    best = scores == scores.max()
    if best.all():
        return _uniform_over(best)
    # half the mass on the best samples, half spread over the rest: the paper's best-random
    # pairs one best response with one random other
    return 0.5 * _uniform_over(best) + 0.5 * _uniform_over(~best)


_PF_PPO_WEIGHTS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "pow": _pow_weights,
    "max_min": _max_min_weights,
    "max_random": _max_random_weights,
}
if tuple(_PF_PPO_WEIGHTS) != PF_PPO_MODES:  # the config checks names there, torch-free
    raise ImportError(f"PF-PPO weightings {tuple(_PF_PPO_WEIGHTS)} differ from config.PF_PPO_MODES {PF_PPO_MODES}")


def pf_ppo_weights(scores: torch.Tensor, mode: str, *, pow: float = 2.0) -> torch.Tensor:
    """PF-PPO sampling weights [B] (summing to 1) over the batch's samples, from their scores.

    - ``pow``: proportional to ``|score| ** pow``: confident rewards, far from 0 either way,
      are the reliable ones (uniform if every score is 0);
    - ``max_min``: uniform over the samples with the batch's highest or lowest score;
    - ``max_random``: half the mass uniform over the highest-scored samples, half uniform over
      all the others (uniform when all scores are equal).
    """
    if mode not in _PF_PPO_WEIGHTS:
        raise ValueError(f"unknown PF-PPO mode {mode!r} (algorithm.pf_ppo); choose one of: {', '.join(PF_PPO_MODES)}")
    return _PF_PPO_WEIGHTS[mode](scores, pow)


def pf_ppo_resample(
    scores: torch.Tensor, mode: str, generator: Optional[torch.Generator] = None, pow: float = 2.0
) -> torch.Tensor:
    """[B] sample indices drawn with replacement from ``pf_ppo_weights``, in ascending order.

    Training on ``batch[indices]`` filters the batch by reward reliability while keeping its
    size (the micro-batching is unchanged); sorting keeps a group's samples together.
    """
    weights = pf_ppo_weights(scores, mode, pow=pow)
    drawn = torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
    return torch.sort(drawn).values


# ---------------------------------------------------------------- KL in the reward


def kl_in_reward(
    token_rewards: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rewards - coef * KL per token, each response's token-mean KL [B]).

    The KL here is part of the reward, a constant to the policy gradient, so it is computed
    from detached log-probs. Padding comes back as 0.
    """
    kl = kl_penalty(log_prob.detach(), ref_log_prob.detach(), kind)
    kl = zero_padding(kl, response_mask)
    new_rewards = zero_padding(token_rewards - coef * kl, response_mask)
    return new_rewards, masked_mean(kl, response_mask, dim=-1)


class AdaptiveKLController:
    """The in-reward KL coefficient steered towards a target KL (Ziegler et al., 2019, "Fine-Tuning
    Language Models from Human Preferences"; verl's ``AdaptiveKLController``).

    ``value`` is the coefficient the reward's KL penalty reads. After each step,
    ``update(current_kl, n_steps)`` multiplies it by
    ``1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``: above the target it
    grows, below it shrinks, by at most 20% per ``horizon`` samples. verl passes the step's
    batch size as ``n_steps`` and, as ``current_kl``, the batch mean of each sequence's mean
    token KL under the in-reward estimator. Unlike verl, a non-finite ``current_kl`` is a
    ValueError rather than a coefficient turned NaN for the rest of the run.
    """

    def __init__(self, init_kl_coef: float, *, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0 (verl's default: 0.001)")
        if target_kl <= 0:
            raise ValueError(f"target_kl={target_kl} must be > 0 (verl's default: 0.1)")
        if horizon <= 0:
            raise ValueError(f"horizon={horizon} must be > 0 (verl's default: 10000 samples)")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move ``value`` after a step that measured ``current_kl`` over ``n_steps`` samples;
        returns the new value."""
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl={current_kl} is not finite: the KL coefficient is left at {self.value}")
        if n_steps < 0:
            raise ValueError(f"n_steps={n_steps} must be >= 0 (the step's number of samples)")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


KL_COEF_NEXT = "actor/reward_kl_coef_next"
"""The step metric holding the coefficient the KL controller left for the next step."""


class FixedKLController:
    """The in-reward KL coefficient held where the config set it (verl's ``FixedKLController``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


def kl_controller(kl_coef: float, target_kl: float | None, horizon: int, history: list[dict]):
    """The in-reward KL coefficient's controller, resumed from a run's step ``history``: an
    adaptive one (``target_kl`` set) continues from the coefficient its last step left."""
    if target_kl is None:
        return FixedKLController(kl_coef)
    controller = AdaptiveKLController(kl_coef, target_kl=target_kl, horizon=horizon)
    left = [h[KL_COEF_NEXT] for h in history if KL_COEF_NEXT in h]
    if left:
        controller.value = float(left[-1])
    return controller
