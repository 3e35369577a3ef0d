"""Day 0: ``hybridflow train configs/quickstart_cpu_day0.yaml`` on an architecture no family maps.

A tiny OLMo2 as the hub ships it (several safetensors shards, their index, the tokenizer and chat
template), which no hybridflow family describes: its norms follow attention and the MLP, its q/k
norms span all heads. transformers' own Olmo2ForCausalLM is trained by FSDP2 over two CPU
processes, SGLang's Olmo2 model generates at tp=2, the weights reach it whole under their
checkpoint names. The run must learn as the quickstart does; what the engine answered before RL
(the SFT warm-up's export) and after it (the last checkpoint, converted) must be what transformers
answers from those weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import WARM_UP, _history, _ok
from tests.test_train_fsdp2 import heldout_rows, transformers_answers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10


@pytest.fixture(scope="module")
def day0_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("day0")
    make = [sys.executable, "scripts/tiny_hub_model.py", "olmo2", str(root / "olmo2")]  # as the docs say
    assert subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=300).returncode == 0
    assert len(list((root / "olmo2").glob("*.safetensors"))) >= 2
    run = (f"model.path={root / 'olmo2'}", f"run.output_dir={root / 'run'}", WARM_UP, f"run.steps={STEPS}")
    settings = ("run.deterministic=true", "run.tracking.trackers=[]", f"run.heldout_every={STEPS}")
    command = [sys.executable, "-m", "hybridflow.cli", "train", "configs/quickstart_cpu_day0.yaml", *run, *settings]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    _ok(result)
    assert "fsdp2 dp=2" in result.stdout  # the start line names the trainer that runs
    return root / "run"


@pytest.mark.claim("fsdp2-day0")
def test_an_unmapped_architecture_trains_from_its_hub_directory_and_learns(day0_run: Path) -> None:
    summary = json.loads((day0_run / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] <= 1e-4, summary  # SGLang holds the trainer's weights
    assert all(h["checks/failed"] == 0.0 for h in _history(day0_run, f"step_{STEPS:06d}"))
    after_sft, after_rl = summary["heldout_reward_after_sft"], summary["heldout_reward_after_rl"]
    assert after_rl >= after_sft + 0.3, (after_sft, after_rl)


@pytest.mark.claim("fsdp2-day0")
def test_its_heldout_answers_before_rl_are_transformers_answers(day0_run: Path) -> None:
    """The SFT warm-up's export (the weights the engine held at step 0), read by transformers."""
    rows = heldout_rows(day0_run, 0)
    answers = transformers_answers(day0_run / "checkpoints" / "sft" / "hf", rows)
    assert answers == [row["response"].strip() for row in rows]
    summary = json.loads((day0_run / "summary.json").read_text())
    assert sum(row["reward"] for row in rows) / len(rows) == pytest.approx(summary["heldout_reward_after_sft"])


@pytest.mark.claim("fsdp2-day0")
def test_its_export_loads_in_transformers_and_answers_as_the_engine_did(day0_run: Path, tmp_path: Path) -> None:
    actor, out = day0_run / "checkpoints" / f"step_{STEPS:06d}" / "actor", tmp_path / "hf"
    convert = [sys.executable, "-m", "hybridflow.cli", "convert", "fsdp2-to-hf", "--checkpoint", str(actor)]
    done = subprocess.run([*convert, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("olmo2", ["Olmo2ForCausalLM"])
    rows = heldout_rows(day0_run, STEPS)
    assert transformers_answers(out, rows) == [row["response"].strip() for row in rows]
