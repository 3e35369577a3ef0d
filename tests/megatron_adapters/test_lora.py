"""LoRA adapters under TP=2, EP=2 and PP=2 train exactly as in one process; the base stays frozen.

Two torchrun pools (``lora_worker.py``): one process saves each case's initial state (base and
adapters) and trains two steps, then checks that a LoRA checkpoint resumes; two processes load
that state under TP=2 (dense llama and qwen2 with attention + MLP adapters; qwen3_moe with
attention and expert adapters), PP=2 (llama) and EP=2 (qwen3_moe) and train the same two steps.
The two-process pool also trains converted HF models (llama under TP=2; qwen3_moe under EP=2 with
attention and routed-expert adapters) and exports PEFT files, which transformers + peft must score
as the trainer does; the experts go to PEFT's ``target_parameters`` on transformers' fused tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_adapters.convert import hf_to_mcore, mcore_to_hf
from tests.megatron_adapters.convert_models import make_hf_dir
from tests.megatron_adapters.pools import run_pool

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("lora_worker.py")
TOL = 1e-5
PEFT_TOL = 1e-4
"""fp32 megatron-core vs fp32 transformers (as the converter tests)."""
DENSE = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
TARGETS = {"llama": DENSE, "qwen2": DENSE,  # qwen2: biased qkv, tied embeddings
           "qwen3_moe": ["linear_qkv", "linear_proj", "experts"]}
CASES = {"llama_tp2": ("llama", {"tp": 2}), "qwen2_tp2": ("qwen2", {"tp": 2}), "llama_pp2": ("llama", {"pp": 2}),
         "qwen3_moe_tp2": ("qwen3_moe", {"tp": 2, "etp": 1}), "qwen3_moe_ep2": ("qwen3_moe", {"ep": 2})}
PEFT_CASES = {"llama": {"tp": 2}, "qwen3_moe": {"ep": 2}}  # EP=2: each rank holds half the experts' adapters


def _torchrun(nproc: int, tasks: list[dict], workdir: Path, label: str) -> None:
    run_pool(WORKER, nproc, tasks, workdir, label, timeout=800)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("lora_runs")
    refs = [{"kind": "lora_reference", "family": f, "targets": t, "init_dir": str(work / f"init_{f}"),
             "resume_dir": str(work / f"resume_{f}"), "out": str(work / f"{f}_ref.pt")} for f, t in TARGETS.items()]
    cases = [{"kind": "lora_equivalence", "family": f, "spec": spec, "targets": TARGETS[f],
              "init_dir": str(work / f"init_{f}"), "out": str(work / f"{name}.pt")} for name, (f, spec) in CASES.items()]
    for f, spec in PEFT_CASES.items():
        hf = make_hf_dir(work, f)
        hf_to_mcore(hf, work / f"mcore_{f}")
        cases.append({"kind": "peft_roundtrip", "hf_dir": str(hf), "mcore_dir": str(work / f"mcore_{f}"), "spec": spec,
                      "targets": TARGETS[f], "peft_dir": str(work / f"peft_{f}"), "out": str(work / f"peft_{f}.pt")})
    _torchrun(1, refs, work, "world1")
    _torchrun(2, cases, work, "world2")
    results = {"dir": work}
    for name in [*(f"{f}_ref" for f in TARGETS), *CASES, *(f"peft_{f}" for f in PEFT_CASES)]:
        result = torch.load(work / f"{name}.pt")
        if "exception" in result:
            pytest.fail(f"worker task {name} raised:\n{result['exception']}")
        results[name] = result
    return results


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("family", list(TARGETS))
def test_reference_starts_at_the_base_and_freezes_it(runs, family: str) -> None:
    ref = runs[f"{family}_ref"]
    assert torch.equal(ref["logp_before"], ref["base_logp"])  # B = 0: step 0 is the base model
    assert ref["base_identical"] and not ref["base_requires_grad"]
    # megatron's DDP and optimizer see the adapters only
    assert ref["optimizer_numel"] == ref["adapter_numel"] == ref["grad_buffer_numel"]
    assert (ref["logp_after"] - ref["logp_before"]).abs().max() > 1e-3  # the adapters learned


@pytest.mark.parametrize("family", list(TARGETS))
def test_resume_from_a_lora_checkpoint(runs, family: str) -> None:
    ref = runs[f"{family}_ref"]
    assert _max_diff(ref["resumed_adapters"], ref["adapters"]) <= TOL
    assert "holds LoRA adapters" in ref["refused"]  # not silently into a policy without adapters


def test_converter_refuses_a_lora_checkpoint(runs, tmp_path) -> None:
    with pytest.raises(ValueError, match="LoRA run's checkpoint"):
        mcore_to_hf(runs["dir"] / "resume_llama", tmp_path / "hf")


@pytest.mark.parametrize("name", list(CASES))
def test_layout_equals_one_process(runs, name: str) -> None:
    family = CASES[name][0]
    ref, got = runs[f"{family}_ref"], runs[name]
    assert got["base_identical"] and not got["base_requires_grad"]
    assert (got["logp_before"] - ref["logp_before"]).abs().max() <= TOL
    for mine, theirs in zip(got["steps"], ref["steps"]):
        assert abs(mine["loss"] - theirs["loss"]) <= TOL
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= TOL
        assert _max_diff(mine["grads"], theirs["grads"]) <= TOL
    assert _max_diff(got["adapters"], ref["adapters"]) <= TOL
    assert (got["logp_after"] - ref["logp_after"]).abs().max() <= TOL


@pytest.mark.parametrize("family", list(PEFT_CASES))
def test_peft_files_load_into_transformers_and_score_as_the_trainer(runs, family: str) -> None:
    """The TP=2 / EP=2 trainer's adapters as PEFT files on transformers' model of the converted weights."""
    import json

    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    work, got, peft_dir = runs["dir"], runs[f"peft_{family}"], runs["dir"] / f"peft_{family}"
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    if "experts" in TARGETS[family]:  # the fused expert tensors are parameters, attention stays modules
        assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert {"q_proj", "o_proj"} <= set(config["target_modules"])
    net = AutoModelForCausalLM.from_pretrained(str(work / f"hf_{family}"), dtype=torch.float32)
    net = PeftModel.from_pretrained(net, str(peft_dir)).eval()
    # every tensor of the file found its PEFT parameter (a missed one would keep its init silently)
    assert get_peft_model_state_dict(net).keys() == load_file(str(peft_dir / "adapter_model.safetensors")).keys()
    ids = got["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(net(input_ids=ids).logits.float(), dim=-1)
    expected = torch.cat([torch.zeros(ids.shape[0], 1), logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)
    print(f"{family}: max |trainer - transformers+peft| log-prob = {(got['logp'] - expected).abs().max().item():.3g}")
    assert (got["logp"] - expected).abs().max() <= PEFT_TOL
    with torch.no_grad():
        with net.disable_adapter():  # the adapters matter: without them the scores differ
            base = torch.log_softmax(net(input_ids=ids).logits.float(), dim=-1)
    assert (base - logp).abs().max() > 1e-3
    if "experts" in TARGETS[family]:  # and the expert adapters among them: zeroing their B moves the scores
        with torch.no_grad():
            for name, param in net.named_parameters():
                if ".mlp.experts." in name and ".lora_B." in name:
                    param.zero_()
            no_experts = torch.log_softmax(net(input_ids=ids).logits.float(), dim=-1)
        moved = (no_experts - logp).abs().max().item()
        print(f"{family}: max log-prob change without the expert adapters = {moved:.3g}")
        assert moved > 1e-3
    assert (got["imported_logp"] - got["logp"]).abs().max() <= TOL  # and they import back
