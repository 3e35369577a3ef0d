"""Every layout computes what one process computes: log-probs, a training step, checkpoints.

The runs happen once per session in five torchrun pools (worlds of 1, 2, 4, 1, 2 processes),
in ``worker.py``; the tests below only compare what they recorded:

1. one process: each family's initial weights (saved), log-probs, one Adam step, log-probs;
2. two processes: TP=2, PP=2, PP=2xVPP=2, EP=2, ETP=2 load those weights and do the same;
   scenarios train two steps under EP=2 (qwen3_moe) and TP=2 (llama), save with optimizer
   state, and train two more;
3. four processes: TP2xEP2 and PP2xEP2; a TP2xEP2 run that saves and continues, a fresh
   TP2xEP2 policy that resumes from it, and resumes of the two-process checkpoints at twice
   the data-parallel size;
4. one process: the TP2xEP2 checkpoint's weights under TP=1, and its optimizer state resumed
   without expert parallelism;
5. two processes: the TP2xEP2 checkpoint's weights under PP=2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.megatron_adapters.pools import run_pool

from .families import FAMILIES, MOE_FAMILIES

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]

WORKER = Path(__file__).with_name("worker.py")
LOGPROB_TOL = 1e-5
TWO_PROC = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}, "etp2": {"etp": 2}}
FOUR_PROC = {"tp2ep2": {"tp": 2, "ep": 2}, "pp2ep2": {"pp": 2, "ep": 2}}
EXPERT_ONLY = {"ep2", "etp2", "tp2ep2", "pp2ep2"}


def _cases(specs: dict) -> list[tuple[str, str, dict]]:
    return [
        (family, name, spec)
        for family in FAMILIES
        for name, spec in specs.items()
        if family in MOE_FAMILIES or name not in EXPERT_ONLY
    ]


def _torchrun(nproc: int, tasks: list[dict], workdir: Path, label: str, *, worker: Path = WORKER) -> None:
    run_pool(worker, nproc, tasks, workdir, label, timeout=1500)


class Runs:
    """Paths of the pools' results, and a loader that surfaces a task's exception."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir

    def out(self, name: str) -> str:
        return str(self.dir / f"{name}.pt")

    def init(self, family: str) -> str:
        return str(self.dir / f"init_{family}")

    def ckpt(self, name: str) -> str:
        return str(self.dir / f"ckpt_{name}")

    def __getitem__(self, name: str) -> dict:
        result = torch.load(self.out(name))
        if "exception" in result:
            pytest.fail(f"worker task {name} raised:\n{result['exception']}")
        return result


def _pool_tasks(runs: Runs) -> list[tuple[int, list[dict]]]:
    def eq(family, name, spec):
        return {"kind": "equivalence", "family": family, "spec": spec, "init_dir": runs.init(family), "out": runs.out(f"{family}_{name}")}

    q, ll = "qwen3_moe", "llama"
    pool1 = [{"kind": "reference", "family": f, "init_dir": runs.init(f), "out": runs.out(f"{f}_ref")} for f in FAMILIES]
    pool2 = [eq(*case) for case in _cases(TWO_PROC)] + [
        eq(q, "pp2vpp2", {"pp": 2, "vpp": 2}),
        {"kind": "global_layers", "family": q, "spec": {"pp": 2, "vpp": 2}, "out": runs.out("global_layers_pp2vpp2")},
        {"kind": "fused_scores", "seed": 0, "out": runs.out("fused_scores_tp2")},
        {"kind": "train_and_save", "family": q, "spec": {"ep": 2}, "init_dir": runs.init(q), "save_dir": runs.ckpt("q_ep2"), "steps": 2, "more": 2, "out": runs.out("save_q_ep2")},
        {"kind": "train_and_save", "family": ll, "spec": {"tp": 2}, "init_dir": runs.init(ll), "save_dir": runs.ckpt("l_tp2"), "steps": 2, "more": 2, "out": runs.out("save_l_tp2")},
    ]
    pool4 = [eq(*case) for case in _cases(FOUR_PROC)] + [
        {"kind": "train_and_save", "family": q, "spec": {"tp": 2, "ep": 2}, "init_dir": runs.init(q), "save_dir": runs.ckpt("q_tp2ep2"), "steps": 2, "more": 2, "out": runs.out("save_q_tp2ep2")},
        {"kind": "resume", "family": q, "spec": {"tp": 2, "ep": 2}, "save_dir": runs.ckpt("q_tp2ep2"), "more": 2, "out": runs.out("resume_q_tp2ep2")},
        {"kind": "resume", "family": q, "spec": {"ep": 2}, "save_dir": runs.ckpt("q_ep2"), "more": 2, "out": runs.out("resume_q_ep2_dp4")},
        {"kind": "resume", "family": ll, "spec": {"tp": 2}, "save_dir": runs.ckpt("l_tp2"), "more": 2, "out": runs.out("resume_l_tp2_dp2")},
    ]
    pool1b = [
        {"kind": "load_weights", "family": q, "spec": {}, "save_dir": runs.ckpt("q_tp2ep2"), "out": runs.out("load_q_tp1")},
        {"kind": "resume", "family": q, "spec": {}, "save_dir": runs.ckpt("q_tp2ep2"), "more": 2, "out": runs.out("resume_q_tp1")},
    ]
    pool2b = [{"kind": "load_weights", "family": q, "spec": {"pp": 2}, "save_dir": runs.ckpt("q_tp2ep2"), "out": runs.out("load_q_pp2")}]
    return [(1, pool1), (2, pool2), (4, pool4), (1, pool1b), (2, pool2b)]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("megatron_runs"))
    for index, (nproc, tasks) in enumerate(_pool_tasks(runs)):
        _torchrun(nproc, tasks, runs.dir, f"pool{index}_world{nproc}")
    return runs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.claim("megatron-families-equal-one-process", "megatron-corrections")
