"""Advantage estimators on batches small enough to compute by hand (numbers derived in comments)."""

import pytest
import torch

from hybridflow.algorithms.estimators import (
    estimator_names,
    get_estimator,
    group_all_equal,
    group_mean_std,
    register_estimator,
    return_to_go,
    scores_to_token_rewards,
    sequence_scores,
)
from hybridflow.config import AlgorithmConfig

ATOL = 1e-4


def make_cfg(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", **overrides)


def run(name, rewards, mask, *, index=None, values=None, baseline=None, **cfg):
    index = torch.zeros(rewards.shape[0], dtype=torch.long) if index is None else index
    return get_estimator(name)(rewards, mask, index=index, cfg=make_cfg(**cfg), values=values, baseline=baseline)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=0)


def whiten_flat(values):
    """Reference whitening of a plain list: (x - mean) / sample std."""
    v = torch.tensor(values)
    return (v - v.mean()) / v.std()


# ---------------------------------------------------------------- helpers


def test_scores_go_on_the_last_response_token_and_nowhere_for_an_empty_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    close(rewards, [[0, 0, 1, 0], [0, 2, 0, 0], [0, 0, 0, 0]])


def test_sequence_score_sums_masked_token_rewards_only():
    rewards = torch.tensor([[1.0, 3.0, 50.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    close(sequence_scores(rewards, mask), [4.0, 2.0])


def test_group_stats_of_non_contiguous_groups():
    # group 7: scores 1, 0, 2 -> mean 1, sample std sqrt((0 + 1 + 1) / 2) = 1; group 3: 0, 4 -> mean 2,
    # std sqrt(8); group 5 alone -> std 0
    index = torch.tensor([7, 3, 7, 3, 7, 5])
    scores = torch.tensor([1.0, 0.0, 0.0, 4.0, 2.0, 3.0])
    mean, std, size = group_mean_std(scores, index)
    close(mean, [1, 2, 1, 2, 1, 3])
    close(std, [1, 8**0.5, 1, 8**0.5, 1, 0])
    close(size, [3, 2, 3, 2, 3, 1])
    assert group_all_equal(torch.tensor([1.0, 1.0, 2.0, 1.0, 0.5]), torch.tensor([0, 0, 1, 2, 2])).tolist() == [
        True,
        True,
        True,
        False,
        False,
    ]


def test_return_to_go_discounts_and_skips_holes_in_the_mask():
    # gamma 0.5: [1, 0, 2] -> t2 = 2, t1 = 0 + 0.5 * 2 = 1, t0 = 1 + 0.5 * 1 = 1.5
    # [1, (9 masked out), 2] -> t2 = 2, t0 = 1 + 0.5 * 2 = 2: the hole neither adds nor decays
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 9.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    close(return_to_go(rewards, mask, 0.5), [[1.5, 1.0, 2.0], [2.0, 0.0, 2.0]])


# ---------------------------------------------------------------- group estimators

# index / scores shared by grpo, rloo: groups 7 = {0, 2, 4}, 3 = {1, 3}, 5 = {5}
GROUP_INDEX = torch.tensor([7, 3, 7, 3, 7, 5])
GROUP_REWARDS = torch.tensor(
    [  # sample 3's score 4 is spread over two tokens: the score is the sum
        [0.0, 0.0, 1.0],
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
        [1.0, 3.0, 0.0],
        [0.0, 2.0, 0.0],
        [3.0, 0.0, 0.0],
    ]
)
GROUP_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])


def per_sample(values):
    return (torch.tensor(values).unsqueeze(-1) * GROUP_MASK).float()


def test_grpo_normalises_within_non_contiguous_groups_and_passes_a_lone_score_through():
    # group 7 (1, 0, 2): (s - 1) / 1 -> 0, -1, 1; group 3 (0, 4): (s - 2) / sqrt(8) -> -/+0.70711;
    # group 5 alone: mean 0, std 1 -> 3
    advantages, returns = run("grpo", GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX)
    close(advantages, per_sample([0.0, -0.70711, -1.0, 0.70711, 1.0, 3.0]))
    close(returns, advantages)


def test_dr_grpo_only_centres():
    advantages, _ = run("grpo", GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX, norm_adv_by_std=False)
    close(advantages, per_sample([0.0, -2.0, -1.0, 2.0, 1.0, 3.0]))


def test_rloo_subtracts_the_mean_of_the_other_members():
    # group 7: 1 - mean(0, 2) = 0; 0 - mean(1, 2) = -1.5; 2 - mean(1, 0) = 1.5
    # group 3: 0 - 4 = -4; 4 - 0 = 4; group 5 alone: 0
    advantages, returns = run("rloo", GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX)
    close(advantages, per_sample([0.0, -4.0, -1.5, 4.0, 1.5, 0.0]))
    close(returns, advantages)


def test_gpg_scales_centred_scores_by_batch_over_valid_samples():
    # groups: 0 = (1, 0) valid, 1 = (1, 1) all equal, 2 = (5) alone: B = 5, B_valid = 2, alpha = 2.5
    # group 0 centred: +/-0.5 -> +/-1.25; the others 0
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0], [5.0]])
    mask = torch.ones(5, 1)
    advantages, returns = run("gpg", rewards, mask, index=torch.tensor([0, 0, 1, 1, 2]))
    close(advantages, [[1.25], [-1.25], [0.0], [0.0], [0.0]])
    close(returns, advantages)


