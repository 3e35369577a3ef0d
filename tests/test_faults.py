"""Surviving faults under torchrun: ranks SIGKILLed from outside, restarted, resumed, reproduced.

One uninterrupted ``hybridflow launch`` of the short CPU quickstart (c10d rendezvous on this
machine) is the reference. A second launch of the same config, with ``--max-restarts N``, gets N
SIGKILLs in a row from ``hybridflow.faults.FaultHarness``: each at a random rank and a random step.
Each time torchrun restarts the workers, they resume from the newest complete checkpoint, and
the run must end with the reference's metrics (all but the wall-time ones) and weights.

    HYBRIDFLOW_FAULTS=5 HYBRIDFLOW_FAULT_SEED=7 pytest tests/test_faults.py -s

runs more faults (default 2) or replays a seed (default: random, printed with the report).
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import pytest
import torch

from hybridflow.faults import FaultHarness, check_checkpoints, final_metrics, run_uninterrupted

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")
SHORT = ["run.steps=4", "sft.steps=4", "run.checkpoint_every=2", "run.keep_checkpoints=3",
         "run.heldout_prompts=16", "run.prompts_per_step=8", "rollout.n=4"]
STEPS, NPROC = 4, 2
FAULTS = int(os.environ.get("HYBRIDFLOW_FAULTS", "2"))
SEED = int(os.environ.get("HYBRIDFLOW_FAULT_SEED", random.SystemRandom().randrange(2**31)))


def _endpoint() -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--rdzv-endpoint", f"127.0.0.1:{port}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("launch") / "reference"
    done = run_uninterrupted(CONFIG, SHORT, output_dir=out, nproc=NPROC, launch_args=_endpoint(), timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "rendezvous 127.0.0.1:" in done.stdout
    return out


def _actor_tensors(out: Path, checkpoint: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = out.parent / f"{out.name}-{checkpoint}.pt"
    dcp_to_torch_save(out / "checkpoints" / checkpoint / "actor", target)
    return torch.load(target)


def test_an_uninterrupted_launch_over_c10d_completes(reference: Path):
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert check_checkpoints(reference) == []
    assert not list((reference / "checkpoints").glob("*.partial"))


def test_killed_ranks_resume_and_reproduce_the_uninterrupted_run(reference: Path, tmp_path: Path):
    harness = FaultHarness(CONFIG, SHORT, output_dir=tmp_path / "faulted", nproc=NPROC, steps=STEPS,
                           faults=FAULTS, seed=SEED, timeout_s=1500, launch_args=_endpoint())
    report = harness.run()
    summary = report.as_dict()
    print(json.dumps(summary, indent=2))  # the numbers of this run: faults, steps lost, corrupt checkpoints
    log_tail = Path(report.log).read_text(errors="replace")[-4000:]
    assert report.returncode == 0, log_tail
    assert report.faults_injected == FAULTS, summary
    assert report.corrupt_checkpoints == [], summary
    for kill in report.kills:
        # resumed from the newest complete checkpoint there was (0: the SFT one), never past the kill
        assert kill.resumed_from is not None, summary
        assert (kill.newest_checkpoint or 0) <= kill.resumed_from <= kill.steps_done, summary
    assert final_metrics(tmp_path / "faulted") == final_metrics(reference)
    mine, theirs = _actor_tensors(tmp_path / "faulted", "step_000004"), _actor_tensors(reference, "step_000004")
    assert mine.keys() == theirs.keys()
    weights = [name for name, value in theirs.items() if isinstance(value, torch.Tensor)]
    assert weights
    for name in weights:  # bit for bit
        assert torch.equal(mine[name], theirs[name]), name
