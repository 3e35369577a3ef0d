"""The learning matrix: six algorithms x three seeds each learn the CPU quickstart task.

Slow tier (18 runs of about a minute, and one SFT warm-up per seed), so deselected from the default
run (``pytest.ini``: ``-m "not slow"``):

    .venv/bin/python -m pytest -m slow tests/test_learning.py -s

Each run is the quickstart shortened to 150 SFT + 10 RL steps: the SFT warm-up learns to
compare the two numbers but, imitating noisy demonstrations, answers the smaller one about as
often as the larger; only RL on the verifier's reward can flip that preference, so the held-out
reward after RL must beat the one after SFT, for every algorithm and every seed. The six
algorithms of a seed start from one warm-up (``run.mode=sft`` with that seed, copied into each
run's directory, as ``tests/conftest.py``'s ``seeded`` does): the SFT is the same for all of them,
so it is trained once. Each run prints one JSON row (``-s`` shows them), the table the issue notes
quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train import WARM_UP, seed_from_warm_up, warm_up_run

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "dapo", "ppo", "vapo", "rloo", "gspo")
SEEDS = (1, 2, 3)
SHORT = (WARM_UP, "run.steps=10", "run.heldout_every=10", "run.checkpoint_every=10")


@pytest.fixture(scope="module")
def warm_ups(tmp_path_factory) -> dict[int, Path]:
    """Each seed's SFT warm-up, trained when a test first asks for it."""

    class WarmUps(dict):
        def __missing__(self, seed: int) -> Path:
            self[seed] = warm_up_run(tmp_path_factory, f"run.seed={seed}")
            return self[seed]

    return WarmUps()


@pytest.mark.claim("learning-matrix")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_algorithm_learns_the_task_beyond_its_sft_warm_up(
    tmp_path: Path, warm_ups, algorithm: str, seed: int
) -> None:
    out = seed_from_warm_up(warm_ups[seed], tmp_path / f"{algorithm}_{seed}")
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu.yaml",
        f"run.output_dir={out}",
        f"algorithm.name={algorithm}",
        f"run.seed={seed}",
        *SHORT,
    ]
    result = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1100
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    row = {
        "algorithm": algorithm,
        "seed": seed,
        "heldout_after_sft": summary["heldout_reward_after_sft"],
        "heldout_after_rl": summary["heldout_reward_after_rl"],
        "wall_s": round(summary["wall_seconds"]),
    }
    print("learning-row", json.dumps(row))
    assert row["heldout_after_rl"] > row["heldout_after_sft"], row
