"""The combination matrix (``tests/combinations``): every algorithm with every feature, and the
pairs of features that touch a common part of a step, each run for two short RL steps from the
shared SFT warm-up or refused before any rank starts in one line naming both settings.

- default tier: every refused cell of the whole matrix is refused so (no run: a config check
  each); every cell that once crashed runs; each feature that no other test of the session runs
  end to end (``@pytest.mark.features``) runs once.
- slow tier: the whole matrix runs (``python -m tests.combinations --tier all --docs`` runs it
  outside pytest and writes its tables into docs/testing.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.features import FEATURES
from tests.combinations.matrix import (
    EVER_FAILED,
    Cell,
    Outcome,
    cells,
    check,
    default_cells,
    refusal,
    refused_alone,
    run_cells,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, sft_warm_up: Path) -> dict[str, str]:
    from tests.reward.rm_models import make_rm_dir

    hf = str(sft_warm_up / "checkpoints" / "sft" / "hf")
    return {"reward_model": str(make_rm_dir(tmp_path_factory.mktemp("matrix_rm"), "qwen3")), "judge": hf, "teacher": hf}


def run_elsewhere(items) -> set[str]:
    """The features the session's other tests run end to end (their ``features`` marks)."""
    names = {name for item in items for mark in item.iter_markers("features") for name in mark.args}
    unknown = names - {f.name for f in FEATURES}
    assert not unknown, f"features marks name no registered feature: {sorted(unknown)}"
    return names


@pytest.mark.claim("combination-matrix")
def test_every_refused_cell_of_the_matrix_is_refused_in_one_line_naming_both_settings(dirs) -> None:
    outcomes = [Outcome(cell, refused=refusal(cell, dirs)) for cell in cells()]
    refused = [o for o in outcomes if o.refused is not None]
    assert refused and len(refused) < len(outcomes) / 2, len(refused)
    assert not check(refused, refused_alone(dirs))


@pytest.mark.claim("combination-matrix")
def test_every_cell_that_once_failed_and_each_feature_run_nowhere_else_runs_two_steps(
    request, tmp_path: Path, dirs, seeded
) -> None:
    elsewhere = run_elsewhere(request.session.items)
    chosen = default_cells(dirs, elsewhere)
    assert chosen[: len(EVER_FAILED)] == [Cell(a, f) for a, f in EVER_FAILED]
    outcomes = run_cells(chosen, tmp_path, dirs, seeded)
    assert not check(outcomes, refused_alone(dirs))


@pytest.mark.slow
@pytest.mark.claim("combination-matrix")
def test_the_whole_matrix_runs_or_is_refused_by_name(tmp_path: Path, dirs, seeded) -> None:
    outcomes = run_cells(cells(), tmp_path, dirs, seeded)
    assert not check(outcomes, refused_alone(dirs))