def test_gpg_with_no_valid_group_is_all_zero():
    advantages, _ = run("gpg", torch.tensor([[1.0], [1.0]]), torch.ones(2, 1), index=torch.tensor([0, 0]))
    close(advantages, [[0.0], [0.0]])


# ---------------------------------------------------------------- OPO and pass@k


def test_opo_subtracts_the_length_weighted_group_mean():
    # group 7 (samples 0, 2, 4: scores 1, 0, 2; lengths 3, 3, 2): baseline (3 + 0 + 4) / 8 = 0.875
    #   -> 0.125, -0.875, 1.125 (the plain mean, 1, would give 0, -1, 1)
    # group 3 (0, 4; lengths 2, 3): (0 + 12) / 5 = 2.4 -> -2.4, 1.6; group 5 alone: baseline 0 -> 3
    advantages, returns = run("opo", GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX)
    close(advantages, per_sample([0.125, -2.4, -0.875, 1.6, 1.125, 3.0]))
    close(returns, advantages)


def test_opo_with_equal_lengths_is_the_plain_group_mean_and_all_equal_scores_give_zero():
    rewards, mask, _, index = random_batch(seed=2)
    full = torch.ones_like(mask)
    opo_advantages, _ = run("opo", rewards, full, index=index)
    centred, _ = run("grpo", rewards, full, index=index, norm_adv_by_std=False)
    close(opo_advantages, centred)
    equal, _ = run("opo", torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]))
    close(equal, [[0.0, 0.0], [0.0, 0.0]])


def test_opo_ignores_the_std_switch():
    with_std, _ = run("opo", GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX, norm_adv_by_std=True)
    without, _ = run("opo", GROUP_REWARDS, GROUP_MASK, index=GROUP_INDEX, norm_adv_by_std=False)
    close(with_std, without)


def test_grpo_passk_rewards_only_each_groups_best_by_its_margin():
    # groups 0 = (1, 0, 2), 1 = (0, 5): the best of each gets best - second best,
    # divided by the group's sample std (1 and sqrt(12.5)); everyone else 0
    rewards = torch.tensor([[1.0], [0.0], [0.0], [2.0], [5.0]])
    index = torch.tensor([0, 1, 0, 0, 1])
    advantages, returns = run("grpo_passk", rewards, torch.ones(5, 1), index=index)
    close(advantages, [[0.0], [0.0], [0.0], [1.0 / (1.0 + 1e-6)], [5.0 / (12.5**0.5 + 1e-6)]])
    close(returns, advantages)
    unnormalised, _ = run("grpo_passk", rewards, torch.ones(5, 1), index=index, norm_adv_by_std=False)
    close(unnormalised, [[0.0], [0.0], [0.0], [1.0], [5.0]])


def test_grpo_passk_gives_nothing_on_a_tie_for_the_best_or_all_equal_scores():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [2.0], [2.0]])
    advantages, _ = run("grpo_passk", rewards, torch.ones(5, 1), index=torch.tensor([0, 0, 0, 1, 1]))
    close(advantages, torch.zeros(5, 1))


def test_grpo_passk_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        run("grpo_passk", torch.ones(3, 1), torch.ones(3, 1), index=torch.tensor([0, 0, 1]))


def test_grpo_passk_reward_lands_on_the_best_sample_over_its_response():
    # scores live on the last token; the advantage covers the whole masked response
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards = scores_to_token_rewards(torch.tensor([0.0, 3.0]), mask)
    advantages, _ = run("grpo_passk", rewards, mask, norm_adv_by_std=False)
    close(advantages, [[0.0, 0.0, 0.0], [3.0, 3.0, 3.0]])


