"""Reward shaping and sample selection on hand-sized inputs."""

import pytest
import torch

from hybridflow.algorithms.shaping import (
    KL_COEF_NEXT,
    PF_PPO_MODES,
    AdaptiveKLController,
    FixedKLController,
    filter_groups,
    kl_controller,
    kl_in_reward,
    overlong_penalty,
    pf_ppo_resample,
    pf_ppo_weights,
)

NAN = float("nan")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- overlong penalty


def test_overlong_penalty_by_hand():
    # budget 10, buffer 4: free up to 6 tokens, then -(length - 6) / 4 * factor, floored at -factor
    lengths = torch.tensor([5, 6, 8, 10, 12])
    close(
        overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1.0),
        [0.0, 0.0, -0.5, -1.0, -1.0],
    )
    close(
        overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=2.0),
        [0.0, 0.0, -1.0, -2.0, -2.0],
    )


def test_overlong_penalty_off_and_bad_buffer():
    close(overlong_penalty(torch.tensor([3, 10]), max_response_length=10, buffer_len=0, penalty_factor=1.0), [0.0, 0.0])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([3]), max_response_length=10, buffer_len=11, penalty_factor=1.0)


# ---------------------------------------------------------------- dynamic sampling


def test_filter_groups_drops_uniform_and_lone_groups():
    # group 2 (1, 0) kept; 1 (0, 0) dropped; 3 alone dropped; 4 (1, 1) dropped; 5 (1, 1.5) kept
    index = torch.tensor([2, 1, 2, 1, 3, 4, 4, 5, 5])
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.5])
    assert filter_groups(scores, index).tolist() == [True, False, True, False, False, False, False, True, True]


# ---------------------------------------------------------------- PF-PPO


def test_pf_ppo_pow_weights():
    # |1|^2, |-2|^2, 0, 1 -> 1, 4, 0, 1 over 6
    close(pf_ppo_weights(torch.tensor([1.0, -2.0, 0.0, 1.0]), "pow", pow=2.0), [1 / 6, 4 / 6, 0.0, 1 / 6])
    close(pf_ppo_weights(torch.tensor([1.0, -2.0, 0.0, 1.0]), "pow", pow=1.0), [0.25, 0.5, 0.0, 0.25])
    close(pf_ppo_weights(torch.zeros(4), "pow"), [0.25] * 4)  # no preference: uniform


def test_pf_ppo_max_min_weights():
    # max 1 (samples 0, 3) and min -2 (sample 1) share the mass; 0 is dropped
    close(pf_ppo_weights(torch.tensor([1.0, -2.0, 0.0, 1.0]), "max_min"), [1 / 3, 1 / 3, 0.0, 1 / 3])
    close(pf_ppo_weights(torch.ones(3), "max_min"), [1 / 3] * 3)


def test_pf_ppo_max_random_weights():
    # the best sample gets half the mass, the other three share the rest
    close(pf_ppo_weights(torch.tensor([3.0, 1.0, 0.0, 1.0]), "max_random"), [0.5, 1 / 6, 1 / 6, 1 / 6])
    close(pf_ppo_weights(torch.tensor([2.0, 2.0, 0.0, 0.0]), "max_random"), [0.25] * 4)
    close(pf_ppo_weights(torch.ones(2), "max_random"), [0.5, 0.5])


@pytest.mark.parametrize("mode", PF_PPO_MODES)
def test_pf_ppo_resample_draws_from_the_weights_reproducibly(mode):
    scores = torch.tensor([1.0, -2.0, 0.0, 1.0, 0.5, -2.0])
    first = pf_ppo_resample(scores, mode, torch.Generator().manual_seed(0))
    second = pf_ppo_resample(scores, mode, torch.Generator().manual_seed(0))
    assert first.dtype == torch.long and first.shape == (6,)
    assert torch.equal(first, second)
    assert torch.equal(first, first.sort().values)
    support = pf_ppo_weights(scores, mode) > 0
    assert support[first].all()


def test_pf_ppo_resample_frequencies_follow_the_weights():
    scores = torch.zeros(4000)
    scores[0] = 1.0  # max_random: sample 0 should take about half the draws
    drawn = pf_ppo_resample(scores, "max_random", torch.Generator().manual_seed(0))
    assert 0.45 < (drawn == 0).float().mean() < 0.55


