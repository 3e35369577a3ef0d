"""LoRA adapters under TP=2, EP=2, ETP=2 and PP=2 train exactly as in one process; the base stays frozen.

Two torchrun pools (``lora_worker.py``): one process saves each case's initial state (base and
adapters) and trains two steps, then checks that a LoRA checkpoint resumes; two processes load
that state under TP=2 (dense llama and qwen2 with attention + MLP adapters; qwen3_moe with
attention and expert adapters), PP=2 (llama), EP=2 and ETP=2 (qwen3_moe, ETP with and without
TP) and train the same two steps; every layout's merged weights (what the engine is pushed) must
equal W + s B A of the whole adapters. With adapter dropout, TP=2, PP=2 and TP=2 x ETP=2 train
as one process with dropout does (the masks are keyed, not drawn per rank), and a resumed step
draws the masks again.
The two-process pool also trains converted HF models and exports PEFT files, which transformers +
peft must score as the trainer does: llama under TP=2; qwen3_moe and mixtral under EP=2 with
attention and routed-expert adapters (PEFT's ``target_parameters`` on transformers' fused
tensors); deepseek_v3 under TP=2 with adapters on MLA's output projection, the dense layer's MLP,
the shared experts and the routed experts. Each run's LoRA checkpoint also goes through the
offline converters: ``mcore_to_peft`` must write the same files as the live export, and
``mcore_to_hf(merge_lora=True)`` weights that transformers alone scores as the trainer does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_adapters.convert import hf_to_mcore, mcore_to_hf
from tests.megatron_adapters.convert_models import MOE_FAMILIES, make_hf_dir
from tests.megatron_adapters.pools import run_pool

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("lora_worker.py")
TOL = 1e-5
ADAM_TOL = TOL + 0.02 * 1e-3 * 2
"""Adapters after the two Adam steps (lr 1e-3, ``worker.TRAIN``) of layouts whose gradients agree
within TOL. Adam divides each gradient by its running RMS, so a near-zero gradient's rounding
moves its weight by a share of lr: an expert's 3.08e-8 against 3.33e-8 (both within TOL) moved it
1.2e-5 apart under TP=2 x ETP=2 on one CPU (1.2% of lr). The log-probs after the steps stay within TOL."""
PEFT_TOL = 1e-4
"""fp32 megatron-core vs fp32 transformers (as the converter tests)."""
DENSE = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
TARGETS = {
    "llama": DENSE,
    "qwen2": DENSE,  # qwen2: biased qkv, tied embeddings
    "qwen3_moe": ["linear_qkv", "linear_proj", "experts"],
}
PEFT_TARGETS = {
    **TARGETS,
    "mixtral": ["linear_qkv", "linear_proj", "experts"],
    # MLA has no linear_qkv; layer 0 is dense (linear_fc1/2), the others shared + routed experts
    "deepseek_v3": ["linear_proj", "linear_fc1", "linear_fc2", "experts", "shared_experts"],
}
CASES = {
    "llama_tp2": ("llama", {"tp": 2}),
    "qwen2_tp2": ("qwen2", {"tp": 2}),
    "llama_pp2": ("llama", {"pp": 2}),
    "qwen3_moe_tp2": ("qwen3_moe", {"tp": 2, "etp": 1}),
    "qwen3_moe_ep2": ("qwen3_moe", {"ep": 2}),
    # experts split over etp: their adapters split the rank dim too (megatron_adapters/lora.py)
    "qwen3_moe_etp2": ("qwen3_moe", {"etp": 2}),
    "qwen3_moe_tp2_etp2": ("qwen3_moe", {"tp": 2, "etp": 2}),
}
DROPOUT = 0.1
DROPOUT_CASES = {  # keyed masks: every layout draws the masks one process draws (megatron_adapters/lora.py)
    "llama_tp2_dropout": ("llama", {"tp": 2}),
    "llama_pp2_dropout": ("llama", {"pp": 2}),
    "qwen3_moe_tp2_etp2_dropout": ("qwen3_moe", {"tp": 2, "etp": 2}),
}
DROPOUT_REFS = sorted({f for f, _ in DROPOUT_CASES.values()})
PEFT_CASES = {
    "llama": {"tp": 2},
    "qwen3_moe": {"ep": 2},  # EP=2: each rank holds half the experts' adapters
    "mixtral": {"ep": 2},
    "deepseek_v3": {"tp": 2, "etp": 1},
}


def _torchrun(nproc: int, tasks: list[dict], workdir: Path, label: str) -> None:
    run_pool(WORKER, nproc, tasks, workdir, label, timeout=800)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("lora_runs")
    refs = [
        {
            "kind": "lora_reference",
            "family": f,
            "targets": t,
            "init_dir": str(work / f"init_{f}"),
            "resume_dir": str(work / f"resume_{f}"),
            "out": str(work / f"{f}_ref.pt"),
        }
        for f, t in TARGETS.items()
    ]
    refs += [
        {
            "kind": "lora_reference",
            "family": f,
            "targets": TARGETS[f],
            "init_dir": str(work / f"init_{f}_dropout"),
            "resume_dir": str(work / f"resume_{f}_dropout"),
            "out": str(work / f"{f}_dropout_ref.pt"),
            "dropout": DROPOUT,
        }
        for f in DROPOUT_REFS
    ]
    cases = [
        {
            "kind": "lora_equivalence",
            "family": f,
            "spec": spec,
            "targets": TARGETS[f],
            "init_dir": str(work / f"init_{f}"),
            "save_dir": str(work / f"saved_{name}"),
            "out": str(work / f"{name}.pt"),
        }
        for name, (f, spec) in CASES.items()
    ]
    cases += [
        {
            "kind": "lora_equivalence",
            "family": f,
            "spec": spec,
            "targets": TARGETS[f],
            "init_dir": str(work / f"init_{f}_dropout"),
            "save_dir": str(work / f"saved_{name}"),
            "out": str(work / f"{name}.pt"),
            "dropout": DROPOUT,
        }
        for name, (f, spec) in DROPOUT_CASES.items()
    ]
    for f, spec in PEFT_CASES.items():
        hf = make_hf_dir(work, f)
        hf_to_mcore(hf, work / f"mcore_{f}")
        cases.append(
            {
                "kind": "peft_roundtrip",
                "hf_dir": str(hf),
                "mcore_dir": str(work / f"mcore_{f}"),
                "spec": spec,
                "targets": PEFT_TARGETS[f],
                "peft_dir": str(work / f"peft_{f}"),
                "lora_dir": str(work / f"lora_{f}"),
                "out": str(work / f"peft_{f}.pt"),
            }
        )
    _torchrun(1, refs, work, "world1")
    _torchrun(2, cases, work, "world2")
    results = {"dir": work}
    for name in [
        *(f"{f}_ref" for f in TARGETS),
        *(f"{f}_dropout_ref" for f in DROPOUT_REFS),
        *CASES,
        *DROPOUT_CASES,
        *(f"peft_{f}" for f in PEFT_CASES),
    ]:
        result = torch.load(work / f"{name}.pt")
        if "exception" in result:
            pytest.fail(f"worker task {name} raised:\n{result['exception']}")
        results[name] = result
    return results


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.claim("lora-base-frozen")
@pytest.mark.parametrize("family", list(TARGETS))
def test_reference_starts_at_the_base_and_freezes_it(runs, family: str) -> None:
    ref = runs[f"{family}_ref"]
    assert torch.equal(ref["logp_before"], ref["base_logp"])  # B = 0: step 0 is the base model
    assert ref["base_identical"] and not ref["base_requires_grad"]
    # megatron's DDP and optimizer see the adapters only
    assert ref["optimizer_numel"] == ref["adapter_numel"] == ref["grad_buffer_numel"]
    assert (ref["logp_after"] - ref["logp_before"]).abs().max() > 1e-3  # the adapters learned


@pytest.mark.claim("lora-dropout-keyed")
@pytest.mark.parametrize("family", list(DROPOUT_REFS))
def test_dropout_masks_change_the_training_and_resume_with_the_step(runs, family: str) -> None:
    plain, dropped = runs[f"{family}_ref"], runs[f"{family}_dropout_ref"]
    assert torch.equal(plain["logp_before"], dropped["logp_before"])  # the same start, eval mode
    # B = 0 at the start: the first loss is the base's either way, but B's gradient sees the masks
    assert _max_diff(plain["steps"][0]["grads"], dropped["steps"][0]["grads"]) > 1e-4
    assert abs(plain["steps"][1]["loss"] - dropped["steps"][1]["loss"]) > 1e-4
    assert dropped["base_identical"]
    # the resumed step draws the masks of the step it repeats (the scheduler's step is saved)
    assert _max_diff(dropped["resumed_adapters"], dropped["adapters"]) <= TOL


@pytest.mark.parametrize("family", list(TARGETS))
def test_resume_from_a_lora_checkpoint(runs, family: str) -> None:
    ref = runs[f"{family}_ref"]
    assert _max_diff(ref["resumed_adapters"], ref["adapters"]) <= TOL
    assert "holds LoRA adapters" in ref["refused"]  # not silently into a policy without adapters


@pytest.mark.claim("convert-lora-outputs")
def test_converter_refuses_a_lora_checkpoint(runs, tmp_path) -> None:
    with pytest.raises(ValueError, match="LoRA run's checkpoint"):
        mcore_to_hf(runs["dir"] / "resume_llama", tmp_path / "hf")


@pytest.mark.claim("lora-layouts-equal-one-process", "lora-dropout-keyed", "lora-base-frozen")
@pytest.mark.parametrize("name", [*CASES, *DROPOUT_CASES])
def test_layout_equals_one_process(runs, name: str) -> None:
    family = {**CASES, **DROPOUT_CASES}[name][0]
    ref, got = runs[f"{family}_dropout_ref" if name in DROPOUT_CASES else f"{family}_ref"], runs[name]
    assert got["base_identical"] and not got["base_requires_grad"]
    assert (got["logp_before"] - ref["logp_before"]).abs().max() <= TOL
    for mine, theirs in zip(got["steps"], ref["steps"]):
        assert abs(mine["loss"] - theirs["loss"]) <= TOL
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= TOL
        assert _max_diff(mine["grads"], theirs["grads"]) <= TOL
    assert _max_diff(got["adapters"], ref["adapters"]) <= ADAM_TOL
    assert (got["logp_after"] - ref["logp_after"]).abs().max() <= TOL
    assert got["merge_error"] <= 1e-6 and ref["merge_error"] <= 1e-6  # the weights the engine is pushed
    assert _max_diff(got["saved_adapters"], got["adapters"]) == 0  # as saved: whole, whatever the layout


def _scores(net, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of each token of ``ids`` given those before it (0 at the first), as the trainer's."""
    with torch.no_grad():
        logp = torch.log_softmax(net(input_ids=ids).logits.float(), dim=-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)