def verl_style_group_loops(scores, lengths, index, norm):
    """OPO and pass@k advantages [B] as verl computes them, one group at a time."""
    opo_adv, passk_adv = torch.zeros_like(scores), torch.zeros_like(scores)
    for group in index.unique():
        members = (index == group).nonzero().squeeze(-1)
        s, n = scores[members], lengths[members]
        opo_adv[members] = s - ((n * s).sum() / n.sum() if len(members) > 1 else 0.0)
        top, where = torch.topk(s, 2)
        passk_adv[members[where[0]]] = (top[0] - top[1]) / ((s.std() + 1e-6) if norm else 1.0)
    return opo_adv, passk_adv


@pytest.mark.parametrize("norm", [True, False])
def test_opo_and_passk_match_verls_group_loops(norm):
    gen = torch.Generator().manual_seed(9)
    index = torch.tensor([4, 1, 4, 2, 1, 2, 4, 2])
    scores = torch.rand(8, generator=gen, dtype=torch.float64)  # distinct: no tie for the best
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 2, 3, 1, 4, 5, 2, 3]).unsqueeze(1)
    rewards = scores_to_token_rewards(scores, mask)
    opo_adv, passk_adv = verl_style_group_loops(scores, mask.sum(-1).to(torch.float64), index, norm)
    close(run("opo", rewards, mask, index=index)[0], opo_adv.unsqueeze(-1) * mask)
    close(run("grpo_passk", rewards, mask, index=index, norm_adv_by_std=norm)[0], passk_adv.unsqueeze(-1) * mask)


# ---------------------------------------------------------------- REINFORCE family


def test_reinforce_plus_plus_whitens_return_to_go_over_the_batch():
    # gamma 0.5: [1, 0, 2] -> [1.5, 1, 2]; [0, 4, (pad)] -> [2, 4, 0]
    # masked tokens 1.5, 1, 2, 2, 4: mean 2.1, sample var 5.2 / 4 = 1.3
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = run("reinforce_plus_plus", rewards, mask, gamma=0.5)
    close(returns, [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    close(advantages, [[-0.52623, -0.96476, -0.08771], [-0.08771, 1.66641, 0.0]])


def test_reinforce_plus_plus_baseline_centres_in_group_then_whitens():
    # group 0 (1, 3): mean 2 -> -1, 1; group 1 alone: no baseline -> 2
    # tokens (lengths 2, 1, 2): -1, -1, 1, 2, 2 -> mean 0.6, sample var 9.2 / 4 = 2.3
    rewards = torch.tensor([[0.0, 1.0], [3.0, 0.0], [0.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    advantages, returns = run("reinforce_plus_plus_baseline", rewards, mask, index=torch.tensor([0, 0, 1]))
    close(advantages, [[-1.05501, -1.05501], [0.26375, 0.0], [0.92313, 0.92313]])
    close(returns, advantages)


def test_remax_subtracts_the_greedy_baseline():
    # advantages: score - baseline broadcast; returns (gamma 0.5) for sample 0: rtg [0.25, 0.5, 1] - 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = run("remax", rewards, mask, baseline=torch.tensor([0.5, 0.5]), gamma=0.5)
    close(advantages, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]])
    close(returns, [[-0.25, 0.0, 0.5], [-0.5, -0.5, 0.0]])


def test_remax_without_baseline_is_a_value_error():
    with pytest.raises(ValueError, match="baseline"):
        run("remax", torch.zeros(1, 2), torch.ones(1, 2))


# ---------------------------------------------------------------- GAE

# sample 0: rewards [0, 0, 1], values [0.5, 0.2, 0.4]; sample 1: one token, reward 2, value 1
GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
GAE_VALUES = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.0, 0.0]])
GAE_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def gae_advantages(flat):
    """Whitened advantages laid out as GAE_MASK from the 4 unwhitened token values."""
    w = whiten_flat(flat)
    return [[w[0], w[1], w[2]], [w[3], 0.0, 0.0]]


