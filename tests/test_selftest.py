"""The README's main job: `hybridflow selftest` trains, checkpoints and reloads under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_selftest_trains_and_reloads(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "selftest",
        str(ROOT / "configs/quickstart_cpu.yaml"),
        f"run.output_dir={tmp_path}",
        "--steps",
        "4",
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, cwd=tmp_path, timeout=500, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "selftest.json").read_text())
    assert summary["loss_fell"] and summary["last_loss"] < summary["first_loss"]
    assert summary["reload_max_logprob_diff"] < 1e-5
    assert (Path(summary["checkpoint"]) / "hybridflow.json").is_file()
    assert not list(tmp_path.glob("checkpoints/*.tmp"))  # the staging directory was renamed
    assert "result        OK" in result.stdout


def test_selftest_rejects_a_bad_config_before_starting_processes(capsys) -> None:
    from hybridflow.cli import main

    assert main(["selftest", str(ROOT / "configs/quickstart_cpu.yaml"), "actor.parallel.ep=3"]) == 2
    assert "actor.parallel" in capsys.readouterr().err
