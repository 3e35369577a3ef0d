"""A rank's error ends the job in one line, with no traceback, and leaves nothing in TMPDIR."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "hybridflow.cli", "train", "configs/quickstart_cpu.yaml"]

BAD_REWARD = """
def score(response, answer):
    raise KeyError("boom")
"""


@pytest.mark.slow
@pytest.mark.claim("rank-error-one-line", "nothing-left-in-tmpdir")
def test_a_reward_that_fails_under_on_error_fail_ends_the_job_in_one_line_and_leaves_no_temp_files(tmp_path):
    (tmp_path / "bad_reward.py").write_text(BAD_REWARD)
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is too long for the engines' sockets
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path), "TMPDIR": str(tmp)}
    overrides = [f"run.output_dir={tmp_path / 'run'}", "sft.steps=0", "run.steps=2", "run.heldout_prompts=0"]
    overrides += ["reward.function=bad_reward.score", "reward.on_error=fail"]
    try:
        done = subprocess.run([*TRAIN, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        left = sorted(p.name for p in tmp.iterdir())  # no torchelastic_*, tmp*, hybridflow-job-* left
    finally:
        shutil.rmtree(tmp)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "failed (exitcode" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: rank ") and " failed: RewardError: reward 'bad_reward.score' " in last
    assert "set reward.on_error=zero" in last
    assert left in ([], [f"torchinductor_{getpass.getuser()}"]), left  # torch's own cache, where torch keeps it


@pytest.mark.claim("nothing-left-in-tmpdir")
def test_a_job_tmpdir_goes_with_its_job_and_a_killed_launchers_is_swept(tmp_path, monkeypatch):
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


@pytest.mark.claim("compile-cache-kept")
def test_every_job_reads_and_writes_torchs_compile_cache_where_torch_keeps_it(tmp_path, monkeypatch):
    from launch import torchrun

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache = tmp_path / f"torchinductor_{getpass.getuser()}"
    with torchrun._job_tmpdir() as job:
        monkeypatch.setattr(tempfile, "tempdir", job)  # what the job's processes see as TMPDIR
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        (Path(default_cache_dir()) / "compiled.so").write_text("kernel")
    assert not Path(job).exists() and (cache / "compiled.so").read_text() == "kernel"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with torchrun._job_tmpdir() as job:  # the next job finds it
        assert (Path(job) / cache.name / "compiled.so").read_text() == "kernel"
    assert (cache / "compiled.so").exists()


@pytest.mark.claim("long-tmpdir-refused")
def test_a_tmpdir_too_long_for_the_engines_sockets_is_refused_in_one_line_before_anything_runs(tmp_path):
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    env = {**os.environ, "TMPDIR": str(deep)}
    done = subprocess.run(
        [*TRAIN, f"run.output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert (
        line.startswith(f"hybridflow train: error: TMPDIR={deep} is too long: ") and "set TMPDIR to a shorter" in line
    )
    assert list(deep.iterdir()) == []