def test_gae_by_hand():
    # gamma 0.9: deltas t2 = 1 - 0.4 = 0.6, t1 = 0.9 * 0.4 - 0.2 = 0.16, t0 = 0.9 * 0.2 - 0.5 = -0.32
    # lam 0.5 (decay 0.45): A2 = 0.6, A1 = 0.16 + 0.27 = 0.43, A0 = -0.32 + 0.1935 = -0.1265
    # sample 1: delta = 2 - 1 = 1 -> A = 1, return 2
    advantages, returns = run("gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES, gamma=0.9, lam=0.5)
    close(returns, [[0.3735, 0.63, 1.0], [2.0, 0.0, 0.0]])
    close(advantages, gae_advantages([-0.1265, 0.43, 0.6, 1.0]))
    close(advantages, [[-1.28909, -0.09817, 0.26563], [1.12163, 0.0, 0.0]])


def test_gae_decoupled_lambda_changes_returns_only():
    # critic lam 1: A2 = 0.6, A1 = 0.16 + 0.54 = 0.7, A0 = -0.32 + 0.63 = 0.31 -> returns 0.81, 0.9, 1
    # (the discounted reward, as lam = 1 must give); the actor keeps lam 0.5
    advantages, returns = run("gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES, gamma=0.9, lam=0.5, critic_lam=1.0)
    close(returns, [[0.81, 0.9, 1.0], [2.0, 0.0, 0.0]])
    close(advantages, gae_advantages([-0.1265, 0.43, 0.6, 1.0]))


def test_gae_length_adaptive_lambda_per_sequence():
    # alpha 0.5: length 3 -> lam 1 - 1 / 1.5 = 1/3 (decay 0.3): A1 = 0.16 + 0.18 = 0.34,
    # A0 = -0.32 + 0.102 = -0.218; length 1 -> lam clamped to 0 (one token: lam is moot)
    # returns use lam = 1 (the critic's lambda), untouched by alpha
    advantages, returns = run(
        "gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES, gamma=0.9, lam=1.0, length_adaptive_lam_alpha=0.5
    )
    close(returns, [[0.81, 0.9, 1.0], [2.0, 0.0, 0.0]])
    close(advantages, gae_advantages([-0.218, 0.34, 0.6, 1.0]))


def test_gae_bootstraps_across_a_hole_in_the_mask():
    # gamma = lam = 1, token 1 masked out (its reward 5 and value 9 ignored): t2: A = 1 - 0.4 = 0.6;
    # t0: delta = 0 + V(t2) - 0.5 = -0.1, A = -0.1 + 0.6 = 0.5 -> returns 1 at both real tokens
    _, returns = run(
        "gae", torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]), values=torch.tensor([[0.5, 9.0, 0.4]])
    )
    close(returns, [[1.0, 0.0, 1.0]])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        run("gae", GAE_REWARDS, GAE_MASK)


def test_gae_rejects_a_non_positive_alpha():
    with pytest.raises(ValueError, match="length_adaptive_lam_alpha"):
        run("gae", GAE_REWARDS, GAE_MASK, values=GAE_VALUES, length_adaptive_lam_alpha=0.0)


# ---------------------------------------------------------------- properties


def random_batch(seed: int = 0, batch: int = 6, length: int = 5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])[:batch]
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    scores = torch.randint(0, 3, (batch,), generator=gen).float()
    rewards = scores_to_token_rewards(scores, mask) + 0.1 * torch.randn(batch, length, generator=gen) * mask
    values = torch.randn(batch, length, generator=gen) * mask
    return rewards, mask, values, torch.tensor([0, 1, 0, 1, 2, 2])[:batch]


@pytest.mark.parametrize(
    "name",
    ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gpg", "opo", "grpo_passk"],
)
def test_padding_never_changes_an_estimator(name):
    rewards, mask, values, index = random_batch()
    baseline = torch.tensor([0.5, 1.0, 0.0, 2.0, 1.0, 0.5])
    extra = dict(index=index, values=values, baseline=baseline, gamma=0.9, lam=0.95)
    clean = run(name, rewards, mask, **extra)
    padding = mask == 0
    extra["values"] = values.masked_fill(padding, float("nan"))
    dirty = run(name, rewards.masked_fill(padding, 1e6), mask, **extra)
    for c, d in zip(clean, dirty):
        torch.testing.assert_close(d, c)
        assert torch.all(c[padding] == 0)
    assert clean[0].abs().sum() > 0  # not vacuously zero


def test_registry_lists_valid_names_on_unknown():
    with pytest.raises(ValueError) as error:
        get_estimator("ppo_magic")
    for name in (
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "gpg",
        "opo",
        "grpo_passk",
    ):
        assert name in str(error.value)
        assert name in estimator_names()


def test_registry_rejects_a_duplicate_name():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo")(lambda *a, **k: None)


def test_no_response_column_gets_no_token_reward():
    """A step that kept no sample (DAPO) has [B, 0] masks: nowhere to put a score."""
    from hybridflow.algorithms.estimators import scores_to_token_rewards

    assert scores_to_token_rewards(torch.zeros(0), torch.zeros(0, 0)).shape == (0, 0)
    assert scores_to_token_rewards(torch.ones(2), torch.zeros(2, 0)).shape == (2, 0)
