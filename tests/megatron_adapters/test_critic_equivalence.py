"""A critic under PP=2 (and PP=2 x VPP=2) computes what one process computes, tied embeddings too.

Two torchrun pools run ``critic_worker.py``: one process saves each case's initial actor and
trains a critic started from it; two processes load that actor under the pipeline layout and do
the same. The tests compare the values, the value loss, the grad norm and the values after one
Adam step, that the critic took the actor's weights except the value head, and that a tied
family's critic checkpoint (with optimizer state) resumes where it was saved: built tied,
megatron-core would store the last stage's value head under the word embeddings' key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.megatron_adapters.pools import run_pool

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("critic_worker.py")
TOL = 1e-5
# family, tie_word_embeddings: qwen2 ties; llama tied is the same path on another family
MODELS = {"qwen2": ("qwen2", True), "llama": ("llama", False), "llama_tied": ("llama", True)}
LAYOUTS = {"pp2": {"pp": 2}, "pp2vpp2": {"pp": 2, "vpp": 2}}
CASES = [(m, name) for m in MODELS for name in LAYOUTS if name == "pp2" or m == "qwen2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("critic_runs")

    def task(m: str, name: str, spec: dict, save: bool) -> dict:
        family, tie = MODELS[m]
        return {"kind": "critic", "family": family, "spec": spec, "tie": tie, "save": save, "resume": tie,
                "init_dir": str(workdir / f"init_{m}"), "out": str(workdir / f"{m}_{name}")}

    run_pool(WORKER, 1, [task(m, "ref", {}, True) for m in MODELS], workdir, "critic_world1", timeout=600)
    run_pool(WORKER, 2, [task(m, name, LAYOUTS[name], False) for m, name in CASES], workdir, "critic_world2",
             timeout=600)
    names = [f"{m}_ref" for m in MODELS] + [f"{m}_{name}" for m, name in CASES]
    return {name: torch.load(workdir / name) for name in names}


def _result(results: dict, name: str) -> dict:
    got = results[name]
    if "exception" in got:
        pytest.fail(f"critic task {name} raised:\n{got['exception']}")
    return got


@pytest.mark.parametrize("model,name", CASES)
def test_pipelined_critic_matches_single_process(results: dict, model: str, name: str) -> None:
    ref, got = _result(results, f"{model}_ref"), _result(results, f"{model}_{name}")
    assert ref["applied"] and got["applied"]
    for key in ("values", "after"):
        assert (got[key] - ref[key]).abs().max() < TOL, key
    assert (ref["after"] - ref["values"]).abs().max() > 1e-3  # the step moved the values
    assert abs(got["loss"] - ref["loss"]) < TOL
    assert abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] < TOL


@pytest.mark.parametrize("model,name", [(m, "ref") for m in MODELS] + CASES)
def test_critic_takes_the_actor_weights_but_the_value_head(results: dict, model: str, name: str) -> None:
    ranks = _result(results, f"{model}_{name}")["ranks"]
    # the head is on the last stage alone, freshly initialised (not zero, not the embeddings)
    assert [r["skipped"] for r in ranks][-1] == ["output_layer.weight"]
    assert all(r["skipped"] == [] for r in ranks[:-1])
    assert all(total > 0 for total in ranks[-1]["fresh_head"])


@pytest.mark.parametrize("model,name", [c for c in [(m, "ref") for m in MODELS] + CASES if MODELS[c[0]][1]])
def test_tied_critic_checkpoint_resumes(results: dict, model: str, name: str) -> None:
    got = _result(results, f"{model}_{name}")
    assert torch.equal(got["resumed_values"], got["after"])
    assert got["resumed_next_loss"] == got["next_loss"]
