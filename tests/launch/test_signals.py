"""Clean stops and errors that surface, seen from outside as a user (or Slurm) sees them.

A stop signal to the launcher ends every process of the job within ``STOP_BOUND_S`` with exit
status 128 + the signal; a rank's error is the launcher's last line and ``error.txt``. The job's
processes are the command's descendants when the signal is sent, and any process that carries a
marker in its environment, which every descendant inherits (orphans and processes in other
sessions included; SGLang's renamed processes overwrite theirs, but are descendants).

The real runs use the transformers rollout engine (``rollout.engine=hf``): the cheapest that
starts the whole process tree of a run (the launcher, torchrun, two ranks, their checkpoint
helper processes); about a minute each, most of it imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from hybridflow.faults import check_checkpoints
from hybridflow.runtime import state
from launch.failures import ERROR_FILE
from launch.reaper import STOP_GRACE_S
from tests.injection import environment

ROOT = Path(__file__).resolve().parents[2]
STOP_BOUND_S = 30.0
"""The promise: every process of the job gone this long after the signal."""
MARKER = "HYBRIDFLOW_TEST_JOB"
CHEAP = [
    "rollout.engine=hf",
    "rollout.tp=1",
    "rollout.sync_route=full",
    "sft.steps=0",
    "run.heldout_prompts=4",
    "run.heldout_every=0",
    "run.prompts_per_step=2",
    "rollout.n=2",
]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
SLOW_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The real-run variants of one handler (``launch.reaper.STOP_SIGNALS`` and ``runtime.stops``
take all three alike): the default tier stops a run by SIGINT here, by SIGTERM through the
SGLang run below with the same checks, and each signal through the reaper's stand-in jobs."""


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


class Job:
    """A command started in its own session with a marker, its output in a log file."""

    def __init__(
        self, cmd: list[str], log: Path, env: dict[str, str] | None = None, ignoring: tuple[int, ...] = ()
    ) -> None:
        """``ignoring``: signals the command starts with ignored (as ``cmd &`` in a script
        starts it with SIGINT ignored, ``nohup`` with SIGHUP)."""
        self.marker, self.log, self.left = uuid.uuid4().hex, log, []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), MARKER: self.marker, **(env or {})}

        def ignore() -> None:
            for sig in ignoring:
                signal.signal(sig, signal.SIG_IGN)

        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignore
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text():
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {needle!r}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {needle!r} within {timeout_s:g} s:\n{self.text()[-3000:]}"
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """The command's descendants and every marked process."""
        found = {p.pid: p for p in _marked(self.marker)}
        try:
            found.update((p.pid, p) for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        return list(found.values())

    def stop(self, sig: int) -> tuple[int, float]:
        """Send ``sig`` to the command; (exit status, seconds until no process of the job is left)."""
        job = self.processes()
        assert len(job) > 1, "the job has not started its processes"
        sent = time.monotonic()
        self.proc.send_signal(sig)
        while (_alive(job) or _marked(self.marker)) and time.monotonic() - sent < STOP_BOUND_S + 10:
            time.sleep(0.2)
        gone_s = time.monotonic() - sent
        self.left = _alive(job)
        self.kill()
        return self.proc.wait(timeout=10), gone_s

    def kill(self) -> None:
        for proc in _marked(self.marker) + self.left:  # whatever outlived the bound: no test leaks it
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


# --- the reaper on stand-in jobs: seconds, no torch -------------------------------------------

_STAND_IN = textwrap.dedent("""
    import signal, subprocess, sys, time
    stubborn = sys.argv[1] == "stubborn"
    # a "rank" in a session of its own, as torchrun starts them, with a child of its own
    rank = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time;"
                             + ("signal.signal(signal.SIGTERM, signal.SIG_IGN);" if stubborn else "")
                             + "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
                             + "print('ranks up', flush=True); time.sleep(600)"], start_new_session=True)
    if stubborn:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
    time.sleep(600)
""")


def _launcher(mode: str) -> list[str]:
    code = (
        "import os, sys\nfrom launch.reaper import run_reaped\n"
        f"sys.exit(run_reaped([sys.executable, '-c', {_STAND_IN!r}, {mode!r}], os.environ).returncode)\n"
    )
    return [sys.executable, "-c", code]


def _stop_polite(tmp_path: Path, sig: int, ignoring: tuple[int, ...] = ()) -> Job:
    """The stand-in job whose ranks exit on the signal, stopped by ``sig``: gone within 10 s."""
    job = Job(_launcher("polite"), tmp_path / "job.log", ignoring=ignoring)
    try:
        job.wait_for("ranks up", timeout_s=30)
        code, gone_s = job.stop(sig)
    finally:
        job.kill()
    assert code == 128 + sig and gone_s < 10, (code, gone_s, job.text())
    return job


@pytest.mark.claim("stop-grace")
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_stops_a_job_that_exits_on_it(tmp_path, sig) -> None:
    job = _stop_polite(tmp_path, sig)
    assert "stopping the job" in job.text()


@pytest.mark.claim("stop-grace")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_launcher_started_with_the_signal_ignored_still_stops_the_job(tmp_path, sig) -> None:
    """A script's ``hybridflow train ... &`` starts with SIGINT ignored, ``nohup`` with SIGHUP;
    the ranks start with the stop signals at their default action, so the one the launcher
    forwards stops them (it would otherwise reach ranks that ignore it, and only the grace's
    SIGKILL would end the job)."""
    _stop_polite(tmp_path, sig, ignoring=(sig,))


@pytest.mark.claim("stop-grace")
def test_a_job_that_ignores_the_signal_is_killed_after_the_grace(tmp_path) -> None:
    job = Job(_launcher("stubborn"), tmp_path / "job.log")
    try:
        job.wait_for("ranks up", timeout_s=30)
        code, gone_s = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    assert code == 128 + signal.SIGTERM, job.text()
    assert STOP_GRACE_S - 1 < gone_s < STOP_BOUND_S, gone_s


# --- hybridflow train on the CPU quickstart ----------------------------------------------------


def _train(out: Path, *overrides: str, env: dict[str, str] | None = None) -> Job:
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu.yaml",
        f"run.output_dir={out}",
        *CHEAP,
        *overrides,
    ]
    return Job(cmd, out.with_name(out.name + ".log"), env)


