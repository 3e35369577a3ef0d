"""The ``packing`` section: defaults off, and impossible settings refused naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.algorithms.recipes import algorithm_spec
from hybridflow.config import load_config
from hybridflow.preflight import check_packing, preflight

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PACKED = str(CONFIGS / "quickstart_cpu_packed.yaml")


def _check(cfg) -> None:
    spec = algorithm_spec(cfg)
    check_packing(cfg, policy_loss=spec.policy_loss, loss_agg_mode=spec.loss_agg_mode)


def test_packing_is_off_by_default() -> None:
    cfg = load_config(str(CONFIGS / "quickstart_cpu.yaml"))
    assert not cfg.packing.enabled and cfg.packing.max_tokens_per_micro_batch is None
    assert cfg.packing.budget is None


def test_the_packed_quickstart_passes_preflight(tmp_path) -> None:
    cfg = load_config(PACKED, [f"run.output_dir={tmp_path}"])
    assert cfg.packing.budget == 192
    preflight(cfg)


@pytest.mark.claim("packing-refusals")
def test_a_budget_without_packing_names_both_keys() -> None:
    with pytest.raises(ValueError, match=r"packing.max_tokens_per_micro_batch=64 needs packing.enabled=true"):
        load_config(PACKED, ["packing.enabled=false", "packing.max_tokens_per_micro_batch=64"])
    with pytest.raises(ValueError, match=r"packing.max_tokens_per_micro_batch=0 must be > 0"):
        load_config(PACKED, ["packing.max_tokens_per_micro_batch=0"])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (
            ["packing.max_tokens_per_micro_batch=35"],
            "packing.max_tokens_per_micro_batch=35 is below the longest "
            "possible sample, data.max_prompt_length \\+ data.max_response_length = 36",
        ),
        (["algorithm.loss_agg_mode=seq-mean-token-mean"], "algorithm.loss_agg_mode=seq-mean-token-mean"),
        (["algorithm.policy_loss=gspo"], "algorithm.policy_loss=gspo"),
        (
            ["algorithm.rollout_correction=tis", "algorithm.rollout_correction_level=sequence"],
            "algorithm.rollout_correction_level=sequence",
        ),
    ],
)
@pytest.mark.claim("packing-refusals")
def test_impossible_packing_settings_are_refused(overrides, key) -> None:
    cfg = load_config(PACKED, overrides)
    with pytest.raises(ValueError, match=key) as error:
        _check(cfg)
    assert "packing" in str(error.value) and "\n" not in str(error.value)


def test_the_longest_sample_fits_exactly() -> None:
    _check(load_config(PACKED, ["packing.max_tokens_per_micro_batch=36"]))
