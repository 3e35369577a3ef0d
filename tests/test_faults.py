"""Surviving faults under torchrun: ranks SIGKILLed from outside, restarted, resumed, reproduced.

The reference is the uninterrupted short CPU quickstart (``tests/conftest.py``'s ``full_run``,
deterministic). A ``hybridflow launch`` of the same config (c10d rendezvous on this machine),
with ``--max-restarts N``, gets N SIGKILLs in a row from ``hybridflow.faults.FaultHarness``: each
at a random rank and a random step. Each time torchrun restarts the workers, they resume from
the newest complete checkpoint, and the run must end with the reference's metrics (all but the
wall-time ones) and weights.

    HYBRIDFLOW_FAULTS=5 HYBRIDFLOW_FAULT_SEED=7 pytest tests/test_faults.py -s

runs more faults in a row or replays a seed (default: random, printed with the report). CI runs
one (each costs a restart of every process, about two minutes on a loaded 2-core machine); a
second fault after a resume is the same path again.
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import pytest
import torch

from hybridflow.faults import FaultHarness, check_checkpoints, final_metrics
from tests.test_train import FULL_RUN
from tests.test_train import SHORT as TRAIN_SHORT

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")
SHORT = [*TRAIN_SHORT, *FULL_RUN]  # the config of full_run
STEPS, NPROC = 4, 2
FAULTS = int(os.environ.get("HYBRIDFLOW_FAULTS", "1"))
SEED = int(os.environ.get("HYBRIDFLOW_FAULT_SEED", random.SystemRandom().randrange(2**31)))


def _endpoint() -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--rdzv-endpoint", f"127.0.0.1:{port}"]


def _actor_tensors(out: Path, checkpoint: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = out.parent / f"{out.name}-{checkpoint}.pt"
    dcp_to_torch_save(out / "checkpoints" / checkpoint / "actor", target)
    return torch.load(target)


@pytest.mark.claim("max-restarts-resume", "fault-injection")
def test_killed_ranks_resume_and_reproduce_the_uninterrupted_run(full_run: Path, tmp_path: Path):
    harness = FaultHarness(
        CONFIG,
        SHORT,
        output_dir=tmp_path / "faulted",
        nproc=NPROC,
        steps=STEPS,
        faults=FAULTS,
        seed=SEED,
        timeout_s=1500,
        launch_args=_endpoint(),
    )
    report = harness.run()
    summary = report.as_dict()
    print(json.dumps(summary, indent=2))  # the numbers of this run: faults, steps lost, corrupt checkpoints
    log = Path(report.log).read_text(errors="replace")
    assert report.returncode == 0, log[-4000:]
    assert "rendezvous 127.0.0.1:" in log  # over c10d, as a multi-node job rendezvous
    assert report.faults_injected == FAULTS, summary
    assert report.corrupt_checkpoints == [] and check_checkpoints(tmp_path / "faulted") == [], summary
    assert not list((tmp_path / "faulted" / "checkpoints").glob("*.partial"))
    for kill in report.kills:
        # resumed from the newest complete checkpoint there was (0: the SFT one), never past the kill
        assert kill.resumed_from is not None, summary
        assert (kill.newest_checkpoint or 0) <= kill.resumed_from <= kill.steps_done, summary
    assert final_metrics(tmp_path / "faulted") == final_metrics(full_run)
    mine, theirs = _actor_tensors(tmp_path / "faulted", "step_000004"), _actor_tensors(full_run, "step_000004")
    assert mine.keys() == theirs.keys()
    weights = [name for name, value in theirs.items() if isinstance(value, torch.Tensor)]
    assert weights
    for name in weights:  # bit for bit
        assert torch.equal(mine[name], theirs[name]), name
