"""The tests' fault hooks (``tests/injection.py``) reach a fresh interpreter through
``sitecustomize`` only when selected, and leave the product's functions alone otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.injection import FaultyEngine, environment

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import hybridflow.runtime.loop as l, hybridflow.runtime.replicas as r, hybridflow.runtime.sync as s, "
    "hybridflow.runtime.ops as o; print(l.run_step.__name__, r._attempt.__name__, s.EngineSync.push.__name__, "
    "o.OPS['old_logprob'].__name__)"
)


def _names(extra: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDFLOW_INJECT_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_selected_hooks_wrap_their_functions_in_every_new_interpreter_and_none_otherwise() -> None:
    selected = environment(RAISE_AT_STEP="1:1", KILL_ENGINE="0@3", KILL_ENGINE_PUSH="0@4", DUMP_LOGPROBS="/tmp/x")
    assert _names(selected) == ["faulty_run_step", "faulty_attempt", "faulty_push", "dumping"]
    assert _names(environment()) == ["run_step", "_attempt", "push", "old_logprob"]  # on the path, nothing chosen


class _Watch:
    def __init__(self, pid: int) -> None:
        self.pid, self.active = pid, False

    def schedulers(self) -> list[int]:
        return [self.pid]


class _Engine:
    """An engine whose generate waits, as a real one's does, while its "scheduler" runs."""

    def __init__(self, scheduler: subprocess.Popen) -> None:
        self.watch, self.scheduler, self.seeds = _Watch(scheduler.pid), scheduler, []

    def reseed(self, seed: int) -> None:
        self.seeds.append(seed)

    def generate(self, prompts, params):
        self.watch.active = True
        try:
            return self.scheduler.wait(timeout=30)
        finally:
            self.watch.active = False


def test_a_faulty_engine_loses_its_scheduler_during_its_next_generate_and_forwards_the_rest() -> None:
    scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real = _Engine(scheduler)
    faulty = FaultyEngine(real)
    faulty.reseed(7)
    assert real.seeds == [7] and scheduler.poll() is None  # armed, nothing killed yet
    assert faulty.generate([[1]], None) == -signal.SIGKILL  # killed while generate waited on it
