"""Clip-Cov and KL-Cov (covariance-selected tokens) against hand-computed cases and verl's formulas."""

import math

import pytest
import torch

from hybridflow.algorithms.losses import agg_loss, compute_policy_loss, get_policy_loss, masked_mean
from hybridflow.config import AlgorithmConfig

ATOL = 1e-6
NAN = float("nan")


def make_cfg(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", **overrides)


def close(actual, expected, rtol=0.0):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=rtol)


# One row, four tokens. logp = -1, -3, -1, -3 (mean -2, centred +1, -1, +1, -1) and
# A = 2, -2, 4, 0 (mean 1, centred 1, -3, 3, -1): covariance terms 1, 3, 3, 1.
# With clip_cov_lb = 1 (strict) and ub = 5 the candidates are tokens 1 and 2.
LOGP = torch.tensor([[-1.0, -3.0, -1.0, -3.0]], dtype=torch.float64)
ADV = torch.tensor([[2.0, -2.0, 4.0, 0.0]], dtype=torch.float64)
MASK = torch.ones(1, 4)


def clip_cov(old, log_prob, **cfg):
    return get_policy_loss("clip_cov")(old, log_prob, ADV, MASK, make_cfg(**cfg))


# ---------------------------------------------------------------- clip_cov


def test_clip_cov_detaches_every_candidate_when_the_budget_allows():
    # on-policy (ratio 1, nothing clipped): loss -A = -2, 2, -4, 0; ratio 0.5 -> budget
    # int(0.5 * 4) = 2 = both candidates, set to 0 with no gradient
    log_prob = LOGP.clone().requires_grad_()
    loss_mat, metrics = clip_cov(LOGP, log_prob, clip_cov_ratio=0.5)
    close(loss_mat, [[-2.0, 0.0, 0.0, 0.0]])
    close(metrics["clipfrac"], 2 / 4)
    close(metrics["ppo_kl"], 0.0)
    loss_mat.sum().backward()
    close(log_prob.grad, [[-2.0, 0.0, 0.0, 0.0]])  # d(-A r)/d logp = -A r; token 3 has A = 0


def test_clip_cov_never_draws_a_token_ppo_already_clipped():
    # token 2's ratio is 2 (A = 4 > 0): PPO clips it at 1.28 -> loss -5.12, no gradient, and it
    # is no candidate; token 1 alone is drawn
    old = LOGP - torch.tensor([[0.0, 0.0, math.log(2.0), 0.0]], dtype=torch.float64)
    loss_mat, metrics = clip_cov(old, LOGP, clip_cov_ratio=0.5, clip_ratio_high=0.28)
    close(loss_mat, [[-2.0, 0.0, -5.12, 0.0]])
    close(metrics["clipfrac"], 1 / 4)


def test_clip_cov_draws_one_candidate_reproducibly_with_the_default_budget():
    # budget max(int(2e-4 * 4), 1) = 1: one of tokens 1, 2, the same on every call; the seed
    # picks which, and across seeds both come up
    drawn = set()
    for seed in range(16):
        first, _ = clip_cov(LOGP, LOGP, clip_cov_seed=seed)
        again, _ = clip_cov(LOGP, LOGP, clip_cov_seed=seed)
        torch.testing.assert_close(first, again)
        zeroed = (first[0] == 0) & (ADV[0] != 0)
        assert int(zeroed.sum()) == 1
        drawn.add(int(zeroed.nonzero()))
    assert drawn == {1, 2}


def test_clip_cov_draw_depends_on_the_batch_not_only_the_seed():
    # same seed, different old log-probs (still ratio 1 nowhere clipped): the draw is a function
    # of the micro-batch, so over a few batches both candidates come up
    drawn = set()
    for shift in range(12):
        old = LOGP + 1e-3 * shift
        loss_mat, _ = clip_cov(old, old.clone())
        drawn.add(int(((loss_mat[0] == 0) & (ADV[0] != 0)).nonzero()))
    assert drawn == {1, 2}


