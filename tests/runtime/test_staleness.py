"""Asynchronous RL's pure bookkeeping (``hybridflow/runtime/staleness.py``): the fixed interleaving,
admission by staleness, the metrics; and the ``async_rl`` config and preflight checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.preflight import check_async
from hybridflow.runtime.staleness import admit, overlap_seconds, pending_after, staleness_metrics, starts

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml")


def _simulate(lag: int, steps: int, first: int = 0, pending: dict[int, int] | None = None) -> dict[int, int]:
    """Drive ``starts`` as the pipeline does; returns batch -> the version that generated it."""
    pending, trained = dict(pending or {}), {}
    for step in range(first, steps):
        before, after = starts(step, lag=lag, steps=steps, pending=pending)
        pending.update({b: step for b in before})
        trained[step] = pending.pop(step)
        pending.update({b: step for b in after})
        assert len(pending) <= lag  # the buffer never holds more than the lag
        assert sorted(pending) == pending_after(step, lag=lag, steps=steps)
    assert not pending  # nothing is started past the last step
    return trained


@pytest.mark.claim("async-interleaving-fixed")
@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_batch_b_is_generated_by_version_max_start_b_minus_lag_and_stays_within_k(lag):
    trained = _simulate(lag, steps=9)
    assert trained == {b: max(0, b - lag) for b in range(9)}
    assert all(0 <= step - version <= lag for step, version in trained.items())


@pytest.mark.claim("async-resume-reproduces")
def test_a_resume_with_its_buffer_continues_the_same_interleaving_and_one_without_refills():
    uninterrupted = _simulate(2, steps=8)
    restored = {b: uninterrupted[b] for b in pending_after(3, lag=2, steps=8)}  # saved after step 3 (4 done)
    assert _simulate(2, steps=8, first=4, pending=restored) == {b: uninterrupted[b] for b in range(4, 8)}
    dropped = _simulate(2, steps=8, first=4)
    assert dropped == {4: 4, 5: 4, 6: 4, 7: 5}  # the start step's weights fill the buffer again


def test_admit_drops_or_downweights_samples_older_than_k():
    versions = torch.tensor([5, 4, 3, 2])
    keep, weight = admit(versions, 5, 2, on_stale="drop", stale_weight=0.5)
    assert keep.tolist() == [True, True, True, False] and weight.tolist() == [1, 1, 1, 1]
    keep, weight = admit(versions, 5, 2, on_stale="downweight", stale_weight=0.25)
    assert keep.all() and weight.tolist() == [1, 1, 1, 0.25]


def test_staleness_metrics_histogram():
    m = staleness_metrics(torch.tensor([3, 3, 2, 1]), 3, 2)
    assert m["async/staleness_mean"] == 0.75 and m["async/staleness_max"] == 2.0
    assert [m[f"async/samples_version_lag_{d}"] for d in range(3)] == [2.0, 1.0, 1.0]
    assert staleness_metrics(torch.tensor([], dtype=torch.long), 0, 1) == {}


def test_overlap_counts_the_union_of_busy_intervals_inside_the_window():
    assert overlap_seconds([(0, 2), (1, 3), (5, 6)], (1.5, 5.5)) == pytest.approx(2.0)
    assert overlap_seconds([(0, 1)], (2, 3)) == 0.0


SEPARATE = ["rollout.placement=separate", "rollout.tp=1"]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["async_rl.mode=one_step_off"], "async_rl.mode=one_step_off with rollout.placement=colocated"),
        (["async_rl.mode=async", *SEPARATE, "async_rl.max_staleness=0"], "async_rl.max_staleness=0"),
        (["async_rl.buffer_batches=0"], "async_rl.buffer_batches=0 is smaller than one batch"),
        (["async_rl.mode=async", *SEPARATE, "async_rl.max_staleness=3"], "async_rl.buffer_batches=2 cannot hold"),
        (["async_rl.mode=one_step_off", *SEPARATE, "async_rl.max_staleness=2"], "K=1 by definition"),
        (["async_rl.mode=async", *SEPARATE, "algorithm.name=remax"], "algorithm.name=remax"),
    ],
)
@pytest.mark.claim("async-refusals")
def test_bad_async_settings_are_one_line_errors_naming_the_keys(overrides, key):
    cfg = load_config(QUICKSTART, overrides)
    from hybridflow.lowering import lower

    with pytest.raises(ValueError, match=key) as error:
        check_async(cfg, lower(cfg, with_reshard=False))
    assert "\n" not in str(error.value) and "set " in str(error.value)


def test_async_config_values_are_checked_in_the_section():
    with pytest.raises(ValueError, match="async_rl.mode"):
        load_config(QUICKSTART, ["async_rl.mode=sometimes"])
    with pytest.raises(ValueError, match="async_rl.stale_weight"):
        load_config(QUICKSTART, ["async_rl.stale_weight=0"])


def test_good_async_settings_pass():
    from hybridflow.lowering import lower

    for overrides in (
        ["async_rl.mode=one_step_off", *SEPARATE],
        ["async_rl.mode=async", *SEPARATE, "async_rl.max_staleness=2"],
        [],
    ):
        cfg = load_config(QUICKSTART, overrides)
        check_async(cfg, lower(cfg, with_reshard=False))


def test_plan_states_the_interleaving_it_runs():
    cfg = load_config(QUICKSTART, ["async_rl.mode=async", *SEPARATE, "async_rl.max_staleness=2"])
    assert cfg.async_rl.lag == 2 and "max(start, b-2)" in cfg.async_rl.describe()
    assert load_config(QUICKSTART, ["async_rl.mode=one_step_off", *SEPARATE]).async_rl.lag == 1
    assert load_config(QUICKSTART, []).async_rl.describe().startswith("sync")


@pytest.mark.claim("async-interleaving-fixed")
def test_one_step_off_runs_as_async_with_k1_the_runtime_reads_only_the_lag():
    """one_step_off is K=1 by definition: its run is the async K=1 run (tests/test_train_async.py
    runs that one). The runtime reads the lag, and the mode only to tell sync from the rest (the
    worker) and to name it (the summary), so nothing else can tell the two apart."""
    import ast

    one = load_config(QUICKSTART, ["async_rl.mode=one_step_off", *SEPARATE]).async_rl
    k1 = load_config(QUICKSTART, ["async_rl.mode=async", *SEPARATE, "async_rl.max_staleness=1"]).async_rl
    assert one.lag == k1.lag == 1 and _simulate(one.lag, 6) == _simulate(k1.lag, 6)
    runtime = Path(__file__).resolve().parents[2] / "hybridflow" / "runtime"
    reads = set()  # (file, function) of every ``<...>async_rl.mode`` the runtime reads
    for path in runtime.glob("*.py"):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                owner = getattr(node, "value", None)
                name = getattr(owner, "attr", getattr(owner, "id", None))
                if isinstance(node, ast.Attribute) and node.attr == "mode" and name == "async_rl":
                    reads.add((path.name, function.name))
    assert reads == {("worker.py", "_run"), ("report.py", "summarise_async")}, reads


def test_the_summary_reports_staleness_and_overlap():
    from hybridflow.runtime.report import summarise_async

    cfg = load_config(QUICKSTART, ["async_rl.mode=async", *SEPARATE, "async_rl.max_staleness=2"])
    history = [
        {"async/staleness_mean": 0.0, "async/staleness_max": 0.0, "async/overlap_fraction": 0.2},
        {
            "async/staleness_mean": 2.0,
            "async/staleness_max": 2.0,
            "async/overlap_fraction": 0.4,
            "async/dropped_samples": 3.0,
        },
    ]
    got = summarise_async(cfg.async_rl, history)
    assert got == {
        "mode": "async",
        "max_staleness": 2,
        "staleness_mean": 1.0,
        "staleness_max": 2.0,
        "overlap_fraction_mean": pytest.approx(0.3),
        "dropped_samples": 3.0,
    }
