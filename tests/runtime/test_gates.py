"""The correctness gates: which metrics fail, with what message, and warn versus stop."""

import pytest

from hybridflow.config import ChecksConfig
from hybridflow.runtime import gates

GOOD = {"actor/ppo_kl_first_mini": 2e-7, "actor/clipfrac_first_mini": 0.0, "rollout/token_mult_prob_error": 1.0003}


def test_a_healthy_first_step_passes():
    assert gates.failures(ChecksConfig(), GOOD, 0) == []
    assert gates.apply(ChecksConfig(on_fail="stop"), GOOD, 0) == {"checks/failed": 0.0}


@pytest.mark.claim("correctness-gates")
def test_each_gate_names_its_metric_and_key():
    bad = {"actor/ppo_kl_first_mini": 0.027, "actor/clipfrac_first_mini": 0.1, "rollout/token_mult_prob_error": 1.3}
    lines = gates.failures(ChecksConfig(), bad, 0)
    assert len(lines) == 3
    assert "actor/ppo_kl_first_mini=0.027, not below checks.first_step_ppo_kl=0.001" in lines[0]
    assert "actor/clipfrac_first_mini=0.1" in lines[1]
    assert "rollout/token_mult_prob_error=1.3, not below checks.token_mult_prob_error=1.05" in lines[2]
    # the step-0 invariant holds only before the first update: later steps are not held to it
    assert len(gates.failures(ChecksConfig(), bad, 3)) == 1


def test_warn_counts_and_stop_raises(caplog):
    bad = {**GOOD, "rollout/token_mult_prob_error": 2.0}
    assert gates.apply(ChecksConfig(), bad, 4) == {"checks/failed": 1.0}
    assert "step 5: rollout/token_mult_prob_error=2" in caplog.text
    with pytest.raises(gates.GateFailed, match="checks.on_fail=stop"):
        gates.apply(ChecksConfig(on_fail="stop"), bad, 4)


def test_missing_metrics_are_not_failures():
    assert gates.failures(ChecksConfig(), {}, 0) == []  # e.g. a step that kept no rollouts


def test_bad_thresholds_name_the_key():
    with pytest.raises(ValueError, match="token_mult_prob_error=1.0 must be > 1"):
        ChecksConfig(token_mult_prob_error=1.0)
    with pytest.raises(ValueError, match="on_fail"):
        ChecksConfig(on_fail="ignore")


@pytest.mark.claim("correctness-gates")
def test_the_refit_verifier_compares_digests():
    import torch

    from hybridflow.rollout.base import weight_digest as digest
    from hybridflow.runtime.sync import refit_difference

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    given = [{"a": digest(w)}]
    assert digest(w) == [15.0, 55.0]
    assert refit_difference(given, [{"a": digest(w.clone()), "b": [1.0, 1.0]}]) == 0.0  # derived params ignored
    w[1, 2] += 1e-3
    assert 1e-5 < refit_difference(given, [{"a": digest(w)}]) < 1e-3
    assert refit_difference(given, [{}]) == float("inf")  # the engine lacks a pushed tensor
    lines = gates.failures(ChecksConfig(), {"checks/refit_max_rel_diff": 2e-4}, 5)
    assert lines and "checks/refit_max_rel_diff=0.0002, not below checks.refit_tolerance=1e-06" in lines[0]
