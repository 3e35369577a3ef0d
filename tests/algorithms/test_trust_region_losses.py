"""SAPO (soft gate), GMPO (geometric-mean sequence ratio) and DPPO (divergence trust region)
against hand-computed cases and verl's formulas, restated in the tests."""

import math

import pytest
import torch

from hybridflow.algorithms.losses import agg_loss, compute_policy_loss, get_policy_loss, policy_loss_names
from hybridflow.config import AlgorithmConfig

ATOL = 1e-6
F64 = torch.float64


def make_cfg(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", **overrides)


def close(actual, expected, rtol=0.0):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=rtol)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def random_batch(seed: int, spread: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen, dtype=F64) - 0.3
    log_prob = old + spread * torch.randn(4, 6, generator=gen, dtype=F64)
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([6, 3, 1, 5]).unsqueeze(1)
    return old, log_prob, adv, mask


# ---------------------------------------------------------------- SAPO


def test_sapo_by_hand():
    # token 0: A = 1, r = 1.5, tau_pos 1: gate 4 sigmoid(0.5) -> loss -4 sigmoid(0.5);
    #   gradient -A * 4 s (1 - s) r (d gate / d logp = 4 / tau * tau s (1 - s) * r)
    # token 1: A = -1, r = 0.5, tau_neg 1.05: loss +4 / 1.05 * sigmoid(-0.525)
    # token 2: A = 0 (tau_neg): loss 0, gradient 0
    old = torch.tensor([[-1.0, -1.0, -2.0]], dtype=F64)
    log_prob = (old + torch.tensor([[math.log(1.5), math.log(0.5), 0.3]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 0.0]], dtype=F64)
    loss_mat, metrics = get_policy_loss("sapo")(old, log_prob, adv, torch.ones(1, 3), make_cfg())
    s0, s1 = sigmoid(0.5), sigmoid(-0.525)
    close(loss_mat, [[-4 * s0, 4 / 1.05 * s1, 0.0]])
    close(metrics["clipfrac"], 0.0)
    loss_mat.sum().backward()
    close(log_prob.grad, [[-4 * s0 * (1 - s0) * 1.5, 4 * s1 * (1 - s1) * 0.5, 0.0]])


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_on_policy_gradient_is_the_policy_gradient_for_any_temperature(tau_pos, tau_neg):
    # f'(1) = 4 / tau * tau / 4 = 1: at r = 1 every token's gradient is -A
    old, _, adv, mask = random_batch(0)
    log_prob = old.clone().requires_grad_()
    cfg = make_cfg(sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    loss_mat, _ = get_policy_loss("sapo")(old, log_prob, adv, mask, cfg)
    loss_mat.sum().backward()
    close(log_prob.grad, -adv * mask)


def test_sapo_gate_saturates_at_extreme_ratios():
    # log r = +/-50, clamped at 20: the gate is 4 / tau (r -> inf) or 4 / tau * sigmoid(-tau) (r -> 0),
    # the gradient vanishes; all finite in float32
    old = torch.tensor([[-60.0, -1.0]])
    log_prob = torch.tensor([[-10.0, -51.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0]])
    loss_mat, _ = get_policy_loss("sapo")(old, log_prob, adv, torch.ones(1, 2), make_cfg())
    close(loss_mat, [[-4.0, -2 * 4 * sigmoid(-1.0)]])
    loss_mat.sum().backward()
    assert torch.isfinite(log_prob.grad).all() and log_prob.grad.abs().max() < 1e-6


def test_sapo_gradient_matches_finite_differences():
    old, log_prob, adv, mask = random_batch(1, spread=0.5)

    def loss(lp):
        return compute_policy_loss("sapo", old, lp, adv, mask, make_cfg(), loss_agg_mode="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(loss, (log_prob.requires_grad_(),))


def test_sapo_temperatures_must_be_positive():
    with pytest.raises(ValueError, match="sapo_tau_neg=0.0 must be > 0"):
        make_cfg(sapo_tau_neg=0.0)


# ---------------------------------------------------------------- GMPO


def verl_geo_mean(old, log_prob, adv, mask, low=0.2, high=0.2):
    """verl's compute_policy_loss_geo_mean, restated: the mean over rows of -mean(A) * exp(mean
    of the sign-pessimistic clipped log-ratio)."""
    log_ratio = log_prob - old
    sign = torch.sign(adv)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * torch.clamp(log_ratio, -low, high))
    lengths = mask.sum(-1)
    ratio = torch.exp((pessimistic * mask).sum(-1) / (lengths + 1e-8))
    return torch.mean(-(adv * mask).sum(-1) / (lengths + 1e-8) * ratio)


def test_gmpo_by_hand():
    # row 0: A = 1, log r = 0.3, -0.5 -> clipped to [-0.2, 0.2] on the pessimistic side only:
    #   min(0.3, 0.2) = 0.2, min(-0.5, -0.2) = -0.5 -> mean -0.15: L0 = -e^-0.15;
    #   gradient: token 0 sits on the clip (0), token 1 gets -A e^-0.15 / 2
    # row 1: A = -2, log r = 0.5 -> sign -1: -min(-0.5, -0.2) = 0.5: L1 = 2 e^0.5, gradient 2 e^0.5
    # row 2: A = 0: L2 = 0
    old = torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-1.0, 0.0]], dtype=F64)
    log_prob = (old + torch.tensor([[0.3, -0.5], [0.5, 0.0], [0.1, 0.0]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    loss_mat, metrics = get_policy_loss("gmpo")(old, log_prob, adv, mask, make_cfg())
    l0, l1 = -math.exp(-0.15), 2 * math.exp(0.5)
    close(loss_mat, [[l0, l0], [l1, 0.0], [0.0, 0.0]])  # every token carries its sequence's loss
    close(metrics["clipfrac"], 2 / 4)  # row 0: both log-ratios outside [-0.2, 0.2], A > 0
    close(metrics["clipfrac_lower"], 1 / 4)  # row 1, A < 0
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean")
    close(loss, (l0 + l1) / 3)
    torch.testing.assert_close(loss, verl_geo_mean(old, log_prob, adv, mask))
    loss.backward()
    close(log_prob.grad, [[0.0, -math.exp(-0.15) / 2 / 3], [2 * math.exp(0.5) / 3, 0.0], [0.0, 0.0]])


def test_gmpo_value_and_gradient_equal_verls_sequence_objective():
    old, log_prob, _, mask = random_batch(2, spread=0.3)
    adv = torch.tensor([1.5, -0.5, 2.0, -1.0], dtype=F64).unsqueeze(-1).expand(4, 6)  # one per sequence
    cfg = make_cfg(clip_ratio_low=0.2, clip_ratio_high=0.28)
    ours = log_prob.clone().requires_grad_()
    loss, _ = compute_policy_loss("gmpo", old, ours, adv, mask, cfg, loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    theirs = log_prob.clone().requires_grad_()
    expected = verl_geo_mean(old, theirs, adv, mask, low=0.2, high=0.28)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(ours.grad, theirs.grad)


def test_gmpo_gradient_matches_finite_differences_in_every_aggregation():
    # the per-token form carries each sequence's value at every token: finite differences of the
    # aggregated value and autograd agree whatever the aggregation
    old, log_prob, adv, mask = random_batch(3, spread=0.3)
    for mode in ("seq-mean-token-mean", "token-mean"):

        def loss(lp, mode=mode):
            return compute_policy_loss("gmpo", old, lp, adv, mask, make_cfg(), loss_agg_mode=mode)[0]

        assert torch.autograd.gradcheck(loss, (log_prob.clone().requires_grad_(),))


def test_gmpo_extreme_log_ratios():
    # A = -1 with log r = 50: pessimistic side keeps it. Clamped at 20: loss e^20; unclamped: e^50
    # as verl. A = 1 with log r = 50 is clipped at 0.2 either way.
    old = torch.tensor([[-60.0], [-60.0]], dtype=F64)
    log_prob = torch.tensor([[-10.0], [-10.0]], dtype=F64)
    adv = torch.tensor([[-1.0], [1.0]], dtype=F64)
    mask = torch.ones(2, 1)
    clamped, _ = get_policy_loss("gmpo")(old, log_prob, adv, mask, make_cfg())
    close(clamped, [[math.exp(20.0)], [-math.exp(0.2)]], rtol=1e-12)
    unclamped, _ = compute_policy_loss(
        "gmpo", old, log_prob, adv, mask, make_cfg(log_ratio_clamp=None), loss_agg_mode="seq-mean-token-mean"
    )
    torch.testing.assert_close(unclamped, verl_geo_mean(old, log_prob, adv, mask))


def test_gmpo_is_also_registered_under_verls_name():
    assert get_policy_loss("geo_mean") is get_policy_loss("gmpo")


# ---------------------------------------------------------------- DPPO

# (A, p_old, p): a: +1, 0.5 -> 0.8 (TV +0.3 beyond 0.2: outside)  b: +1, 0.5 -> 0.6 (inside)
#                c: -1, 0.5 -> 0.2 (TV -0.3: outside)              d: -1, 0.1 -> 0.9 (moved up: inside;
#                r = 9 is truncated at clip_ratio_c = 3)           e: +1, 0.9 -> 0.1 (moved down: inside)
DPPO_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=F64)
DPPO_OLD_P = torch.tensor([[0.5, 0.5, 0.5, 0.1, 0.9]], dtype=F64)
DPPO_P = torch.tensor([[0.8, 0.6, 0.2, 0.9, 0.1]], dtype=F64)


def dppo(name, **cfg):
    log_prob = DPPO_P.log().requires_grad_()
    loss_mat, metrics = get_policy_loss(name)(DPPO_OLD_P.log(), log_prob, DPPO_ADV, torch.ones(1, 5), make_cfg(**cfg))
    loss_mat.sum().backward()
    return loss_mat, metrics, log_prob.grad


def binary_kl(q: float, p: float) -> float:
    return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_by_hand(name):
    # binary KL of a (0.5 -> 0.8) and c (0.5 -> 0.2): 0.2231 > 0.2; of b: 0.0204: the same region
    # as TV at these thresholds. Inside: -A * sg[min(r, 3)] * logp, gradient -A min(r, 3)
    assert binary_kl(0.5, 0.8) > 0.2 and binary_kl(0.5, 0.2) > 0.2 and binary_kl(0.5, 0.6) < 0.2
    loss_mat, metrics, grad = dppo(name)
    r_b, w_d, w_e = 0.6 / 0.5, 3.0, 0.1 / 0.9
    close(loss_mat, [[0.0, -r_b * math.log(0.6), 0.0, w_d * math.log(0.9), -w_e * math.log(0.1)]])
    close(grad, [[0.0, -r_b, 0.0, w_d, -w_e]])
    close(metrics["clipfrac"], 2 / 5)  # a and c outside
    close(metrics["clipfrac_lower"], 1 / 5)  # d inside, weight truncated
    close(metrics["ppo_kl"], -math.log(0.8 / 0.5 * 1.2 * 0.4 * 9 * (1 / 9)) / 5)


def test_dppo_tv_and_kl_part_where_the_divergences_differ():
    # a, c need TV 0.3 / KL 0.223: thresholds 0.25 let TV exclude them and KL keep them
    _, tv, _ = dppo("dppo_tv", clip_ratio_low=0.25, clip_ratio_high=0.25)
    _, kl, _ = dppo("dppo_kl", clip_ratio_low=0.25, clip_ratio_high=0.25)
    close(tv["clipfrac"], 2 / 5)
    close(kl["clipfrac"], 0.0)


def test_dppo_region_is_a_constant_to_the_gradient():
    # moving log_prob by an epsilon never moves the region; the gradient is -A w inside, 0 out
    old, log_prob, adv, mask = random_batch(4, spread=0.4)
    for name in ("dppo_tv", "dppo_kl"):
        leaf = log_prob.clone().requires_grad_()
        cfg = make_cfg(clip_ratio_low=0.05, clip_ratio_high=0.05)
        loss_mat, metrics = get_policy_loss(name)(old, leaf, adv, mask, cfg)
        loss_mat.sum().backward()
        assert 0 < metrics["clipfrac"] < 1
        inside = (loss_mat != 0) | (adv == 0)
        weight = torch.clamp(torch.exp(log_prob - old), max=cfg.clip_ratio_c)
        expected = torch.where(inside & mask, -adv * weight, torch.zeros_like(adv))
        torch.testing.assert_close(leaf.grad, expected)


def test_dppo_extreme_ratio_stays_finite_in_float32():
    old = torch.tensor([[-60.0, -0.1]])
    log_prob = torch.tensor([[-5.0, -80.0]], requires_grad=True)  # log r = +55, -79.9
    loss_mat, metrics = get_policy_loss("dppo_tv")(
        old, log_prob, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), make_cfg()
    )
    loss_mat.sum().backward()
    assert torch.isfinite(loss_mat).all() and torch.isfinite(log_prob.grad).all()
    close(loss_mat, [[3.0 * -5.0, -math.exp(-20.0) * -80.0]])  # weight capped at 3; r clamped at e^-20


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize("name", ["sapo", "gmpo", "geo_mean", "dppo_tv", "dppo_kl"])
def test_plugs_into_the_registry_and_compute_policy_loss(name):
    old, log_prob, adv, mask = random_batch(5)
    assert name in policy_loss_names()
    loss_mat, metrics = get_policy_loss(name)(old, log_prob, adv, mask, make_cfg())
    for mode in ("token-mean", "token-sum", "seq-mean-token-mean"):
        loss, same = compute_policy_loss(name, old, log_prob, adv, mask, make_cfg(), loss_agg_mode=mode)
        torch.testing.assert_close(loss, agg_loss(loss_mat, mask, mode))
        assert same.keys() == metrics.keys()
