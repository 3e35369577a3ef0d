"""A sequence-classification reward model scores what transformers scores, under TP=2, PP=2 and
EP=2 (torchrun, gloo, fp32), a dense tied family and an MoE one; the megatron checkpoint it
saves converts back to the same Hugging Face tensors, and loads again to the same scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfschema.hf_config import read_hf_config
from megatron_adapters.convert import mcore_to_hf
from tests.megatron_adapters.convert_models import hf_tensors
from tests.megatron_adapters.pools import run_pool
from tests.reward.rm_models import make_rm_dir, padded_ids, transformers_scores

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("rm_worker.py")
TOL = 1e-4
CASES = [("qwen3", {"tp": 2}), ("qwen3", {"pp": 2}), ("qwen3_moe", {"tp": 2}), ("qwen3_moe", {"ep": 2})]


def _name(family: str, spec: dict) -> str:
    return family + "_" + "_".join(f"{k}{v}" for k, v in spec.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rm")
    tasks = []
    for family, spec in CASES:
        rm = make_rm_dir(root, family)
        ids = padded_ids(read_hf_config(rm)["vocab_size"], read_hf_config(rm)["pad_token_id"])
        torch.save(ids, root / f"ids_{family}.pt")
        name = _name(family, spec)
        tasks.append(
            {
                "rm_dir": str(rm),
                "spec": spec,
                "ids": ids.tolist(),
                "save_dir": str(root / f"mcore_{name}"),
                "out": str(root / f"{name}.pt"),
            }
        )
    # the saved checkpoints load again (another layout: EP=2's under TP=2 and the others')
    tasks += [
        {
            "rm_dir": str(root / f"mcore_{_name(f, s)}"),
            "spec": {"tp": 2},
            "ids": t["ids"],
            "out": str(root / f"reload_{_name(f, s)}.pt"),
        }
        for (f, s), t in zip(CASES, list(tasks))
    ]
    run_pool(WORKER, 2, tasks, root, "rm_world2", timeout=800)
    return root


def _result(root: Path, name: str) -> dict:
    result = torch.load(root / f"{name}.pt")
    if "exception" in result:
        pytest.fail(f"worker task {name} raised:\n{result['exception']}")
    return result


@pytest.mark.claim("reward-model-equals-transformers")
@pytest.mark.parametrize("family,spec", CASES, ids=[_name(f, s) for f, s in CASES])
def test_scores_equal_transformers(runs, family, spec):
    ids = torch.load(runs / f"ids_{family}.pt")
    expected = transformers_scores(runs / f"rm_{family}", ids)
    got = _result(runs, _name(family, spec))["scores"]
    print(
        f"\n[{_name(family, spec)}] scores {got.tolist()} vs transformers max |diff| {(got - expected).abs().max():.2e}"
    )
    assert expected.abs().min() > 1e-3  # the scores are not all 0 (a missing head would pass)
    assert torch.allclose(got, expected, atol=TOL, rtol=0)
    reloaded = _result(runs, "reload_" + _name(family, spec))["scores"]
    assert torch.allclose(reloaded, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_saved_reward_model_converts_back_to_the_same_tensors(runs, family, tmp_path):
    """The score head travels: megatron's checkpoint -> a Hugging Face directory bitwise equal to
    the one loaded (the export ``run.mode=rm`` writes)."""
    name = _name(family, next(s for f, s in CASES if f == family))
    _result(runs, name)
    original = runs / f"rm_{family}"
    mcore_to_hf(runs / f"mcore_{name}", tmp_path / "back", hf_config=original)
    a, b = hf_tensors(original), hf_tensors(tmp_path / "back")
    assert "score.weight" in b and sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
