"""Losses and their aggregation on tensors small enough to check by hand (numbers derived in comments)."""

import math

import pytest
import torch

from hybridflow.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_parts,
    compute_policy_loss,
    entropy_loss,
    get_policy_loss,
    kl_penalty,
    lm_loss,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss_names,
    register_policy_loss,
    value_loss,
)
from hybridflow.config import AlgorithmConfig

ATOL = 1e-5
NAN = float("nan")
POLICY_LOSSES = [
    "vanilla",
    "gspo",
    "cispo",
    "gpg",
    "reinforce",
    "clip_cov",
    "kl_cov",
    "sapo",
    "gmpo",
    "geo_mean",
    "dppo_tv",
    "dppo_kl",
]


def make_cfg(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", **overrides)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- masked helpers


def test_masked_statistics_ignore_padding():
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, 100.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 2.0)
    close(masked_mean(x, mask, dim=-1), [1.5, 3.0])
    close(masked_var(x, mask), 1.0)  # 1, 2, 3: sample variance 1
    close(masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


# ---------------------------------------------------------------- aggregation

# rows: tokens 1 2 3 | 4 5 | (empty); X = garbage in the padding
X = 1e3
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0, X], [4.0, 5.0, X, X], [X, X, X, X]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 15 / 5),  # 1 + 2 + 3 + 4 + 5 over 5 tokens
        ("token-sum", 15),  # no normaliser at all
        ("seq-mean-token-sum", (6 + 9) / 2),  # the empty row counts for nothing
        ("seq-mean-token-mean", (2 + 4.5) / 2),
        ("seq-mean-token-sum-norm", 15 / (2 * 4)),  # 2 non-empty sequences * budget 4
    ],
)
def test_agg_loss_by_hand(mode, expected):
    close(agg_loss(AGG_LOSS, AGG_MASK, mode, max_response_length=4), expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_of_all_padding_is_zero_not_nan(mode):
    close(agg_loss(AGG_LOSS[2:], AGG_MASK[2:], mode, max_response_length=4), 0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_parts_sum_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 0, 3, 1, 5, 2, 0, 4, 6])
    mask = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
    whole = agg_loss(loss_mat, mask, mode, max_response_length=8)
    numerator, denominator = 0.0, 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7), slice(7, 9)):  # uneven splits
        n, d = agg_parts(loss_mat[rows], mask[rows], mode, max_response_length=8)
        numerator, denominator = numerator + n, denominator + d
    # the contract: numerator / max(denominator, 1) (token-sum's denominators are all 0)
    torch.testing.assert_close(numerator / max(denominator, 1.0), whole, atol=1e-12, rtol=0)
    # averaging the micro-batch losses instead is wrong for this batch: the test can tell
    naive = (
        sum(
            agg_loss(loss_mat[r], mask[r], mode, max_response_length=8)
            for r in (slice(0, 2), slice(2, 3), slice(3, 7), slice(7, 9))
        )
        / 4
    )
    assert abs(naive - whole) > 1e-3


def test_token_sum_is_the_global_token_sum_over_any_split():
    # verl's token-sum: the sum over every masked token of the global batch, however it is split
    # into micro-batches (or ranks); each part's denominator is 0, its numerator its own sum
    gen = torch.Generator().manual_seed(4)
    loss_mat = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 0, 2, 3, 1, 4]).unsqueeze(1)
    total = loss_mat[mask].sum()
    for rows in (slice(0, 1), slice(1, 2), slice(2, 6)):
        numerator, denominator = agg_parts(loss_mat[rows], mask[rows], "token-sum")
        torch.testing.assert_close(numerator, loss_mat[rows][mask[rows]].sum())
        assert denominator == 0
    torch.testing.assert_close(agg_loss(loss_mat, mask, "token-sum"), total)
    # its gradient is 1 on every masked token: no normaliser
    leaf = loss_mat.clone().requires_grad_()
    agg_loss(leaf, mask, "token-sum").backward()
    torch.testing.assert_close(leaf.grad, mask.to(torch.float64))


def test_the_config_accepts_exactly_the_aggregation_modes_there_are():
    from hybridflow.config import LOSS_AGG_MODES as CONFIG_MODES

    assert set(CONFIG_MODES) == set(LOSS_AGG_MODES)


def test_sum_norm_needs_the_budget_and_unknown_modes_list_the_valid_ones():
    with pytest.raises(ValueError, match="max_response_length"):
        agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError) as error:
        agg_loss(AGG_LOSS, AGG_MASK, "sequence-mean")
    assert all(mode in str(error.value) for mode in LOSS_AGG_MODES)


# ---------------------------------------------------------------- vanilla PPO

