"""Rollout correction against hand-computed weights, masks and metrics."""

import math

import pytest
import torch

from hybridflow.algorithms.correction import rollout_correction
from hybridflow.config import AlgorithmConfig

# two samples, three response tokens; the second sample has one padding token (NaN there)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, float("nan")]])
ROLLOUT = torch.tensor([[-1.0, -3.0, -0.5], [-2.5, -1.0, float("nan")]])
# old - rollout: [[0, 1, 0], [1.5, 0, pad]]


def _log_w(level):
    token = torch.tensor([[0.0, 1.0, 0.0], [1.5, 0.0, 0.0]])
    if level == "token":
        return token
    seq = torch.tensor([[1.0], [1.5]])
    if level == "geometric":
        seq = seq / torch.tensor([[3.0], [2.0]])
    return seq.expand(2, 3)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_truncated_importance_weights(level):
    c = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level=level, upper=2.0)
    want = torch.clamp(torch.exp(_log_w(level)), max=2.0) * MASK
    torch.testing.assert_close(c.weights, want)
    assert torch.equal(c.keep, MASK)  # TIS drops nothing
    assert c.metrics["rollout_corr/dropped_fraction"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_importance_sampling_drops_outside_the_bounds(level):
    c = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", level=level, upper=2.0, lower=0.5)
    w = torch.exp(_log_w(level))
    keep = ((w <= 2.0) & (w >= 0.5)).float() * MASK
    torch.testing.assert_close(c.keep, keep)
    torch.testing.assert_close(c.weights, w * keep)
    dropped = float(((1 - keep) * MASK).sum() / MASK.sum())
    assert c.metrics["rollout_corr/dropped_fraction"].item() == pytest.approx(dropped)
    if level == "geometric":  # exp(1/3) = 1.40 stays, exp(0.75) = 2.12 goes: whole samples
        assert torch.equal(c.keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    if level == "sequence":  # e and e^1.5 are above 2: both samples go
        assert c.keep.sum() == 0


def test_mask_mode_rejects_without_weighting_and_metrics():
    c = rollout_correction(OLD, ROLLOUT, MASK, mode="mask", upper=2.0)
    keep = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])  # e > 2 and e^1.5 > 2 dropped
    assert torch.equal(c.keep, keep) and torch.equal(c.weights, keep)
    m = c.metrics
    assert m["rollout_corr/log_ratio_mean"].item() == pytest.approx(2.5 / 5)
    assert m["rollout_corr/weight_max"].item() == pytest.approx(math.exp(1.5))
    k3 = [math.expm1(d) - d for d in (0.0, 1.0, 0.0, 1.5, 0.0)]
    assert m["rollout_corr/kl_k3"].item() == pytest.approx(sum(k3) / 5)


def test_degenerate_and_extreme_inputs():
    same = rollout_correction(OLD, OLD, MASK, mode="mis", level="sequence")
    assert torch.equal(same.weights, MASK) and torch.equal(same.keep, MASK)  # on-policy: all weights 1
    far = rollout_correction(
        torch.zeros(1, 2), torch.full((1, 2), -1e4), torch.ones(1, 2), mode="tis", level="sequence", upper=3.0
    )
    assert torch.isfinite(far.weights).all() and far.weights.max() == 3.0  # clamped, no overflow
    empty = rollout_correction(OLD, ROLLOUT, torch.zeros(2, 3), mode="mis")
    assert empty.keep.sum() == 0 and torch.isfinite(empty.metrics["rollout_corr/weight_max"])


def test_weights_carry_no_gradient_into_the_old_log_probs():
    old = OLD.clone().nan_to_num().requires_grad_()
    c = rollout_correction(old, ROLLOUT.nan_to_num(), MASK, mode="tis")
    assert not c.weights.requires_grad


def test_bad_settings_name_the_keys():
    with pytest.raises(ValueError, match="rollout_correction_lower=3.0 / rollout_correction_upper=2.0"):
        AlgorithmConfig(rollout_correction="mis", rollout_correction_lower=3.0)
    with pytest.raises(ValueError, match="rollout_correction"):
        AlgorithmConfig(rollout_correction="importance")
    with pytest.raises(ValueError, match="mode 'x'"):
        rollout_correction(OLD, ROLLOUT, MASK, mode="x")


@pytest.mark.claim("rollout-correction")
@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg", "reinforce"])
def test_every_policy_loss_takes_the_correction(name):
    """The actor's loss with a correction: on-policy samples (engine = trainer) give the plain
    loss; a token MIS drops leaves the loss as if that token were masked out."""
    import dataclasses
    from types import SimpleNamespace

    from hybridflow.algorithms.losses import get_policy_loss
    from hybridflow.graph import Node
    from hybridflow.runtime.ops import actor_loss

    torch.manual_seed(0)
    logp = (OLD.nan_to_num() + 0.1 * torch.randn(2, 3)).requires_grad_()
    micro = {
        "response_mask": MASK,
        "old_logprobs": OLD.nan_to_num(),
        "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3]),
    }
    plain = AlgorithmConfig()
    node = Node(
        name="update_actor",
        role="actor",
        op="update_actor",
        options={
            "policy_loss": name,
            "loss_agg_mode": "token-mean",
            "clip_ratio_high": 0.2,
            "kl_loss": False,
            "lm_loss_coef": 0.0,
        },
    )

    def loss(algo, rollout, mask=MASK):
        fn = actor_loss(SimpleNamespace(models=SimpleNamespace(algo=algo)), node, 3)
        num, den, _ = fn(logp, torch.zeros(2, 3), {**micro, "response_mask": mask, "rollout_logprobs": rollout})
        return num / den

    corrected = dataclasses.replace(plain, rollout_correction="mis", rollout_correction_upper=2.0)
    on_policy = loss(corrected, OLD.nan_to_num())
    torch.testing.assert_close(on_policy, loss(plain, OLD.nan_to_num()))
    dropped = loss(corrected, ROLLOUT.nan_to_num())  # tokens (0, 1) and (1, 0) have weight e, e^1.5 > 2
    keep = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    if name not in ("gspo",):  # gspo's ratio is per sequence: the kept tokens still see the dropped ones
        torch.testing.assert_close(dropped, loss(plain, OLD.nan_to_num(), keep))
    assert torch.isfinite(dropped)
    get_policy_loss(name)  # registered
