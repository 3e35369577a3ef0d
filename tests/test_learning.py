"""The learning matrix: six algorithms x three seeds each learn the CPU quickstart task.

Slow (18 runs of about 90 s), so deselected from the default run (``pytest.ini``: ``-m "not slow"``):

    .venv/bin/python -m pytest -m slow tests/test_learning.py -s

Each run is the quickstart shortened to 150 SFT + 10 RL steps: the SFT warm-up learns to
compare the two numbers but, imitating noisy demonstrations, answers the smaller one about as
often as the larger; only RL on the verifier's reward can flip that preference, so the held-out
reward after RL must beat the one after SFT, for every algorithm and every seed. Each run prints
one JSON row (``-s`` shows them), the table the issue notes quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "dapo", "ppo", "vapo", "rloo", "gspo")
SEEDS = (1, 2, 3)
SHORT = ("sft.steps=150", "run.steps=10", "run.heldout_every=10", "run.checkpoint_every=10")


@pytest.mark.claim("learning-matrix")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_algorithm_learns_the_task_beyond_its_sft_warm_up(tmp_path: Path, algorithm: str, seed: int) -> None:
    out = tmp_path / f"{algorithm}_{seed}"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", "configs/quickstart_cpu.yaml",
           f"run.output_dir={out}", f"algorithm.name={algorithm}", f"run.seed={seed}", *SHORT]
    result = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=1100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    row = {"algorithm": algorithm, "seed": seed, "heldout_after_sft": summary["heldout_reward_after_sft"],
           "heldout_after_rl": summary["heldout_reward_after_rl"], "wall_s": round(summary["wall_seconds"])}
    print("learning-row", json.dumps(row))
    assert row["heldout_after_rl"] > row["heldout_after_sft"], row
