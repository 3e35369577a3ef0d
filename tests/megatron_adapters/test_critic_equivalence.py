"""A critic under TP=2 (with and without sequence parallelism), EP=2, PP=2 and PP=2 x VPP=2
computes what one process computes, tied embeddings too.

Two torchrun pools run ``critic_worker.py``: one process saves each case's initial actor and
trains a critic started from it; two processes load that actor under another layout and do the
same. The tests compare the values, the value loss, the grad norm and the values after one Adam
step; that the critic took the actor's weights except the value head, whose fresh draw is the
one process's under TP (one ``[1, H]`` weight every TP rank holds whole, not a column per rank
summed); and that a tied family's critic checkpoint (with optimizer state) resumes where it was
saved and loads under another layout: built tied, megatron-core would store the last stage's
value head under the word embeddings' key.
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
MODELS = {
    "qwen2": ("qwen2", True),
    "llama": ("llama", False),
    "llama_tied": ("llama", True),
    "qwen3_moe": ("qwen3_moe", False),
}
# name -> (layout spec, sequence parallel); the project's layouts turn it on with TP
LAYOUTS = {
    "pp2": ({"pp": 2}, True),
    "pp2vpp2": ({"pp": 2, "vpp": 2}, True),
    "tp2": ({"tp": 2}, True),
    "tp2_no_sp": ({"tp": 2}, False),
    "ep2": ({"ep": 2}, True),
}
CASES = [
    ("qwen2", "pp2"),
    ("qwen2", "pp2vpp2"),
    ("qwen2", "tp2"),
    ("llama", "pp2"),
    ("llama", "tp2"),
    ("llama", "tp2_no_sp"),
    ("llama_tied", "pp2"),
    ("qwen3_moe", "tp2"),
    ("qwen3_moe", "ep2"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("critic_runs")

    def task(m: str, name: str, spec: dict, sequence_parallel: bool, save: bool) -> dict:
        family, tie = MODELS[m]
        return {
            "kind": "critic",
            "family": family,
            "spec": spec,
            "tie": tie,
            "save": save,
            "resume": tie,
            "sequence_parallel": sequence_parallel,
            "init_dir": str(workdir / f"init_{m}"),
            "out": str(workdir / f"{m}_{name}"),
        }

    run_pool(WORKER, 1, [task(m, "ref", {}, True, True) for m in MODELS], workdir, "critic_world1", timeout=600)
    run_pool(
        WORKER, 2, [task(m, name, *LAYOUTS[name], False) for m, name in CASES], workdir, "critic_world2", timeout=600
    )
    names = [f"{m}_ref" for m in MODELS] + [f"{m}_{name}" for m, name in CASES]
    return {name: torch.load(workdir / name) for name in names}


def _result(results: dict, name: str) -> dict:
    got = results[name]
    if "exception" in got:
        pytest.fail(f"critic task {name} raised:\n{got['exception']}")
    return got


@pytest.mark.claim("critic-from-the-sft-policy")
@pytest.mark.parametrize("model,name", CASES)
def test_critic_matches_single_process(results: dict, model: str, name: str) -> None:
    ref, got = _result(results, f"{model}_ref"), _result(results, f"{model}_{name}")
    assert ref["applied"] and got["applied"]
    for key in ("values", "after"):
        assert (got[key] - ref[key]).abs().max() < TOL, key
    assert (ref["after"] - ref["values"]).abs().max() > 1e-3  # the step moved the values
    assert abs(got["loss"] - ref["loss"]) < TOL
    assert abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] < TOL


@pytest.mark.claim("critic-from-the-sft-policy")
@pytest.mark.parametrize("model,name", [(m, "ref") for m in MODELS] + CASES)
def test_critic_takes_the_actor_weights_but_the_value_head(results: dict, model: str, name: str) -> None:
    ranks = _result(results, f"{model}_{name}")["ranks"]
    # the head is on the last stage alone (every rank of it under TP), freshly initialised (not
    # zero, not the embeddings)
    assert ranks[-1]["fresh_head"]
    for rank in ranks:
        assert rank["skipped"] == (["output_layer.weight"] if rank["fresh_head"] else [])
        assert all(head.abs().sum() > 0 for head in rank["fresh_head"])


@pytest.mark.parametrize("model,name", [c for c in CASES if not LAYOUTS[c[1]][0].get("pp")])
def test_fresh_value_head_is_the_single_process_one(results: dict, model: str, name: str) -> None:
    """Without PP every rank holds the same whole head; under TP alone it is the one process's
    draw (a pipeline stage draws fewer layers before it, an EP rank only its own experts)."""
    (ref_head,) = _result(results, f"{model}_ref")["ranks"][0]["fresh_head"]
    heads = [head for rank in _result(results, f"{model}_{name}")["ranks"] for head in rank["fresh_head"]]
    assert len(heads) == 2 and torch.equal(heads[0], heads[1]) and heads[0].shape == ref_head.shape
    if set(LAYOUTS[name][0]) == {"tp"}:
        assert torch.equal(heads[0], ref_head)


@pytest.mark.parametrize("model,name", [c for c in [(m, "ref") for m in MODELS] + CASES if MODELS[c[0]][1]])
def test_tied_critic_checkpoint_resumes(results: dict, model: str, name: str) -> None:
    got = _result(results, f"{model}_{name}")
    assert torch.equal(got["resumed_values"], got["after"])
    assert got["resumed_next_loss"] == got["next_loss"]


@pytest.mark.parametrize("model,name", [c for c in CASES if MODELS[c[0]][1]])
def test_single_process_critic_checkpoint_loads_under_the_layout(results: dict, model: str, name: str) -> None:
    """The one process's critic checkpoint (after its step, with optimizer state) under PP or
    TP: the same values, and the same next step."""
    ref, got = _result(results, f"{model}_ref"), _result(results, f"{model}_{name}")
    assert (got["reference_values"] - ref["after"]).abs().max() < TOL
    assert abs(got["reference_next_loss"] - ref["next_loss"]) < TOL