@pytest.mark.claim("stop-signals", "stop-mid-checkpoint")
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig",
    [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SIGNALS else s for s in SIGNALS],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_signal_stops_every_process_of_hybridflow_train(tmp_path, sig) -> None:
    out = tmp_path / "run"
    job = _train(out, "run.steps=50", "run.checkpoint_every=1")  # a checkpoint is often being written
    try:
        job.wait_for("rl:")  # the ranks are training
        time.sleep(2.0)
        code, gone_s = job.stop(sig)
    finally:
        job.kill()
    _check_stopped(job, out, sig, code, gone_s)


def _check_stopped(job: Job, out: Path, sig: int, code: int, gone_s: float) -> None:
    """Stopped in time with 128 + sig, said once, no checkpoint left torn, no error file."""
    name = signal.Signals(sig).name
    assert code == 128 + sig, job.text()[-3000:]
    assert gone_s < STOP_BOUND_S, gone_s
    assert job.text().rstrip().splitlines()[-1] == f"hybridflow train: stopped by {name}; exit status {128 + sig}"
    # one line from the ranks (rank 0's), none of torchrun's signal warnings
    text = job.text()
    assert text.count(f"WARNING: stopped by {name}") <= 1, text[-3000:]
    assert "closing signal" not in text and "death signal" not in text, text[-3000:]
    assert check_checkpoints(out) == []  # every complete checkpoint is whole; a cut one stays .partial
    assert not (out / ERROR_FILE).exists()  # a stop is not a failure


