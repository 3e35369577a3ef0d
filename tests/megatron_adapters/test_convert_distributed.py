"""Converted checkpoints in real megatron-core policies: same log-probs as transformers, and back.

Each family's tiny HF model is converted twice (for TP=2 and for TP=1: the vocabulary padding
differs), then loaded by ``convert_worker.py`` in two torchrun pools:

    4 processes: TP2 x EP2 (MoE families) or TP2 (dense; DP=2), 5 families in one launch
    2 processes: PP=2, 5 families in one launch

Each policy scores a batch (compared here with transformers' own model on the HF directory) and
saves itself with megatron-core (``checkpoint.save``): that checkpoint must have exactly the
converter's keys, shapes and dtypes, and ``mcore_to_hf`` of it (megatron's own TP / EP / PP
shards, not the converter's chunks) must give back the original HF tensors bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_adapters.convert import hf_to_mcore, mcore_to_hf
from megatron_adapters.dist_io import DistReader
from tests.megatron_adapters.convert_models import FAMILIES, MOE_FAMILIES, hf_tensors, make_hf_dir
from tests.megatron_adapters.pools import run_pool

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

WORKER = Path(__file__).with_name("convert_worker.py")
LOGPROB_TOL = 1e-4
"""fp32 megatron-core vs fp32 transformers; observed differences are a few 1e-6."""
POOLS = {"tp2": 4, "pp2": 2}


def _spec(family: str, pool: str) -> dict:
    if pool == "pp2":
        return {"pp": 2}
    return {"tp": 2, "ep": 2} if family in MOE_FAMILIES else {"tp": 2}


def _torchrun(nproc: int, tasks: list[dict], root: Path, label: str) -> None:
    run_pool(WORKER, nproc, tasks, root, label, timeout=1100)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert_runs")
    for family in FAMILIES:
        make_hf_dir(root, family)
    for pool, nproc in POOLS.items():
        tasks = []
        for family in FAMILIES:
            spec = _spec(family, pool)
            hf_to_mcore(root / f"hf_{family}", root / f"mcore_{pool}_{family}", **spec)
            tasks.append(
                {
                    "hf_dir": str(root / f"hf_{family}"),
                    "spec": spec,
                    "mcore_dir": str(root / f"mcore_{pool}_{family}"),
                    "resave_dir": str(root / f"resaved_{pool}_{family}"),
                    "out": str(root / f"{pool}_{family}.pt"),
                }
            )
        _torchrun(nproc, tasks, root, f"{pool}_world{nproc}")
    return root


def _result(root: Path, pool: str, family: str) -> dict:
    result = torch.load(root / f"{pool}_{family}.pt")
    if "exception" in result:
        pytest.fail(f"worker task {pool}/{family} raised:\n{result['exception']}")
    return result


def _transformers_logprobs(path: Path) -> torch.Tensor:
    """transformers on the HF directory, the worker's batch, position t scoring token t."""
    net = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, net.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logp = torch.log_softmax(net(ids).logits.float(), dim=-1)
    return torch.cat([torch.zeros(4, 1), logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)


@pytest.mark.claim("convert-any-layout")
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_transformers(runs, family, pool):
    got = _result(runs, pool, family)["logp"]
    expected = _transformers_logprobs(runs / f"hf_{family}")
    diff = (got - expected).abs().max().item()
    print(f"\n[{family} {pool}] megatron vs transformers log-prob max |diff| {diff:.2e}")
    assert diff < LOGPROB_TOL


@pytest.mark.claim("model-path-any-layout", "family-one-registration")
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_hugging_face_directory_loads_slice_by_slice_onto_each_rank(runs, family, pool):
    """``model.path``'s loader: each rank reads its own boxes of the safetensors shards (4 KB read
    blocks); the result equals the converted checkpoint's load and transformers' log-probs."""
    result = _result(runs, pool, family)
    assert result["direct_differs"] == []
    diff = (result["direct_logp"] - _transformers_logprobs(runs / f"hf_{family}")).abs().max().item()
    assert diff < LOGPROB_TOL
    total = sum(t.nbytes for t in hf_tensors(runs / f"hf_{family}").values())
    assert max(result["direct_share_bytes"]) < total  # no rank read the whole model


@pytest.mark.claim("convert-any-layout")
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_saves_what_the_converter_writes(runs, family, pool):
    _result(runs, pool, family)
    ours = DistReader(runs / f"mcore_{pool}_{family}")
    theirs = DistReader(runs / f"resaved_{pool}_{family}")
    shapes = lambda r: {k: (tuple(v.size), v.properties.dtype) for k, v in r.tensors().items()}  # noqa: E731
    assert shapes(ours) == shapes(theirs)
    assert sorted(ours.objects()) == sorted(theirs.objects())


@pytest.mark.claim("convert-round-trip")
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_saved_checkpoint_converts_back_bitwise(runs, family, pool, tmp_path):
    _result(runs, pool, family)
    original = runs / f"hf_{family}"
    back = tmp_path / "back"
    mcore_to_hf(runs / f"resaved_{pool}_{family}", back, hf_config=original, checksums=True)
    a, b = hf_tensors(original), hf_tensors(back)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
