"""Packed and token-budget passes compute what unpacked ones compute, under TP=2, PP=2, EP=2.

One torchrun pool of two processes runs ``packing_worker.py``'s ``packed`` task for every family
under each layout (EP only for the MoE families); the tests compare what it recorded: log-probs,
entropy, the loss, the grad norm and the log-probs after one Adam step of the actor, the values,
value loss, grad norm and values after a step of the critic (tied embeddings under PP=2 too),
and (MoE) the routes recorded and the log-probs replaying them. Over the tokens the loss
counts, within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .families import FAMILIES, MOE_FAMILIES
from .test_equivalence import _torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]

WORKER = Path(__file__).with_name("packing_worker.py")
TOL = 1e-5
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}}
CASES = [(f, name) for f in FAMILIES for name in LAYOUTS if f in MOE_FAMILIES or name != "ep2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("packing_runs")
    tasks = [
        {"kind": "packed", "family": f, "spec": LAYOUTS[name], "out": str(workdir / f"{f}_{name}")} for f, name in CASES
    ]
    _torchrun(2, tasks, workdir, "packing_world2", worker=WORKER)
    return {f"{f}_{name}": torch.load(workdir / f"{f}_{name}") for f, name in CASES}


def _result(results: dict, family: str, name: str) -> dict:
    got = results[f"{family}_{name}"]
    if "exception" in got:
        pytest.fail(f"packing task {family} {name} raised:\n{got['exception']}")
    return got


@pytest.mark.claim("packing-equals-unpacked")
@pytest.mark.parametrize("family,name", CASES)
@pytest.mark.parametrize("mode", ["packed", "budget"])
def test_packed_matches_unpacked(results: dict, family: str, name: str, mode: str) -> None:
    got = _result(results, family, name)
    diffs = got[mode]
    for key in ("logp", "entropy", "loss", "after", "values", "value_loss", "value_after"):
        assert diffs[key] < TOL, (key, diffs)
    assert diffs["grad_norm"] < TOL and diffs["value_grad_norm"] < TOL, diffs  # relative
    assert diffs["tokens"][0] == diffs["tokens"][1]
    assert got["moved"] > 1e-3  # the step moved the weights: "after" is not trivially equal


@pytest.mark.claim("packing-equals-unpacked")
@pytest.mark.parametrize("family,name", [c for c in CASES if c[0] in MOE_FAMILIES])
def test_routes_follow_the_packing(results: dict, family: str, name: str) -> None:
    got = _result(results, family, name)
    assert all(got["routes_equal"].values()), got["routes_equal"]
    assert got["replay_logp"] < TOL