ADAPTER_GROUPS = {  # lora_B names of transformers + peft per target whose effect is checked alone
    "experts": lambda name: ".mlp.experts." in name,
    "shared_experts": lambda name: ".mlp.shared_experts." in name,
    "linear_fc1": lambda name: ".mlp.gate_proj." in name or ".mlp.up_proj." in name,  # a MoE family's dense layer
    "linear_fc2": lambda name: ".mlp.down_proj." in name,
}


@pytest.mark.claim("lora-peft-files")
@pytest.mark.parametrize("family", list(PEFT_CASES))
def test_peft_files_load_into_transformers_and_score_as_the_trainer(runs, family: str) -> None:
    """The TP=2 / EP=2 trainer's adapters as PEFT files on transformers' model of the converted weights."""
    import json

    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    work, got, peft_dir = runs["dir"], runs[f"peft_{family}"], runs["dir"] / f"peft_{family}"
    targets = PEFT_TARGETS[family]
    # the whole base stayed as the files' base model: DeepSeek's expert bias too (3 MoE layers)
    assert got["base_identical"] and got["expert_biases"] == (3 if family == "deepseek_v3" else 0)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    parameters = set(config["target_parameters"] or [])
    if "experts" in targets:  # the fused expert tensors are parameters, attention stays modules
        assert {"mlp.experts.down_proj", "mlp.experts.gate_up_proj"} <= parameters
    if "shared_experts" in targets:  # named as parameters: PEFT would move gate_proj & co onto the experts
        assert {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.down_proj.weight"} <= parameters
        assert not {"gate_proj", "up_proj", "down_proj"} & set(config["target_modules"])
    assert "o_proj" in config["target_modules"]
    net = AutoModelForCausalLM.from_pretrained(str(work / f"hf_{family}"), dtype=torch.float32)
    net = PeftModel.from_pretrained(net, str(peft_dir)).eval()
    # every tensor of the file found its PEFT parameter (a missed one would keep its init silently)
    assert get_peft_model_state_dict(net).keys() == load_file(str(peft_dir / "adapter_model.safetensors")).keys()
    ids = got["input_ids"]
    logp = _scores(net, ids)
    print(f"{family}: max |trainer - transformers+peft| log-prob = {(got['logp'] - logp).abs().max().item():.3g}")
    assert (got["logp"] - logp).abs().max() <= PEFT_TOL
    with net.disable_adapter():  # the adapters matter: without them the scores differ
        assert (_scores(net, ids) - logp).abs().max() > 1e-3
    if family in MOE_FAMILIES:  # and each MoE target's adapters on their own: zeroing their B moves the scores
        params = dict(net.named_parameters())
        for target in set(targets) & set(ADAPTER_GROUPS):
            chosen = [n for n in params if ".lora_B." in n and ADAPTER_GROUPS[target](n)]
            saved = {n: params[n].detach().clone() for n in chosen}
            with torch.no_grad():
                for n in chosen:
                    params[n].zero_()
                moved = (_scores(net, ids) - logp).abs().max().item()
                for n in chosen:
                    params[n].copy_(saved[n])
            print(f"{family}: max log-prob change without the {target} adapters ({len(chosen)}) = {moved:.3g}")
            assert chosen and moved > 1e-3
    assert (got["imported_logp"] - got["logp"]).abs().max() <= TOL  # and they import back


@pytest.mark.claim("lora-peft-files", "convert-lora-outputs")
@pytest.mark.parametrize("family", list(PEFT_CASES))
def test_a_lora_checkpoint_converts_offline_to_peft_files_and_merged_weights(runs, family: str, tmp_path) -> None:
    """``mcore_to_peft`` reads the adapters from the run's checkpoint alone: the same files as the
    live export; ``mcore_to_hf(merge_lora=True)``: weights transformers scores as the trainer."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_adapters.convert import mcore_to_peft

    work, got = runs["dir"], runs[f"peft_{family}"]
    lora_dir, hf, live = work / f"lora_{family}", work / f"hf_{family}", work / f"peft_{family}"
    if family == "llama":  # and through the command line
        from hybridflow.cli import main

        assert (
            main(
                [
                    "convert",
                    "mcore-to-peft",
                    "--mcore",
                    str(lora_dir),
                    "--hf-config",
                    str(hf),
                    "--out",
                    str(tmp_path / "peft"),
                ]
            )
            == 0
        )
    else:
        mcore_to_peft(lora_dir, tmp_path / "peft", hf_config=hf)
    offline = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    expected = load_file(str(live / "adapter_model.safetensors"))
    assert offline.keys() == expected.keys() and all(torch.equal(offline[k], expected[k]) for k in expected)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text()) == json.loads(
        (live / "adapter_config.json").read_text()
    )

    with pytest.raises(ValueError, match="--merge-lora"):  # the base alone would drop the training
        mcore_to_hf(lora_dir, tmp_path / "base", hf_config=hf)
    report = mcore_to_hf(lora_dir, tmp_path / "merged", hf_config=hf, merge_lora=True)
    assert any("merged" in check for check in report.checks)
    net = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    diff = (_scores(net, got["input_ids"]) - got["logp"]).abs().max().item()
    print(f"{family}: max |trainer - transformers on merged weights| log-prob = {diff:.3g}")
    assert diff <= PEFT_TOL


def test_offline_peft_refuses_a_checkpoint_without_adapters(runs, tmp_path) -> None:
    from megatron_adapters.convert import mcore_to_peft

    with pytest.raises(ValueError, match="no LoRA adapters"):
        mcore_to_peft(runs["dir"] / "mcore_llama", tmp_path / "peft")


def test_a_checkpoint_that_predates_stored_lora_settings_takes_them_from_the_run_config(tmp_path) -> None:
    import json

    from megatron_adapters.checkpoint import META_FILE, stored_lora

    actor = tmp_path / "step_000010" / "actor"
    actor.mkdir(parents=True)
    (actor / META_FILE).write_text(json.dumps({"lora": True}))
    with pytest.raises(ValueError, match="config.yaml is missing"):
        stored_lora(actor)
    (actor.parent / "config.yaml").write_text(
        "lora:\n  enabled: true\n  rank: 8\n  alpha: 4.0\n  target_modules: [linear_qkv]\n"
    )
    assert (stored_lora(actor).rank, stored_lora(actor).alpha) == (8, 4.0)
    (actor / META_FILE).write_text(json.dumps({"lora": None}))
    assert stored_lora(actor) is None