# clip (0.8, 1.28), dual clip 3. Tokens (A, ratio) -> loss:
#   a (1, 1.5):  max(-1.5, -1.28) = -1.28 clipped     b (1, 0.5): max(-0.5, -0.8) = -0.5
#   c (-1, 0.5): max(0.5, 0.8) = 0.8 clipped          d (-1, 5):  max(5, 1.28) = 5 -> dual bound 3
#   e (2, 1):    -2                                    (padding: garbage)
VANILLA_CFG = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
VANILLA_RATIO = torch.tensor([[1.5, 0.5, 0.5], [5.0, 1.0, 7.0]])
VANILLA_ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, NAN]])
VANILLA_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, NAN]])


def vanilla_inputs():
    log_prob = (OLD + VANILLA_RATIO.log()).requires_grad_()
    return OLD, log_prob, VANILLA_ADV, VANILLA_MASK


def test_vanilla_by_hand():
    old, log_prob, adv, mask = vanilla_inputs()
    loss_mat, metrics = get_policy_loss("vanilla")(old, log_prob, adv, mask, make_cfg(**VANILLA_CFG))
    close(loss_mat, [[-1.28, -0.5, 0.8], [3.0, -2.0, 0.0]])
    close(metrics["clipfrac"], 2 / 5)  # a and c
    close(metrics["clipfrac_lower"], 1 / 5)  # d
    close(metrics["ppo_kl"], -(math.log(1.5) + 2 * math.log(0.5) + math.log(5.0)) / 5)
    # only the unclipped tokens b and e carry a gradient: d(-A r)/d logp = -A r
    loss_mat.sum().backward()
    close(log_prob.grad, [[0.0, -0.5, 0.0], [0.0, -2.0, 0.0]])


def test_compute_policy_loss_aggregates():
    old, log_prob, adv, mask = vanilla_inputs()
    cfg = make_cfg(**VANILLA_CFG)
    loss, _ = compute_policy_loss("vanilla", old, log_prob, adv, mask, cfg, loss_agg_mode="token-mean")
    close(loss, (-1.28 - 0.5 + 0.8 + 3.0 - 2.0) / 5)
    loss, _ = compute_policy_loss("vanilla", old, log_prob, adv, mask, cfg, loss_agg_mode="seq-mean-token-mean")
    close(loss, ((-1.28 - 0.5 + 0.8) / 3 + (3.0 - 2.0) / 2) / 2)


def test_vanilla_at_ratio_one_is_minus_advantage():
    gen = torch.Generator().manual_seed(1)
    log_prob = -torch.rand(3, 4, generator=gen)
    adv = 3 * torch.randn(3, 4, generator=gen)  # large, both signs: no clip may trigger at ratio 1
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss_mat, metrics = get_policy_loss("vanilla")(log_prob.clone(), log_prob, adv, mask, make_cfg())
    close(loss_mat, -adv * mask)
    for key in ("clipfrac", "clipfrac_lower", "ppo_kl"):
        close(metrics[key], 0.0)


# ---------------------------------------------------------------- GSPO, CISPO, GPG, REINFORCE


