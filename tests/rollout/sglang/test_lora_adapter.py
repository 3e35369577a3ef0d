"""Adapter-only weight sync: SGLang's LoRA adapter API behind ``SGLangEngine.load_adapter``.

The CPU engine (tp=1 and tp=2, a tiny Qwen2) starts on the base weights with ``lora_args``; PEFT
directories made by ``peft`` itself (random A and B on every attention and MLP projection) are
loaded one after the other. Each phase's greedy responses are scored by transformers, with
``peft`` for the adapter phases: the engine must serve exactly the adapter it was last given,
and the base again once that one is unloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.rollout.sglang.reference import hf_logprobs, load_hf, tiny_model_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("lora_engine_worker.py")
ROOT = Path(__file__).resolve().parents[3]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[17, 250, 33, 94, 120], [7, 8, 9], [300, 12, 45, 66, 71, 88, 101]]
MAX_NEW = 6
LOGPROB_ATOL = 1e-4
"""As tests/rollout/sglang/test_engine.py: fp32 SGLang CPU kernels against fp32 transformers."""


def _adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A PEFT directory of rank-8 adapters with random A and B (``init_lora_weights=False``)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    net = get_peft_model(
        load_hf(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    )
    net.save_pretrained(str(out))
    return out


# tp=1 is the slow tier's: the same loading with the TP split left out (the default tier's
# separate and asynchronous LoRA runs serve adapters from tp=1 engines, scored against the trainer)
@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow), 2], ids=["tp1", "tp2"])
def served(request, tmp_path_factory):
    tp = request.param
    root = tmp_path_factory.mktemp(f"lora_tp{tp}")
    model_dir = tiny_model_dir(root, "qwen2", seed=0)
    adapters = [_adapter(model_dir, root / f"adapter{i}", seed=i) for i in (1, 2)]
    spec = root / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model_dir),
                "tp": tp,
                "adapters": [str(a) for a in adapters],
                "prompts": PROMPTS,
                "max_new": MAX_NEW,
                "out": str(root / "out.json"),
            }
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(spec)], env=env, capture_output=True, text=True, timeout=800, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    return model_dir, adapters, json.loads((root / "out.json").read_text())


def _max_diff(net, samples: list[dict]) -> float:
    worst = 0.0
    for prompt, sample in zip(PROMPTS, samples):
        expected = hf_logprobs(net, prompt, sample["response"])
        worst = max(worst, (torch.tensor(sample["logprobs"], dtype=torch.float64) - expected).abs().max().item())
    return worst


@pytest.mark.claim("lora-engine-serves-adapters")
def test_the_engine_serves_the_adapter_it_was_last_given(served) -> None:
    from peft import PeftModel

    model_dir, adapters, result = served
    phases = result["phases"]
    base = load_hf(model_dir)
    assert _max_diff(base, phases["base"]) <= LOGPROB_ATOL
    for index, adapter in enumerate(adapters, start=1):
        net = PeftModel.from_pretrained(load_hf(model_dir), str(adapter)).eval()
        diff = _max_diff(net, phases[f"adapter{index}"])
        print(f"adapter {index}: max |engine - transformers+peft| log-prob = {diff:.3g}")
        assert diff <= LOGPROB_ATOL
        assert _max_diff(base, phases[f"adapter{index}"]) > 1e-2  # and it is not the base
    assert _max_diff(base, phases["unloaded"]) <= LOGPROB_ATOL  # unloaded: the base again


@pytest.mark.claim("lora-engine-serves-adapters")
def test_a_push_is_the_adapters_bytes(served) -> None:
    from safetensors.torch import load_file

    _, adapters, result = served
    for push, adapter in zip(result["pushes"], adapters):
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        assert push["route"] == "adapter" and push["bytes"] == sum(t.nbytes for t in tensors.values())