def test_pf_ppo_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        pf_ppo_weights(torch.ones(2), "best_worst")
    assert all(mode in str(error.value) for mode in ("pow", "max_min", "max_random"))


# ---------------------------------------------------------------- KL in the reward


def test_kl_in_reward_by_hand():
    # k1 KL per token 0.1 0.2 0.3 | 0.4 0.5 (pad); coef 0.5 subtracts half of it; per-response
    # means 0.6 / 3 and 0.9 / 2
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]])
    ref = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, NAN]])
    log_prob = (ref + torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    new_rewards, kl_mean = kl_in_reward(rewards, log_prob, ref, mask, 0.5, "k1")
    close(new_rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])
    close(kl_mean, [0.2, 0.45])
    assert not new_rewards.requires_grad  # the KL reward is a constant to the policy gradient


# ---------------------------------------------------------------- adaptive KL coefficient


@pytest.mark.claim("adaptive-kl-reward")
def test_adaptive_kl_controller_by_hand():
    # target 0.1, horizon 100: KL 0.11 -> error 0.1, over 10 samples x (1 + 0.1 * 10 / 100) = 1.01;
    # KL 1.0 -> error clipped to 0.2: x 1.02; KL 0.05 -> error -0.5 clipped to -0.2: x 0.98
    controller = AdaptiveKLController(0.5, target_kl=0.1, horizon=100)
    assert controller.value == 0.5
    assert controller.update(0.11, 10) == pytest.approx(0.505)
    assert controller.update(1.0, 10) == pytest.approx(0.505 * 1.02)
    assert controller.update(0.05, 10) == pytest.approx(0.505 * 1.02 * 0.98)
    assert controller.value == pytest.approx(0.505 * 1.02 * 0.98)


def test_adaptive_kl_controller_holds_at_the_target_and_moves_towards_it():
    controller = AdaptiveKLController(0.2, target_kl=0.1, horizon=1000)
    controller.update(0.1, 256)
    assert controller.value == pytest.approx(0.2)  # at the target: unchanged
    controller.update(0.1, 0)
    assert controller.value == pytest.approx(0.2)  # no samples: unchanged
    for _ in range(50):  # KL above the target raises the coefficient, by at most 20% per horizon
        controller.update(0.5, 100)
    assert controller.value == pytest.approx(0.2 * 1.02**50)
    starting_at_zero = AdaptiveKLController(0.0, target_kl=0.1, horizon=10)
    assert starting_at_zero.update(5.0, 10) == 0.0  # multiplicative: 0 stays 0, as in verl


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(init_kl_coef=-0.1, target_kl=0.1, horizon=10), "init_kl_coef=-0.1 must be >= 0"),
        (dict(init_kl_coef=0.1, target_kl=0.0, horizon=10), "target_kl=0.0 must be > 0"),
        (dict(init_kl_coef=0.1, target_kl=0.1, horizon=0), "horizon=0 must be > 0"),
    ],
)
def test_adaptive_kl_controller_rejects_bad_settings(kwargs, message):
    init = kwargs.pop("init_kl_coef")
    with pytest.raises(ValueError, match=message):
        AdaptiveKLController(init, **kwargs)


def test_adaptive_kl_controller_refuses_a_non_finite_kl_and_keeps_its_value():
    controller = AdaptiveKLController(0.3, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="not finite"):
        controller.update(NAN, 4)
    assert controller.value == 0.3


@pytest.mark.claim("adaptive-kl-reward")
def test_the_kl_controller_resumes_from_the_coefficient_the_last_step_left():
    history = [{"step": 1, KL_COEF_NEXT: 0.0105}, {"step": 2}, {"step": 3, KL_COEF_NEXT: 0.011}]
    resumed = kl_controller(0.01, 0.1, 100, history)
    assert isinstance(resumed, AdaptiveKLController) and resumed.value == 0.011
    fresh = kl_controller(0.01, 0.1, 100, [])
    assert fresh.value == 0.01 and fresh.update(0.2, 10) == pytest.approx(0.01 * 1.02)
    # a fixed coefficient ignores both the history and the measured KL
    fixed = kl_controller(0.01, None, 100, history)
    assert isinstance(fixed, FixedKLController) and fixed.update(5.0, 10) == 0.01
