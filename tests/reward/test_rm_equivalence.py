"""A sequence-classification reward model scores what transformers scores, under TP=2, PP=2 and
EP=2 (torchrun, gloo, fp32), a dense tied family and an MoE one; the megatron checkpoint it
saves converts back to the same Hugging Face tensors, and loads again to the same scores.

A frozen model with a layout of its own (``reward_model.parallel``, ``distillation.parallel``)
runs on groups built beside megatron's global ones, which hold another layout (the actor's):
its reward scores and a teacher's log-probs equal transformers' there too."""

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
# (kind, family, the frozen model's layout, the actor's: megatron's global groups)
OWN = [
    ("rm", "qwen3", {"pp": 2}, {"tp": 2}),
    ("rm", "qwen3_moe", {"tp": 2}, {"ep": 2}),
    ("teacher", "qwen3", {"pp": 2}, {"tp": 2}),
    ("teacher", "qwen3_moe", {"ep": 2}, {"tp": 2}),
]


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
    tasks += [_own_layout_task(root, *case) for case in OWN]
    # a megatron checkpoint loads under an own layout too
    tasks.append(
        {
            "rm_dir": str(root / "mcore_qwen3_moe_ep2"),
            "spec": {"tp": 2},
            "actor_spec": {"pp": 2},
            "ids": torch.load(root / "ids_qwen3_moe.pt").tolist(),
            "out": str(root / "own_reload_qwen3_moe.pt"),
        }
    )
    run_pool(WORKER, 2, tasks, root, "rm_world2", timeout=800)
    return root


def _own_layout_task(root: Path, kind: str, family: str, spec: dict, actor: dict) -> dict:
    ids = torch.load(root / f"ids_{family}.pt")
    return {
        "kind": kind,
        "rm_dir": str(root / (f"rm_{family}" if kind == "rm" else f"hf_{family}")),
        "spec": spec,
        "actor_spec": actor,
        "ids": ids.tolist(),
        "out": str(root / f"own_{_own_name(kind, family, spec, actor)}.pt"),
    }


def _own_name(kind: str, family: str, spec: dict, actor: dict) -> str:
    return f"{kind}_{_name(family, spec)}_beside_" + "_".join(f"{k}{v}" for k, v in actor.items())


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


def _transformers_logprobs(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' causal LM log-prob of each token given the ones before (index 0: 0)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(net(ids).logits.float(), dim=-1)
    picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([picked.new_zeros(ids.shape[0], 1), picked], dim=1)


@pytest.mark.claim("frozen-model-own-layout")
@pytest.mark.parametrize("kind,family,spec,actor", OWN, ids=[_own_name(*case) for case in OWN])
def test_a_frozen_model_on_a_layout_of_its_own_equals_transformers(runs, kind, family, spec, actor):
    ids = torch.load(runs / f"ids_{family}.pt")
    got = _result(runs, "own_" + _own_name(kind, family, spec, actor))
    if kind == "rm":
        expected, got = transformers_scores(runs / f"rm_{family}", ids), got["scores"]
    else:
        expected, got = _transformers_logprobs(runs / f"hf_{family}", ids), got["logprobs"]
    print(f"\n[{kind} {family} {spec} beside {actor}] max |diff| {(got - expected).abs().max():.2e}")
    assert expected.abs().max() > 1e-3
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=TOL, rtol=0)


def test_a_megatron_checkpoint_loads_under_a_layout_of_its_own(runs):
    ids = torch.load(runs / "ids_qwen3_moe.pt")
    got = _result(runs, "own_reload_qwen3_moe")["scores"]
    assert torch.allclose(got, transformers_scores(runs / "rm_qwen3_moe", ids), atol=TOL, rtol=0)
