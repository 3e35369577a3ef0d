"""The feature registry (``hybridflow.features``) and the combination matrix's judgement of a cell
(``tests.combinations.matrix.check``), without running one."""

from __future__ import annotations

import pytest

from hybridflow.config import ASYNC_MODES, CORRECTION_MODES, PF_PPO_MODES, load_config
from hybridflow.features import FEATURES, MODEL_DIRS, PARTS, active_features, feature
from tests.combinations.matrix import CONFIG, Cell, Outcome, cells, check

DIRS = {name: f"/models/{name}" for name in MODEL_DIRS}


@pytest.mark.parametrize("f", FEATURES, ids=lambda f: f.name)
def test_each_switch_loads_and_turns_its_feature_on(f) -> None:
    ppo = ["algorithm.name=ppo"]  # every feature loads with it (a critic's layout needs a critic)
    assert not f.on(load_config(CONFIG, ppo))
    cfg = load_config(CONFIG, [*ppo, *f.overrides(DIRS)])
    assert f.name in active_features(cfg)
    assert f.touches and f.touches <= set(PARTS)


def test_modes_expand_from_their_registries() -> None:
    names = {f.name for f in FEATURES}
    assert {f"async_{m}" for m in ASYNC_MODES if m != "sync"} <= names
    assert {f"rollout_correction_{m}" for m in CORRECTION_MODES} | {f"pf_ppo_{m}" for m in PF_PPO_MODES} <= names
    with pytest.raises(KeyError, match="unknown feature 'nope'; features: dynamic_sampling"):
        feature("nope")


def test_the_matrix_holds_each_algorithm_with_each_feature_and_the_pairs_sharing_a_part() -> None:
    from hybridflow.algorithms.recipes import algorithm_names

    all_cells = cells()
    singles = {(c.algorithm, c.features[0]) for c in all_cells if len(c.features) == 1}
    assert singles == {(a, f.name) for a in algorithm_names() for f in FEATURES}
    pairs = [c for c in all_cells if len(c.features) == 2]
    assert Cell("grpo", ("dynamic_sampling", "async_async")) in pairs  # rows
    assert Cell("grpo", ("packing", "lora_merged")) in pairs  # sequences
    assert Cell("grpo", ("overlong_shaping", "packing")) not in pairs  # scores / sequences: no common part


def test_a_refusal_must_name_both_settings_in_one_line_and_a_crash_never_holds() -> None:
    cell = Cell("gspo", ("packing",))
    named = "packing.enabled with algorithm.name=gspo (its loss_agg_mode is seq-mean-token-mean): ..."
    assert check([Outcome(cell, refused=named)], {}) == []
    unnamed = "packing.enabled with algorithm.loss_agg_mode=seq-mean-token-mean: ..."
    assert "without naming both" in check([Outcome(cell, refused=unnamed)], {})[0]
    assert "more than one line" in check([Outcome(cell, refused=named + "\nTraceback")], {})[0]
    # a feature refused on its own (with the quickstart's algorithm) need only name itself
    r3 = Cell("ppo", ("routing_replay_r3",))
    line = "moe.routing_replay=r3 replays the experts chosen by the rollout engine ..."
    assert check([Outcome(r3, refused=line)], {"routing_replay_r3": line}) == []
    assert check([Outcome(r3, refused=line)], {"routing_replay_r3": None})  # else it must name ppo
    crashed = Outcome(
        Cell("remax", ("dynamic_sampling",)), crash="Traceback ...\nIndexError: index 184 is out of bounds"
    )
    assert check([crashed], {}) == ["remax+dynamic_sampling crashed: IndexError: index 184 is out of bounds"]
    silent = Outcome(
        Cell("grpo", ("packing",)), steps=[{"step": 1, "reward/mean": float("nan")}, {"step": 2, "reward/mean": 0.5}]
    )
    assert "non-finite reward" in check([silent], {})[0]