@pytest.mark.parametrize("family,name,spec", _cases({**TWO_PROC, **FOUR_PROC}), ids=lambda v: v if isinstance(v, str) else None)
def test_layout_matches_single_process(runs: Runs, family: str, name: str, spec: dict) -> None:
    ref, got = runs[f"{family}_ref"], runs[f"{family}_{name}"]
    assert _max_diff(got["before"], ref["before"]) < LOGPROB_TOL
    assert _max_diff(got["entropy_before"], ref["entropy_before"]) < LOGPROB_TOL
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert got["entropy"] == pytest.approx(ref["entropy"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert _max_diff(got["after"], ref["after"]) < LOGPROB_TOL
    # The step must have moved the weights, or "after" would trivially match.
    assert _max_diff(ref["after"], ref["before"]) > 1e-3


@pytest.mark.claim("megatron-families-equal-one-process")
@pytest.mark.parametrize("family", FAMILIES)
def test_vocab_parallel_scores_equal_full_softmax(runs: Runs, family: str) -> None:
    """Masked-padding log-probs and entropy equal log_softmax over the real vocabulary."""
    ref = runs[f"{family}_ref"]
    assert _max_diff(ref["before"], ref["direct_logp"]) < 1e-5
    assert _max_diff(ref["entropy_before"], ref["direct_entropy"]) < 1e-5
    # The tiny vocab (250) is padded to 256 or more: the padding must not leak into the sum.
    assert ref["entropy_before"][:, 1:].max() < torch.log(torch.tensor(250.0)) + 1e-4


@pytest.mark.claim("megatron-corrections")
def test_interleaved_pipeline_matches_single_process(runs: Runs) -> None:
    ref, got = runs["qwen3_moe_ref"], runs["qwen3_moe_pp2vpp2"]
    assert _max_diff(got["before"], ref["before"]) < LOGPROB_TOL
    assert _max_diff(got["after"], ref["after"]) < LOGPROB_TOL


@pytest.mark.claim("checkpoints-any-layout")
def test_resume_same_layout_is_bit_exact(runs: Runs) -> None:
    saved, resumed = runs["save_q_tp2ep2"], runs["resume_q_tp2ep2"]
    assert resumed["meta_step"] == 2
    assert resumed["continued"] == saved["continued"]  # losses and grad norms, exactly
    assert torch.equal(resumed["final"], saved["final"])


@pytest.mark.claim("megatron-resume-layouts")
@pytest.mark.parametrize("saved,resumed", [("save_q_ep2", "resume_q_ep2_dp4"), ("save_l_tp2", "resume_l_tp2_dp2")])
def test_resume_at_twice_the_data_parallel_size(runs: Runs, saved: str, resumed: str) -> None:
    before, after = runs[saved], runs[resumed]
    for a, b in zip(after["continued"], before["continued"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert _max_diff(after["final"], before["final"]) < LOGPROB_TOL


@pytest.mark.claim("megatron-resume-layouts")
def test_resume_without_expert_parallelism(runs: Runs) -> None:
    saved, resumed = runs["save_q_tp2ep2"], runs["resume_q_tp1"]
    for a, b in zip(resumed["continued"], saved["continued"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert _max_diff(resumed["final"], saved["final"]) < LOGPROB_TOL


@pytest.mark.claim("checkpoints-any-layout")
@pytest.mark.parametrize("name", ["load_q_tp1", "load_q_pp2"])
def test_tp2ep2_checkpoint_loads_under_other_layouts(runs: Runs, name: str) -> None:
    assert _max_diff(runs[name]["logp"], runs["save_q_tp2ep2"]["at_save"]) < LOGPROB_TOL


def test_export_names_use_global_layer_numbers(runs: Runs) -> None:
    """Rank 0 of PP=2 x VPP=2 over 4 layers holds layers 0 and 2, named as the planner names them."""
    got = runs["global_layers_pp2vpp2"]
    assert got["layers"] == [0, 2]
    assert "embedding.word_embeddings.weight" in got["names"]
    assert "decoder.layers.2.mlp.router.weight" in got["names"]


@pytest.mark.claim("megatron-families-equal-one-process")
def test_the_vocabulary_split_over_two_ranks_gives_the_same_scores_and_gradient(runs) -> None:
    """The equivalence pool's two-rank task (``worker.fused_scores``): three reductions over the
    TP group give each rank the whole vocabulary's numbers, and each its own slice's gradient."""
    got = runs["fused_scores_tp2"]
    from tests.megatron_adapters.test_logprobs import case, reference

    logits, labels, weight_logp, weight_entropy = case(0)
    theirs = logits.clone().requires_grad_(True)
    ref_logp, ref_entropy = reference(theirs, labels)
    (ref_logp * weight_logp + ref_entropy * weight_entropy).sum().backward()
    assert torch.allclose(got["logp"], ref_logp, atol=1e-5) and torch.allclose(got["entropy"], ref_entropy, atol=1e-5)
    assert torch.allclose(got["grad"], theirs.grad, atol=1e-5)
