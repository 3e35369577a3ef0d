"""The tests' fault hooks (``tests/injection.py``) reach a fresh interpreter through
``sitecustomize`` only when selected, and leave the product's functions alone otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


class _Engine:
    def __init__(self) -> None:
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(prompts)
        return "samples"

    def reseed(self, seed: int) -> None:
        self.calls.append(("seed", seed))


def test_a_faulty_engine_fails_its_generate_and_passes_everything_else_to_the_real_one() -> None:
    real = _Engine()
    faulty = FaultyEngine(real, failure="simulated engine failure")
    faulty.reseed(7)
    with pytest.raises(RuntimeError, match="^simulated engine failure$"):
        faulty.generate([[1]], None)
    assert real.calls == [("seed", 7)]
    assert FaultyEngine(real).generate([[2]], None) == "samples" and real.calls[-1] == [[2]]