def test_clip_cov_with_no_candidate_is_ppo_without_dual_clip():
    # all-equal advantages: covariance 0 everywhere, outside (1, 5): nothing is drawn, and the
    # loss is the plain clipped surrogate; a negative-advantage ratio of 5 is not dual-clipped
    old = torch.tensor([[-1.0, -2.0]])
    log_prob = old + torch.tensor([[math.log(5.0), 0.0]])
    loss_mat, metrics = get_policy_loss("clip_cov")(
        old, log_prob, torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2), make_cfg(clip_cov_ratio=1.0)
    )
    close(loss_mat, [[5.0, 1.0]])  # max(5, 1.28) = 5, where vanilla's dual clip would give 3
    close(metrics["clipfrac"], 0.0)


def test_clip_cov_of_a_single_token_group_and_empty_rows():
    # one token: its centred values are 0, covariance 0: nothing drawn. An empty row adds nothing.
    loss_mat, metrics = get_policy_loss("clip_cov")(
        torch.tensor([[-1.0], [NAN]]),
        torch.tensor([[-1.0], [NAN]]),
        torch.tensor([[3.0], [NAN]]),
        torch.tensor([[1], [0]]),
        make_cfg(clip_cov_ratio=1.0),
    )
    close(loss_mat, [[-3.0], [0.0]])
    close(metrics["clipfrac"], 0.0)


def verl_clip_cov_unclamped(old, log_prob, adv, mask, dropped, low=0.2, high=0.2):
    """verl's clip_cov value with the drawn tokens given: max(-A r, -A clip(r)) * (1 - dropped)."""
    ratio = torch.exp(log_prob - old)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    return agg_loss(loss * (~dropped), mask, "token-mean")