@pytest.mark.claim("stop-signals")
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_sigterm_stops_the_sglang_engine_processes_too(tmp_path) -> None:
    """The quickstart's SGLang engine (tp=2): its scheduler and detokenizer processes, children
    of rank 0, go with the job (torchrun signals each rank's process group)."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu.yaml",
        f"run.output_dir={out}",
        "sft.steps=0",
        "run.steps=50",
        "run.heldout_prompts=4",
        "run.heldout_every=0",
        "run.prompts_per_step=2",
        "rollout.n=2",
    ]
    job = Job(cmd, tmp_path / "run.log")
    try:
        job.wait_for("rl:", timeout_s=400)
        titles = [" ".join(p.cmdline()) for p in job.processes()]
        assert any(t.startswith("sglang::scheduler") for t in titles), titles  # SGLang renames its processes
        code, gone_s = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    _check_stopped(job, out, signal.SIGTERM, code, gone_s)


@pytest.mark.claim("first-failure-named", "failure-traceback-kept")
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_failing_rank_is_the_last_line_and_the_error_file(tmp_path) -> None:
    """An op that raises in rank 1 at step 2 (``tests.injection``: ``RAISE_IN_STAGE``): the last
    line names the stage, the step and the file and line it was raised at; the record in the run
    directory and the rank's log hold the whole traceback."""
    out = tmp_path / "run"
    env = environment(RAISE_IN_STAGE="advantages:1:1")
    job = _train(out, "run.steps=3", "run.checkpoint_every=0", env=env)
    try:
        code = job.proc.wait(timeout=240)
    finally:
        job.kill()
    source = (ROOT / "tests" / "injection.py").read_text().splitlines()
    line_no = next(i for i, text in enumerate(source, 1) if "simulated bug in" in text)
    expected = (
        f"hybridflow train: rank 1 failed: IndexError in advantages, step 2 (tests/injection.py:{line_no}): "
        "HYBRIDFLOW_INJECT_RAISE_IN_STAGE=advantages:1:1: simulated bug in advantages; "
        "traceback in logs/errors/rank1.json"
    )
    lines = job.text().rstrip().splitlines()
    assert code == 1, lines[-30:]
    assert lines[-1] == expected
    # the failing rank's own traceback (its lines prefixed "[rank1]:") names the error too, and may
    # come last when rank 0 is killed before it prints; torchrun's block and ours must name it once
    ours = [line for line in lines if "simulated bug" in line and not line.startswith("[rank")]
    assert ours == [expected], ours
    assert (out / ERROR_FILE).read_text() == expected + "\n"
    record = json.loads((out / "logs" / "errors" / "rank1.json").read_text())
    assert record["context"] == "advantages, step 2" and "in run_step" in record["traceback"]
    assert record["traceback"].rstrip().endswith("simulated bug in advantages")
    log = (out / "logs" / "rank1.log").read_text()
    assert "rank failed" in log and "Traceback (most recent call last)" in log and "in raising" in log


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.claim("disk-full-named")
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_disk_that_fills_during_a_save_is_named_in_one_line_and_loses_nothing(tmp_path) -> None:
    """Every write into ``step_000002.partial`` fails with ENOSPC (``tests.injection``: ``DISK_FULL``)."""
    out = tmp_path / "run"
    first = _train(out, "run.steps=1", "run.checkpoint_every=1", "run.tracking.trackers=[]")
    assert first.proc.wait(timeout=240) == 0, first.text()[-3000:]
    kept = {
        p: data
        for p, data in _files(out).items()
        if p.name not in ("run.lock", "progress.json") and "logs" not in p.relative_to(out).parts
    }
    job = _train(
        out,
        "run.steps=3",
        "run.checkpoint_every=1",
        "run.tracking.trackers=[]",
        env=environment(DISK_FULL="step_000002.partial"),
    )
    try:
        code = job.proc.wait(timeout=240)
    finally:
        job.kill()
    lines = job.text().rstrip().splitlines()
    assert code == 1, lines[-30:]
    checkpoints = out / "checkpoints"
    assert lines[-1].startswith("hybridflow train: rank ") and (
        f"failed: DiskFull: no space left on the file system of {checkpoints}" in lines[-1]
    ), lines[-5:]
    assert (
        "while writing checkpoint step_000002.partial; it stays step_000002.partial, which resume never reads, "
        "and the newest complete checkpoint, step_000001, is kept; free space there"
    ) in lines[-1], lines[-1]
    assert (out / ERROR_FILE).read_text() == lines[-1] + "\n"
    assert (checkpoints / "step_000002.partial").is_dir() and not (checkpoints / "step_000002").exists()
    assert {p: p.read_bytes() for p in kept} == kept  # every file of the first start as it was
    assert state.find_resume(out, "auto").path == checkpoints / "step_000001"
    assert _marked(job.marker) == []
