"""An SGLang engine killed mid-generation or mid-push is restarted, re-synced and the step goes on.

The quickstart run (EP=2 actor, one colocated SGLang tp=2 engine) with one of the engine's
scheduler processes SIGKILLed while step 2 generates (``tests.injection``: ``KILL_ENGINE``) and
again while step 3's weights are pushed (``KILL_ENGINE_PUSH``): the driver's
watch sees the process gone, the engine is replaced, given the current weights, and the call
(or the push) runs again with the same seeds, so the run's metrics are those of the
uninterrupted one (``tests/conftest.py``'s ``full_run``, the same config, deterministic).

With ``rollout.placement=separate`` (two engine ranks, one tp=1 replica each) replica 1 loses
its engine while step 2 generates and replica 0 while step 2's weights are pushed to it: the
engine ranks restart their engines inside the call, with the actor ranks, and again the run
matches the uninterrupted one (``separate_run``, the learning run of tests/test_train_separate.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridflow.config import load_config
from hybridflow.runtime import recovery, replicas
from hybridflow.runtime import sync as sync_module
from hybridflow.runtime.engine_client import EngineClient
from tests.injection import environment
from tests.test_train import FULL_RUN, _deterministic, _history, _ok, _train
from tests.test_train_separate import SEPARATE

QUICKSTART = "configs/quickstart_cpu.yaml"
KILLED = "rollout/engine_restarts"
RESTARTED = r"rollout replica {replica} lost its engine \([^\n]*\): restarting it"
"""The driver's line for each restart. The cause it names varies with timing (a short generate
may return before the kill lands: the next call, the next chunk's reseed, then finds the
process gone), so the tests count restarts per replica and step, not their wording."""


def _restarts_of(replica: int, stderr: str) -> int:
    return len(re.findall(RESTARTED.format(replica=replica), stderr))


@pytest.mark.claim("engine-restart-reproduces")
@pytest.mark.distributed
@pytest.mark.timeout(1500)
def test_an_engine_killed_mid_step_is_restarted_and_the_run_matches_an_uninterrupted_one(
    tmp_path: Path, full_run: Path
) -> None:
    # generate call 3 is step 2's (call 1 scored the held-out prompts after SFT); push 4 is step
    # 3's (push 1 filled the engine at start, pushes 2 and 3 were steps 1's and 2's)
    faults = environment(KILL_ENGINE="0@3", KILL_ENGINE_PUSH="0@4")
    killed = _train(tmp_path / "killed", *FULL_RUN, env=faults)  # the config of full_run
    _ok(killed)
    assert _restarts_of(0, killed.stderr) == 2 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["engine_restarts"] == 2, summary
    history = _history(tmp_path / "killed", "step_000004")
    assert [h.get(KILLED, 0.0) for h in history] == [0.0, 1.0, 1.0, 0.0]

    whole = _history(full_run, "step_000004")
    assert [{k: v for k, v in h.items() if k != KILLED} for h in _deterministic(history)] == _deterministic(whole)


@pytest.mark.claim("engine-restart-reproduces")
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_separate_engines_killed_mid_generate_and_mid_push_are_restarted_and_the_run_matches(
    tmp_path: Path, separate_run, seeded
) -> None:
    # generate call 3 is step 2's; push 3 is step 2's (push 1 filled the engines, push 2 was step 1's)
    faults = environment(KILL_ENGINE="1@3", KILL_ENGINE_PUSH="0@3")
    killed = _train(seeded(tmp_path / "killed"), *SEPARATE, env=faults)  # the config of separate_run
    _ok(killed)
    assert _restarts_of(0, killed.stderr) == _restarts_of(1, killed.stderr) == 1, killed.stderr[-3000:]
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["engine_restarts"] == 2, summary
    history = _history(tmp_path / "killed", "step_000006")
    assert [h.get(KILLED, 0.0) for h in history] == [0.0, 2.0, 0.0, 0.0, 0.0, 0.0]

    whole = _history(separate_run[0], "step_000006")
    assert [{k: v for k, v in h.items() if k != KILLED} for h in _deterministic(history)] == _deterministic(whole)


@pytest.mark.claim("engine-restart-limit")
def test_past_the_limit_the_run_stops_in_one_line_naming_the_replica_cause_and_setting() -> None:
    cfg = load_config(QUICKSTART, ["rollout.max_engine_restarts=2"])
    lost = [(0, 0, "process 123 (sglang::scheduler_TP1) was killed by SIGKILL during generate")]
    recovery.check_restart(cfg, lost, used=1)  # the second restart is within the budget
    with pytest.raises(replicas.ReplicaFailed) as stop:
        recovery.check_restart(cfg, lost, used=2)
    message = str(stop.value)
    assert "\n" not in message
    assert message.startswith(
        "rollout replica 0 (driven by rank 0) lost its engine: process 123 "
        "(sglang::scheduler_TP1) was killed by SIGKILL during generate;"
    ), message
    assert "2 of rollout.max_engine_restarts=2 restarts used: raise rollout.max_engine_restarts" in message
    none = load_config(QUICKSTART, ["rollout.max_engine_restarts=0"])
    hung = [(2, 1, "generate hung: no answer within rollout.generate_timeout_s=600 s")]
    with pytest.raises(
        replicas.ReplicaFailed,
        match=r"replica 1 \(driven by rank 2\) lost its engine: generate "
        r"hung: .*rollout.max_engine_restarts=0",
    ):
        recovery.check_restart(none, hung, used=0)


@pytest.mark.claim("engine-restart-limit")
def test_restarts_are_refused_by_name_where_they_are_not_supported() -> None:
    lost = [(2, 0, "process 1 (x) exited with code 1 during generate")]
    recovery.check_restart(load_config(QUICKSTART, ["rollout.placement=separate"]), lost, used=0)  # supported now
    spanning = load_config(QUICKSTART, ["rollout.gpus_per_node=1"])  # tp=2 over two one-GPU nodes
    recovery.check_restart(spanning, lost, used=0, spanning=True)  # colocated: every node's part restarts
    with pytest.raises(
        replicas.ReplicaFailed, match="not supported for engines spanning nodes with rollout.placement=separate"
    ):
        recovery.check_restart(spanning, lost, used=0)
    # a batch started ahead (asynchronous RL) is not regenerated: collect says why, in one line
    started = [replicas._Report(0, [], 0.0, "process 1 (x) was killed by SIGKILL during generate", None, lost=True)]
    with pytest.raises(replicas.ReplicaFailed) as stop:
        replicas._raise_failures(started, why_not=replicas.ASYNC_LOST)
    assert "\n" not in str(stop.value) and "cannot be regenerated on a new engine" in str(stop.value)


class _Engine:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    def shutdown(self) -> None:
        self.closed = True


class _Sync:
    def __init__(self) -> None:
        self.pushes, self.replaced = [], 0

    def push(self, **how) -> None:
        self.pushes.append(how)

    def engines_replaced(self) -> None:
        self.replaced += 1


def _holder(replica, engine):
    cfg = load_config(
        QUICKSTART,
        ["rollout.placement=separate", "rollout.tp=1", "rollout.num_replicas=2", "rollout.max_engine_restarts=2"],
    )
    return EngineClient(cfg, Path("model"), replica, engine, sync=_Sync())


@pytest.mark.claim("engine-held-once")
def test_every_process_takes_the_same_restart_and_only_the_lost_replicas_driver_replaces_its_engine(
    monkeypatch,
) -> None:
    started = []
    monkeypatch.setattr(recovery, "start_engine", lambda cfg, model_dir: started.append(model_dir) or _Engine("new"))
    lost = [(3, 1, "process 9 (sglang::scheduler_TP0) was killed by SIGKILL during generate")]
    actor = _holder(None, None)
    driver0, driver1 = _holder(0, _Engine("old0")), _holder(1, _Engine("old1"))
    everyone = [recovery.EngineRestarts(actor), recovery.EngineRestarts(driver0), recovery.EngineRestarts(driver1)]
    engines = [r.restart(lost) for r in everyone]
    assert engines[0] is None and engines[1].name == "old0" and engines[2].name == "new"
    assert started == [Path("model")]  # one new engine, on replica 1's driver
    # held once, in the client the push reads it from
    assert driver1.engine is engines[2] and not driver0.engine.closed
    push = object.__new__(sync_module.EngineSync)
    push.engines = driver1
    assert push.engine is engines[2]
    # every process pushes the new engine the weights, inside the call: no announcement, not counted;
    # and every process's sync knows an engine is new (lora.push=adapter then pushes the base again)
    assert all(h.sync.pushes == [{"counted": False, "announce": False}] for h in (actor, driver0, driver1))
    assert all(h.sync.replaced == 1 for h in (actor, driver0, driver1))
    assert [r.used for r in everyone] == [1, 1, 1]  # the loop reports each step's share
    for r in everyone:  # the same budget everywhere: the third restart is past max_engine_restarts=2
        r.replace([(2, 0, "generate hung: no answer within rollout.generate_timeout_s=60 s")])
        with pytest.raises(replicas.ReplicaFailed, match="2 of rollout.max_engine_restarts=2 restarts used"):
            r.replace(lost)


def _pushed(replica, engine_bytes, lost=None, worst=None):
    return sync_module._Pushed(replica, engine_bytes, 10, 0, worst, lost)


def _sync_pushing(results: list, restarts) -> tuple[sync_module.EngineSync, list]:
    """An EngineSync whose tries return ``results`` one after another (no process groups)."""
    es = object.__new__(sync_module.EngineSync)
    es.cfg = load_config(
        QUICKSTART, ["rollout.placement=separate", "rollout.tp=1", "rollout.num_replicas=2", "checks.refit_every=2"]
    )
    es.source_params, es.engines, es.engine_params, es.pushes, es.restarts = None, None, [{}], 0, restarts
    es.adapters, es.pushes_adapters = None, False  # merged pushes
    tries = []

    def push_once(verify):
        tries.append(verify)
        return results[len(tries) - 1]

    es._push_once = push_once
    return es, tries


@pytest.mark.claim("engine-restart-reproduces")
def test_an_engine_lost_in_a_push_is_replaced_and_the_push_runs_again_as_the_lost_one_would_have() -> None:
    cause = "process 9 (sglang::scheduler_TP0) was killed by SIGKILL during update_weights_from_tensor"
    replaced = []
    lost_try = [_pushed(None, 0.0), _pushed(0, 0.0, lost=cause), _pushed(1, 5.0, worst=0.0)]
    whole_try = [_pushed(None, 0.0), _pushed(0, 5.0, worst=0.0), _pushed(1, 5.0, worst=0.0)]
    es, tries = _sync_pushing([lost_try, whole_try, whole_try], SimpleNamespace(replace=replaced.append))
    metrics = es.push()
    assert replaced == [[(1, 0, cause)]]  # (driver's rank in the channel, replica, cause), on every process
    assert tries == [True, True]  # the retry verifies as the first push of the run does
    assert es.pushes == 1  # one counted push: the refit checks' schedule stays as it was
    assert metrics["sync/replica0/engine_bytes"] == metrics["sync/replica1/engine_bytes"] == 5.0
    assert metrics["checks/refit_max_rel_diff"] == 0.0
    assert es.push(counted=False) and es.pushes == 1 and tries == [True, True, False]

    es, _ = _sync_pushing([lost_try], None)  # no restarts: the run stops, naming the replica and cause
    with pytest.raises(
        replicas.ReplicaFailed,
        match=r"^rollout replica 0 \(driven by rank 1\) lost its engine "
        r"during a weight push: process 9 .*SIGKILL",
    ):
        es.push()


def test_a_lost_engine_is_left_to_the_restarts_and_any_other_failure_stops_the_step() -> None:
    report = replicas._Report
    lost = [
        report(0, [], 0.0, "process 1 (x) was killed by SIGKILL during generate", 0, lost=True),
        report(None, [], 0.0, None, 1),
    ]
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
