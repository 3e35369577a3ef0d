"""Resuming a run under another parallel layout continues from the same weights and optimizer.

A Qwen3-MoE run from a hub-style directory trains three RL steps under EP=2 (so DP=2), with a
checkpoint after each. Its step-1 checkpoint is then resumed twice, each in a copy of the run
directory: under TP=2 (EP=2 -> TP=2) and under PP=2 (DP=2 -> DP=1 x PP=2). The checkpoint
reshards on load (megatron's dist checkpointing), and:

- at step 1, the first after the resume, the resumed run scores the very rows the EP=2 run scored
  (the engine got the same weights, the sampling seed is the step's) with log-probs equal to the
  EP=2 run's within 1e-5: the same weights, read into another layout;
- at step 2 it again scores the EP=2 run's rows within 1e-5: the step-1 update, which used the
  Adam moments read from the checkpoint, moved the weights the same way;
- the run finishes, saves its final checkpoint, its summary names the changed keys, and its
  MLflow run (the same one) keeps the first layout as logged and dates the new one by the resume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from hybridflow.runtime.state import read_state
from hybridflow.runtime.tracking import default_tracking_uri
from tests.dumped_logprobs import layout_difference
from tests.injection import environment
from tests.megatron_adapters.convert_models import make_hf_dir
from tests.test_train_families import LAYOUTS, _chat_rows, _config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
STEPS = 3
SAME_LAYOUT_KEYS = {"tp": 1, "pp": 1, "ep": 1}
NEW_LAYOUT = {"tp2": "tp=2 pp=1 vpp=1 ep=1 ", "pp2": "tp=1 pp=2 vpp=1 ep=1 "}
"""How the tracking params describe each resumed layout (``ParallelLayout.describe``)."""


def _train(config: Path, out: Path, dump: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment(DUMP_LOGPROBS=str(dump))}
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(config), f"run.output_dir={out}", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _layout_overrides(layout: str) -> list[str]:
    keys = {**SAME_LAYOUT_KEYS, **LAYOUTS[layout]}
    return [f"actor.parallel.{key}={value}" for key, value in keys.items()]


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(config, run directory, dump) of the EP=2 run: three steps, a checkpoint after each."""
    root = tmp_path_factory.mktemp("resume_layout")
    config = _config(make_hf_dir(root, "qwen3_moe"), _chat_rows(root / "chat.jsonl"), "qwen3_moe", "ep2")
    config["run"].update(
        steps=STEPS, checkpoint_every=1, keep_checkpoints=STEPS, name="resume_layout", tracking={"trackers": ["mlflow"]}
    )
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out, dump = root / "ep2", root / "dump_ep2"
    _train(path, out, dump)
    return path, out, dump


@pytest.mark.claim("resume-into-another-layout")
# PP=2 (DP=2 -> DP=1 x PP=2) is the slow tier's: the default tier resumes a checkpoint under PP=2 in
# tests/megatron_adapters/test_equivalence.py (the TP2xEP2 checkpoint's weights under PP=2, its
# optimizer state without EP) and the run-level path here under TP=2
@pytest.mark.parametrize("layout", ["tp2", pytest.param("pp2", marks=pytest.mark.slow)])
def test_a_checkpoint_resumed_under_another_layout_continues_from_the_same_weights(
    ep2_run: tuple[Path, Path, Path], tmp_path: Path, layout: str
) -> None:
    config, ep2, ep2_dump = ep2_run
    out, dump = tmp_path / "run", tmp_path / "dump"
    shutil.copytree(ep2, out)
    for later in ("step_000002", "step_000003"):
        shutil.rmtree(out / "checkpoints" / later)
    before = {p: p.read_bytes() for p in (out / "checkpoints" / "step_000001").rglob("*") if p.is_file()}

    _train(config, out, dump, *_layout_overrides(layout))

    for step in (1, 2):
        worst, rows = layout_difference(ep2_dump / f"step_{step:06d}", dump / f"step_{step:06d}")
        print(f"\n[EP=2 -> {layout}] step {step}: {rows} rows, max |log-prob difference| {worst:.2e}")
        assert worst < TOL
    assert sorted(p.name for p in dump.iterdir()) == ["step_000001", "step_000002"]  # it resumed at step 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS, summary
    (change,) = summary["changed_on_resume"]
    assert change["step"] == 1 and any(line.startswith("actor.parallel.") for line in change["changed"]), change
    # one MLflow run, the first layout kept as logged and the new one dated by the resume
    run_id = read_state(out / "checkpoints" / f"step_{STEPS:06d}").mlflow_run_id
    params = mlflow.MlflowClient(tracking_uri=default_tracking_uri(out)).get_run(run_id).data.params
    assert params["actor_layout"].startswith("tp=1 pp=1 vpp=1 ep=2 "), params["actor_layout"]
    assert params["actor_layout.from_step_1"].startswith(NEW_LAYOUT[layout]), params
    # the checkpoint it resumed from is left as it was
    assert all(p.read_bytes() == data for p, data in before.items())