def test_clip_cov_extreme_log_ratios_clamped_by_default_and_as_verl_when_unclamped():
    # log r = 30 on a token with A = -1 (no dual clip here): clamped to 20 -> loss e^20, gradient
    # 0 (past the clamp); with log_ratio_clamp=None it is verl's e^30, gradient e^30 / 2.
    # (covariance terms 4.5, 4.5: clip_cov_ub=4 keeps both tokens out of the draw)
    old = torch.tensor([[-40.0, -1.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-10.0, -1.0]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor([[-1.0, 1.0]], dtype=torch.float64), torch.ones(1, 2)
    loss_mat, _ = get_policy_loss("clip_cov")(old, log_prob, adv, mask, make_cfg(clip_cov_ub=4.0))
    close(loss_mat, [[math.exp(20.0), -1.0]], rtol=1e-12)
    loss_mat.sum().backward()
    close(log_prob.grad[0, 0], 0.0)
    log_prob.grad = None
    unclamped = make_cfg(log_ratio_clamp=None, clip_cov_ub=4.0)
    loss, _ = compute_policy_loss("clip_cov", old, log_prob, adv, mask, unclamped, loss_agg_mode="token-mean")
    torch.testing.assert_close(loss, verl_clip_cov_unclamped(old, log_prob, adv, mask, torch.zeros(1, 2).bool()))
    loss.backward()
    torch.testing.assert_close(log_prob.grad[0, 0], torch.tensor(math.exp(30.0) / 2, dtype=torch.float64))


def test_clip_cov_gradient_matches_finite_differences():
    # the draw depends only on constants (old log-probs, advantages), so the loss is a fixed,
    # piecewise smooth function of log_prob: gradcheck holds away from the clip boundaries
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 6, generator=gen, dtype=torch.float64) - 0.5
    log_prob = (old + 0.05 * torch.randn(3, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = 2 * torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([6, 4, 2]).unsqueeze(1)
    cfg = make_cfg(clip_cov_ratio=0.2, clip_cov_lb=0.0)
    dropped = get_policy_loss("clip_cov")(old, log_prob, adv, mask, cfg)[1]["clipfrac"]
    assert dropped > 0  # the check covers a detached token

    def loss(lp):
        return compute_policy_loss("clip_cov", old, lp, adv, mask, cfg, loss_agg_mode="token-mean")[0]

    assert torch.autograd.gradcheck(loss, (log_prob,))


# ---------------------------------------------------------------- kl_cov

# logp as above, A = 2, -2, 5, -1 (mean 1, centred 1, -3, 4, -2): covariance 1, 3, 4, 2.
# log r = 0.1, -0.2, 0.3, 0 (old = logp - log r).
KL_ADV = torch.tensor([[2.0, -2.0, 5.0, -1.0]], dtype=torch.float64)
KL_LOG_RATIO = torch.tensor([[0.1, -0.2, 0.3, 0.0]], dtype=torch.float64)
R = [math.exp(x) for x in (0.1, -0.2, 0.3, 0.0)]  # the ratios


def kl_cov(log_prob, **cfg):
    return get_policy_loss("kl_cov")(LOGP - KL_LOG_RATIO, log_prob, KL_ADV, MASK, make_cfg(**cfg))


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    # kl_cov_ratio 0.5: budget 2 -> tokens 2 (cov 4) and 1 (cov 3) get + 0.1 * |log r|;
    # the rest is the unclipped -A r
    log_prob = LOGP.clone().requires_grad_()
    loss_mat, metrics = kl_cov(log_prob, kl_cov_ratio=0.5, ppo_kl_coef=0.1)
    r = R
    close(loss_mat, [[-2 * r[0], 2 * r[1] + 0.1 * 0.2, -5 * r[2] + 0.1 * 0.3, 1.0]])
    close(metrics["clipfrac"], 2 / 4)
    close(metrics["ppo_kl"], -(0.1 - 0.2 + 0.3) / 4)
    close(metrics["ppo_kl_abs"], (0.1 + 0.2 + 0.3) / 4)  # what verl reports as ppo_kl for kl_cov
    loss_mat.sum().backward()
    # -A r, plus coef * sign(log r) on the penalised tokens
    close(log_prob.grad, [[-2 * r[0], 2 * r[1] - 0.1, -5 * r[2] + 0.1, r[3]]])


def test_kl_cov_default_budget_is_one_token():
    loss_mat, metrics = kl_cov(LOGP)  # int(2e-4 * 4) = 0 -> at least 1: token 2
    r = R
    close(loss_mat[0, 2], -5 * r[2] + 0.1 * 0.3)
    close(metrics["clipfrac"], 1 / 4)


def test_kl_cov_with_all_equal_advantages_breaks_ties_by_position():
    # covariance 0 everywhere: the top-2 are the first two masked tokens, row-major
    adv = torch.ones(2, 3)
    old = torch.zeros(2, 3) - 1.0
    log_prob = old + 0.5
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    loss_mat, metrics = get_policy_loss("kl_cov")(old, log_prob, adv, mask, make_cfg(kl_cov_ratio=0.4, ppo_kl_coef=1.0))
    r = math.exp(0.5)
    close(loss_mat, [[0.0, -r + 0.5, -r + 0.5], [-r, -r, -r]])
    close(metrics["clipfrac"], 2 / 5)


def test_kl_cov_of_nothing_masked_is_zero():
    loss_mat, metrics = get_policy_loss("kl_cov")(
        torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2), make_cfg()
    )
    close(loss_mat, [[0.0, 0.0]])
    close(metrics["clipfrac"], 0.0)


def test_kl_cov_extreme_log_ratio_as_verl_when_unclamped():
    # log r = 30, A = -1: -A r = e^30 plus, if penalised, 0.1 * 30; clamped by default at 20
    old = torch.tensor([[-40.0, -1.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-10.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    # covariance: centred A = -1, 1; centred logp = -4.5, 4.5 -> 4.5, 4.5: tie, token 0 is first
    unclamped, _ = get_policy_loss("kl_cov")(old, log_prob, adv, torch.ones(1, 2), make_cfg(log_ratio_clamp=None))
    close(unclamped, [[math.exp(30.0) + 3.0, -1.0]], rtol=1e-12)
    clamped, _ = get_policy_loss("kl_cov")(old, log_prob, adv, torch.ones(1, 2), make_cfg())
    close(clamped, [[math.exp(20.0) + 2.0, -1.0]], rtol=1e-12)


def test_kl_cov_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(6)
    old = -torch.rand(3, 5, generator=gen, dtype=torch.float64) - 0.5
    log_prob = (old + 0.1 * torch.randn(3, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 3, 4]).unsqueeze(1)
    cfg = make_cfg(kl_cov_ratio=0.3, ppo_kl_coef=0.5)
    for mode in ("token-mean", "seq-mean-token-mean"):

        def loss(lp, mode=mode):
            return compute_policy_loss("kl_cov", old, lp, adv, mask, cfg, loss_agg_mode=mode)[0]

        assert torch.autograd.gradcheck(loss, (log_prob,))


def verl_kl_cov(old, log_prob, adv, mask, ratio, coef):
    """verl's compute_policy_loss_kl_cov, restated from its formula (token-mean)."""
    valid = mask.bool()
    log_ratio = log_prob - old
    loss = -adv * log_ratio.exp()
    cov = (adv[valid] - adv[valid].mean()) * (log_prob[valid] - log_prob[valid].mean())
    top = torch.topk(cov, max(1, int(cov.numel() * ratio))).indices
    flat = valid.flatten().nonzero().squeeze(-1)[top]
    penalty = torch.zeros_like(loss).flatten()
    penalty[flat] = coef * log_ratio.abs().flatten()[flat]
    return masked_mean(loss + penalty.view_as(loss), mask), masked_mean(log_ratio.abs(), mask)


def test_kl_cov_matches_verls_formula_on_a_random_batch():
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(4, 8, generator=gen, dtype=torch.float64) - 0.2
    log_prob = old + 0.2 * torch.randn(4, 8, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    mask = torch.arange(8).unsqueeze(0) < torch.tensor([8, 5, 1, 7]).unsqueeze(1)
    cfg = make_cfg(kl_cov_ratio=0.1, ppo_kl_coef=0.1)
    loss, metrics = compute_policy_loss("kl_cov", old, log_prob, adv, mask, cfg, loss_agg_mode="token-mean")
    expected, abs_kl = verl_kl_cov(old, log_prob, adv, mask, 0.1, 0.1)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["ppo_kl_abs"], abs_kl)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_cov_losses_plug_into_compute_policy_loss(name):
    loss, metrics = compute_policy_loss(
        name, LOGP - KL_LOG_RATIO, LOGP, KL_ADV, MASK, make_cfg(), loss_agg_mode="seq-mean-token-mean"
    )
    loss_mat, same = get_policy_loss(name)(LOGP - KL_LOG_RATIO, LOGP, KL_ADV, MASK, make_cfg())
    torch.testing.assert_close(loss, agg_loss(loss_mat, MASK, "seq-mean-token-mean"))
    assert metrics.keys() == same.keys()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("clip_cov_ratio", 0.0, "clip_cov_ratio=0.0 must be in (0, 1]"),
        ("kl_cov_ratio", 1.5, "kl_cov_ratio=1.5 must be in (0, 1]"),
        ("clip_cov_lb", 5.0, "clip_cov_lb=5.0 must be below clip_cov_ub=5.0"),
        ("ppo_kl_coef", -0.1, "ppo_kl_coef=-0.1 must be >= 0"),
    ],
)
def test_cov_knobs_are_validated(key, value, message):
    with pytest.raises(ValueError) as error:
        make_cfg(**{key: value})
    assert message in str(error.value)
