"""An SGLang engine killed mid-generation is restarted, re-synced and the step goes on.

The quickstart run (EP=2 actor, one colocated SGLang tp=2 engine) with one of the engine's
scheduler processes SIGKILLed while step 2 generates (``HYBRIDFLOW_FAULT_KILL_ENGINE``): the
driver's watch sees the process gone, the engine is replaced, given the current weights, and the
call runs again with the same seeds, so the run's metrics are those of an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.runtime import recovery, replicas
from tests.test_train import _deterministic, _history, _ok, _train

QUICKSTART = "configs/quickstart_cpu.yaml"
STEPS = ["run.steps=4"]
KILLED = "rollout/engine_restarts"


@pytest.mark.distributed
@pytest.mark.timeout(1500)
def test_an_engine_killed_mid_step_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    # generate call 3 is step 2's (call 1 scored the held-out prompts after SFT)
    killed = _train(tmp_path / "killed", *STEPS, env={replicas.FAULT_KILL_ENV: "0@3"})
    _ok(killed)
    assert "lost its engine" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["engine_restarts"] == 1, summary
    history = _history(tmp_path / "killed", "step_000004")
    assert [h.get(KILLED, 0.0) for h in history] == [0.0, 1.0, 0.0, 0.0]

    _ok(_train(tmp_path / "whole", *STEPS))
    whole = _history(tmp_path / "whole", "step_000004")
    assert [{k: v for k, v in h.items() if k != KILLED} for h in _deterministic(history)] == _deterministic(whole)


def test_past_the_limit_the_run_stops_in_one_line_naming_the_replica_cause_and_setting() -> None:
    cfg = load_config(QUICKSTART, ["rollout.max_engine_restarts=2"])
    lost = [(0, 0, "process 123 (sglang::scheduler_TP1) was killed by SIGKILL during generate")]
    recovery.check_restart(cfg, lost, used=1)  # the second restart is within the budget
    with pytest.raises(replicas.ReplicaFailed) as stop:
        recovery.check_restart(cfg, lost, used=2)
    message = str(stop.value)
    assert "\n" not in message
    assert message.startswith("rollout replica 0 (driven by rank 0) lost its engine: process 123 "
                              "(sglang::scheduler_TP1) was killed by SIGKILL during generate;"), message
    assert "2 of rollout.max_engine_restarts=2 restarts used: raise rollout.max_engine_restarts" in message
    none = load_config(QUICKSTART, ["rollout.max_engine_restarts=0"])
    hung = [(2, 1, "generate hung: no answer within rollout.generate_timeout_s=600 s")]
    with pytest.raises(replicas.ReplicaFailed, match=r"replica 1 \(driven by rank 2\) lost its engine: generate "
                                                     r"hung: .*rollout.max_engine_restarts=0"):
        recovery.check_restart(none, hung, used=0)


def test_restarts_are_refused_by_name_where_they_are_not_supported() -> None:
    cfg = load_config(QUICKSTART, ["rollout.placement=separate"])
    with pytest.raises(replicas.ReplicaFailed, match="not supported with rollout.placement=separate"):
        recovery.check_restart(cfg, [(2, 0, "process 1 (x) exited with code 1 during generate")], used=0)


def test_a_lost_engine_is_left_to_the_restarts_and_any_other_failure_stops_the_step() -> None:
    report = replicas._Report
    lost = [report(0, [], 0.0, "process 1 (x) was killed by SIGKILL during generate", 0, lost=True),
            report(None, [], 0.0, None, 1)]
    replicas._raise_failures(lost, restartable=True)  # nothing raised: the caller restarts
    with pytest.raises(replicas.ReplicaFailed, match="replica 0 .* mid-generation: process 1 .* SIGKILL"):
        replicas._raise_failures(lost)  # no restarts (an engine rank, separate placement)
    other = [report(0, [], 0.0, "ValueError: prompt 3 is empty", 0)]
    with pytest.raises(replicas.ReplicaFailed, match="prompt 3 is empty"):
        replicas._raise_failures(other, restartable=True)


def test_config_refuses_a_negative_budget_and_a_zero_timeout() -> None:
    with pytest.raises(ValueError, match="rollout.max_engine_restarts=-1 must be >= 0"):
        load_config(QUICKSTART, ["rollout.max_engine_restarts=-1"])
    with pytest.raises(ValueError, match="rollout.generate_timeout_s=0.0 must be > 0"):
        load_config(QUICKSTART, ["rollout.generate_timeout_s=0"])
    with pytest.raises(ValueError, match="generate_timeout_s=600 must stay below run.collective_timeout_minutes=10"):
        load_config(QUICKSTART, ["rollout.generate_timeout_s=600"])  # the waiting ranks would fail first
    load_config(QUICKSTART, ["rollout.generate_timeout_s=600", "run.collective_timeout_minutes=11"])