def test_gspo_uses_one_ratio_per_sequence_with_per_token_gradients():
    # row 0: token log-ratios ln 2, 0 -> sequence ratio exp(ln 2 / 2) = sqrt 2 at both tokens (token
    #   ratios 2 and 1 would give different losses); A = 1, inside (0.8, 1.5): loss -sqrt 2 each,
    #   gradient -A * sqrt 2 per token
    # row 1: one token, ratio 0.5, A = -1: max(0.5, 0.8) = 0.8, clipped, no gradient
    old = torch.tensor([[-1.0, -1.0], [-2.0, NAN]])
    log_prob = (old + torch.tensor([[math.log(2.0), 0.0], [math.log(0.5), 3.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss_mat, metrics = get_policy_loss("gspo")(old, log_prob, adv, mask, make_cfg(clip_ratio_high=0.5))
    root2 = math.sqrt(2.0)
    close(loss_mat, [[-root2, -root2], [0.8, 0.0]])
    close(metrics["clipfrac"], 1 / 3)
    loss_mat.sum().backward()
    close(log_prob.grad, [[-root2, -root2], [0.0, 0.0]])


def test_cispo_by_hand():
    # ratios 2 -> weight min(2, 1.28) = 1.28 (clipped), 0.5 -> 0.5 (no lower clip)
    # log_prob = -1 + ln 2 = -0.306853, -1 + ln 0.5 = -1.693147; A = 1, -2
    # loss = -w A logp = 0.392772, -1.693147; gradient -w A = -1.28, 1.0
    old = torch.tensor([[-1.0, -1.0]])
    log_prob = (old + torch.tensor([[math.log(2.0), math.log(0.5)]])).requires_grad_()
    loss_mat, metrics = get_policy_loss("cispo")(
        old, log_prob, torch.tensor([[1.0, -2.0]]), torch.ones(1, 2), make_cfg(clip_ratio_high=0.28)
    )
    close(loss_mat, [[0.392772, -1.693147]])
    close(metrics["clipfrac"], 0.5)
    loss_mat.sum().backward()
    close(log_prob.grad, [[-1.28, 1.0]])


def test_gpg_is_minus_advantage_times_log_prob():
    # A = 2, -1; logp = -0.5, -2 -> loss 1, -2; gradient -A = -2, 1 (the old log-probs do not matter)
    log_prob = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    loss_mat, metrics = get_policy_loss("gpg")(
        torch.tensor([[-9.0, -9.0]]), log_prob, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), make_cfg()
    )
    close(loss_mat, [[1.0, -2.0]])
    close(metrics["clipfrac"], 0.0)
    close(metrics["ppo_kl"], (-9.0 + 0.5 - 9.0 + 2.0) / 2)
    loss_mat.sum().backward()
    close(log_prob.grad, [[-2.0, 1.0]])


def test_reinforce_is_unclipped_ratio_times_advantage():
    # A = 2, ratio 1.5 (beyond any clip): loss -3, gradient -A r = -3
    log_prob = torch.tensor([[-1.0 + math.log(1.5)]], requires_grad=True)
    loss_mat, _ = get_policy_loss("reinforce")(
        torch.tensor([[-1.0]]), log_prob, torch.tensor([[2.0]]), torch.ones(1, 1), make_cfg()
    )
    close(loss_mat, [[-3.0]])
    loss_mat.sum().backward()
    close(log_prob.grad, [[-3.0]])


# ---------------------------------------------------------------- policy-loss properties


def policy_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    old = -torch.rand(3, 4, generator=gen) - 0.1
    log_prob = old + 0.05 * torch.randn(3, 4, generator=gen)  # near on-policy: most tokens unclipped
    adv = torch.randn(3, 4, generator=gen)
    return old, log_prob, adv, mask


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_gradients_reach_log_prob_and_never_old_log_prob(name):
    old, log_prob, adv, mask = policy_batch()
    old.requires_grad_()
    log_prob.requires_grad_()
    loss, _ = compute_policy_loss(name, old, log_prob, adv, mask, make_cfg(), loss_agg_mode="token-mean")
    loss.backward()
    assert old.grad is None
    assert torch.isfinite(log_prob.grad).all()
    assert (log_prob.grad[mask.bool()] != 0).any()
    assert (log_prob.grad[~mask.bool()] == 0).all()


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_padding_never_changes_a_policy_loss(name):
    old, log_prob, adv, mask = policy_batch(seed=3)
    padding = mask == 0
    results = []
    for fill in (0.0, NAN, 1e4):
        lp = log_prob.masked_fill(padding, fill).requires_grad_()
        dirty_old, dirty_adv = old.masked_fill(padding, fill), adv.masked_fill(padding, fill)
        loss_mat, metrics = get_policy_loss(name)(dirty_old, lp, dirty_adv, mask, make_cfg())
        loss = agg_loss(loss_mat, mask, "seq-mean-token-mean")
        loss.backward()
        results.append((loss_mat.detach(), metrics, lp.grad))
    for loss_mat, metrics, grad in results[1:]:
        torch.testing.assert_close(loss_mat, results[0][0])
        torch.testing.assert_close(grad, results[0][2])
        for key, value in metrics.items():
            torch.testing.assert_close(value, results[0][1][key])


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_every_policy_loss_reports_clipfrac_and_ppo_kl(name):
    old, log_prob, adv, mask = policy_batch()
    _, metrics = get_policy_loss(name)(old, log_prob, adv, mask, make_cfg())
    assert {"clipfrac", "ppo_kl"} <= set(metrics)
    close(metrics["ppo_kl"], masked_mean(old - log_prob, mask))
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_policy_loss_registry():
    with pytest.raises(ValueError) as error:
        get_policy_loss("ppo2")
    assert all(name in str(error.value) for name in POLICY_LOSSES)
    assert set(POLICY_LOSSES) <= set(policy_loss_names())
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *args: None)


# ---------------------------------------------------------------- KL


def test_kl_penalties_by_hand():
    # logp - ref = 1, -1; k3 uses ref - logp = -1, 1: exp(-1) + 1 - 1 = 0.367879, exp(1) - 1 - 1 = 0.718282
    log_prob, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    close(kl_penalty(log_prob, ref, "k1"), [1.0, -1.0])
    close(kl_penalty(log_prob, ref, "abs"), [1.0, 1.0])
    for kind in ("mse", "k2"):
        close(kl_penalty(log_prob, ref, kind), [0.5, 0.5])
    for kind in ("low_var_kl", "k3"):
        close(kl_penalty(log_prob, ref, kind), [0.367879, 0.718282])


def test_low_var_kl_is_clamped_at_ten_with_finite_gradients():
    log_prob = torch.tensor([-50.0, 0.0], requires_grad=True)  # ref - logp = 50: exp would be 5e21
    kl = kl_penalty(log_prob, torch.tensor([0.0, 0.0]), "k3")
    close(kl, [10.0, 0.0])
    kl.sum().backward()
    assert torch.isfinite(log_prob.grad).all()


STRAIGHT_THROUGH = [("k1+", "k1"), ("abs+", "abs"), ("low_var_kl+", "low_var_kl"), ("k3+", "k3")]


@pytest.mark.parametrize("kind, base", STRAIGHT_THROUGH)
def test_straight_through_kl_has_its_estimators_value_and_the_gradient_of_k2(kind, base):
    # logp - ref = 1, -1, 0.3, 50 (k3 clamped at 10 there): the value is the base estimator's,
    # the gradient (logp - ref) * d logp is k2's whatever the clamp
    ref = torch.tensor([-2.0, -1.0, -1.0, -60.0], dtype=torch.float64)
    log_prob = (ref + torch.tensor([1.0, -1.0, 0.3, 50.0], dtype=torch.float64)).requires_grad_()
    kl = kl_penalty(log_prob, ref, kind)
    torch.testing.assert_close(kl, kl_penalty(log_prob, ref, base))
    kl.sum().backward()
    torch.testing.assert_close(log_prob.grad, (log_prob - ref).detach())


@pytest.mark.parametrize("kind", ["k1+", "low_var_kl+"])
def test_straight_through_kl_gradient_matches_finite_differences_of_k2(kind):
    ref = torch.tensor([[-1.0, -2.5, -0.2]], dtype=torch.float64)
    log_prob = torch.tensor([[-1.4, -2.0, -0.9]], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(log_prob, ref, kind).sum()
    (grad,) = torch.autograd.grad(kl, log_prob)

    def k2(lp):
        return kl_penalty(lp, ref, "k2").sum()

    assert torch.autograd.gradcheck(k2, (log_prob,))
    torch.testing.assert_close(grad, torch.autograd.grad(k2(log_prob), log_prob)[0])


def test_the_config_accepts_exactly_the_kl_kinds_there_are():
    from hybridflow.algorithms.losses import kl_penalty_names
    from hybridflow.config import KL_TYPES

    assert set(KL_TYPES) == set(kl_penalty_names())


def test_unknown_kl_kind_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    assert all(kind in str(error.value) for kind in ("k1", "abs", "mse", "k2", "low_var_kl", "k3"))


# ---------------------------------------------------------------- value, entropy, LM


def test_value_loss_by_hand():
    # clip 0.5 around old = 0:
    #   v 1.0, R 1: clipped v 0.5 -> max(0, 0.25) / 2 = 0.125 (clipped term larger, no gradient)
    #   v 0.2, R 1: inside the clip -> 0.64 / 2 = 0.32, gradient (v - R) / 3 = -0.8 / 3
    #   v 2.0, R 0: clipped v 0.5 -> max(4, 0.25) / 2 = 2.0, gradient 2 / 3
    values = torch.tensor([[1.0, 0.2, 2.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, NAN]])
    returns = torch.tensor([[1.0, 1.0, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5, loss_agg_mode="token-mean")
    close(loss, (0.125 + 0.32 + 2.0) / 3)
    close(metrics["vf_clipfrac"], 1 / 3)
    loss.backward()
    close(values.grad, [[0.0, -0.8 / 3, 2.0 / 3, 0.0]])


def test_entropy_loss_aggregates():
    entropy = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(entropy_loss(entropy, mask, "token-mean"), 2.0)
    close(entropy_loss(entropy, mask, "seq-mean-token-mean"), (1.5 + 3.0) / 2)


def test_lm_loss_covers_positive_samples_only():
    # positive rows 0 and 2: NLL tokens 1, 2 | 5 -> token-mean 8 / 3, seq-mean-token-mean (1.5 + 5) / 2
    log_prob = torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, NAN]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    positive = torch.tensor([True, False, True])
    close(lm_loss(log_prob, mask, positive, "token-mean"), 8 / 3)
    close(lm_loss(log_prob, mask, positive, "seq-mean-token-mean"), 3.25)
    close(lm_loss(log_prob, mask, torch.zeros(3, dtype=torch.bool), "token-mean"), 0.0)
