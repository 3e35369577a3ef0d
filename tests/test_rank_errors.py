"""A rank's error ends the job in one line, with no traceback, and leaves nothing in TMPDIR."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BAD_REWARD = """
def score(response, answer):
    raise KeyError("boom")
"""


@pytest.mark.slow
@pytest.mark.claim("rank-error-one-line", "nothing-left-in-tmpdir")
def test_a_reward_that_fails_under_on_error_fail_ends_the_job_in_one_line_and_leaves_no_temp_files(tmp_path):
    (tmp_path / "bad_reward.py").write_text(BAD_REWARD)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path), "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", "configs/quickstart_cpu.yaml"]
    overrides = [f"run.output_dir={tmp_path / 'run'}", "sft.steps=0", "run.steps=2", "run.heldout_prompts=0"]
    overrides += ["reward.function=bad_reward.score", "reward.on_error=fail"]
    done = subprocess.run([*cmd, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "failed (exitcode" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: rank ") and " failed: RewardError: reward 'bad_reward.score' " in last
    assert "set reward.on_error=zero" in last
    assert sorted(p.name for p in tmp.iterdir()) == []  # no torchelastic_*, tmp*, hybridflow-job-* left


@pytest.mark.claim("nothing-left-in-tmpdir")
def test_a_job_tmpdir_goes_with_its_job_and_a_killed_launchers_is_swept(tmp_path, monkeypatch):
    import tempfile

    from launch import torchrun

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{torchrun.JOB_TMP_PREFIX}{dead.pid}-abc"  # its launcher was SIGKILLed
    live = tmp_path / f"{torchrun.JOB_TMP_PREFIX}{os.getpid()}-xyz"  # another job of this process
    stale.mkdir()
    live.mkdir()
    with torchrun._job_tmpdir() as job:
        (Path(job) / "torchelastic_x").mkdir()
        assert not stale.exists() and live.exists()
    assert not Path(job).exists() and live.exists()
