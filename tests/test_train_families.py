"""``hybridflow train`` with ``model.path`` and no other ``model.*`` key, for each registered family.

Each family's directory is made as the hub ships a model (``tests/megatron_adapters/convert_models``:
transformers' ``save_pretrained`` weights in two safetensors shards with their index, a BPE
tokenizer with a Qwen-style chat template and special tokens, generation_config.json). The run
reads its architecture from config.json, its prompts are chat messages under the model's chat
template, and it trains one RL step under a split layout (PP=2 for a dense family, EP=2 for an
MoE one). At that step the trainer's log-probs of the sampled responses equal transformers' on
the same directory, and the engine's equal the trainer's (the run's own gate).

Every family runs under TP=2, and under EP=2 (MoE) or PP=2 (dense). The default tier runs qwen3
under PP=2, the family added last (dense, tied embeddings split over two pipeline stages), and
``tests/test_train_pretrained.py`` runs it under TP=2; the other cases are the slow tier's: their
loading under TP=2 x EP=2 and PP=2 is proven against transformers in the default tier by
``tests/megatron_adapters/test_convert_distributed.py``, and qwen3_moe's whole run from a
directory by ``tests/test_train_replicas.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hfschema.families import FAMILIES
from tests.dumped_logprobs import worst_difference
from tests.injection import environment
from tests.megatron_adapters.convert_models import make_hf_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
LOGPROB_TOL = 1e-4
DEFAULT_TIER = (("qwen3", "pp2"),)
PROMPTS = ["What is max(3, 8)?", "Which is larger, 12 or 7?", "Say hello.", "Count to three."]


LAYOUTS = {"tp2": {"tp": 2, "dp": 1}, "ep2": {"ep": 2, "dp": 2}, "pp2": {"pp": 2, "dp": 1}}
"""Every family under TP=2, and a MoE one under EP=2, a dense one under PP=2."""


def _cases() -> list:
    cases = []
    for family, spec in FAMILIES.items():
        for layout in ("tp2", "ep2" if spec.is_moe else "pp2"):
            marks = () if (family, layout) in DEFAULT_TIER else (pytest.mark.slow,)
            cases.append(pytest.param(family, layout, marks=marks, id=f"{family}-{layout}"))
    return cases


def _config(path: Path, data: Path, family: str, layout: str) -> dict:
    return {
        "model": {"path": str(path)},
        "actor": {"parallel": LAYOUTS[layout]},
        "rollout": _engine(family),
        "data": {"train_files": [str(data)], "max_prompt_length": 64, "max_response_length": 8},
        "sft": {"steps": 0},
        "algorithm": {"name": "grpo", "mini_batches": 1},
        "train": {"lr": 1.0e-4, "micro_batch_size": 4, "global_batch_size": 8},
        "reward": {"function": "math"},
        "run": {
            "name": f"family_{family}_{layout}",
            "steps": 1,
            "prompts_per_step": 4,
            "checkpoint_every": 0,
            "heldout_prompts": 0,
            "tracking": {"trackers": []},
        },
    }


def _engine(family: str) -> dict:
    """SGLang (tp=2); DeepSeek-V3's MLA does not start on SGLang's CPU engine, so its run here
    takes the transformers engine (its SGLang path is the GPU check's)."""
    if FAMILIES[family].attention == "mla":
        return {"engine": "hf", "tp": 1, "sync_route": "full", "dtype": "float32", "n": 2, "temperature": 1.0}
    return {"engine": "sglang", "tp": 2, "dtype": "float32", "n": 2, "temperature": 1.0, "max_total_tokens": 2048}


def _chat_rows(path: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": text}], "reward_model": {"ground_truth": "8"}} for text in PROMPTS
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.claim("model-path-every-family")
@pytest.mark.parametrize(("family", "layout"), _cases())
def test_a_run_from_a_hub_style_directory_scores_as_transformers(tmp_path: Path, family: str, layout: str) -> None:
    model_dir = make_hf_dir(tmp_path, family)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_config(model_dir, _chat_rows(tmp_path / "chat.jsonl"), family, layout)))
    out, dump = tmp_path / "run", tmp_path / "dump"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment(DUMP_LOGPROBS=str(dump))}
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(config), f"run.output_dir={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] < LOGPROB_TOL, summary  # engine vs trainer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst, scored = worst_difference(model, dump)
    assert scored > 0
    print(f"\n[{family} {layout}] trainer vs transformers, {scored} response tokens: max |diff| {worst:.2e}")
    assert worst < LOGPROB_TOL
    # the prompts went through the model's chat template: each row opens a user turn
    from transformers import AutoTokenizer

    start = AutoTokenizer.from_pretrained(str(model_dir)).convert_tokens_to_ids("<|im_start|>")
    firsts = {int(torch.load(part)["input_ids"][b][0]) for part in dump.glob("step_*/rank*.pt") for b in range(2)}
    assert firsts == {start}, firsts
