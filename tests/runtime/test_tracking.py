"""``run.tracking``: TensorBoard event files beside (or instead of) MLflow, read back from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybridflow.config import load_config
from hybridflow.runtime.tracking import Tracker


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(log_dir)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _tracker(tmp_path: Path, *overrides: str, active: bool = True) -> Tracker:
    cfg = load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path}", *overrides])
    return Tracker(cfg, active=active)


def test_tensorboard_is_off_by_default(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, "run.tracking.backend=none")
    assert tracker.tensorboard_dir is None
    tracker.log_metrics({"reward/mean": 0.5}, step=1)
    tracker.close()
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.claim("tracking-mlflow-tensorboard")
def test_tensorboard_alone_writes_event_files_a_reader_reads_back(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, "run.tracking.backend=none", "run.tracking.tensorboard=true")
    assert tracker.tensorboard_dir == str(tmp_path.resolve() / "tensorboard") and tracker.run_id is None
    tracker.log_params({"algorithm": "grpo"})
    tracker.log_metrics({"reward/mean": 0.25, "actor/kl": float("nan")}, step=1)
    tracker.log_metrics({"reward/mean": 0.75}, step=2)
    # flushed per step: readable before close, as after a job killed mid-run
    assert _scalars(tracker.tensorboard_dir) == {"reward/mean": [(1, 0.25), (2, 0.75)]}
    tracker.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.claim("tracking-mlflow-tensorboard")
def test_tensorboard_beside_mlflow_gets_the_same_metrics(tmp_path: Path) -> None:
    import mlflow

    tracker = _tracker(tmp_path, "run.tracking.tensorboard=true")
    tracker.log_metrics({"reward/mean": 0.5}, step=3)
    run_id, uri = tracker.run_id, tracker.uri
    tracker.close()
    assert _scalars(str(tmp_path / "tensorboard")) == {"reward/mean": [(3, 0.5)]}
    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(3, 0.5)]


def test_an_inactive_rank_writes_no_event_files(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, "run.tracking.tensorboard=true", active=False)
    tracker.log_metrics({"reward/mean": 0.5}, step=1)
    tracker.close()
    assert tracker.tensorboard_dir is None and not (tmp_path / "tensorboard").exists()


def test_a_checkpoint_whose_mlflow_run_the_store_lacks_starts_a_new_run_with_its_history(
    tmp_path: Path, caplog
) -> None:
    """A checkpoint copied into another run directory names an MLflow run that directory's store
    never held: the run goes on in a new MLflow run that holds the steps so far; a store that
    holds the run reopens it and adds nothing."""
    import mlflow

    first = Tracker(load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path / 'a'}"]), active=True)
    first.log_metrics({"reward/mean": 0.25, "step": 1}, step=1)
    old_id = first.run_id
    first.close()
    history = [{"reward/mean": 0.25, "step": 1}, {"reward/mean": 0.5, "step": 2}]
    cfg = load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path / 'b'}"])
    moved = Tracker(cfg, active=True, run_id=old_id, history=history)
    assert moved.run_id != old_id
    assert f"the checkpoint's MLflow run {old_id} is not in {moved.uri}" in caplog.text
    moved.close()
    points = mlflow.MlflowClient(tracking_uri=moved.uri).get_metric_history(moved.run_id, "reward/mean")
    assert [(m.step, m.value) for m in points] == [(1, 0.25), (2, 0.5)]
    same = Tracker(
        load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path / 'a'}"]),
        active=True,
        run_id=old_id,
        history=history,
    )
    assert same.run_id == old_id
    same.close()
    points = mlflow.MlflowClient(tracking_uri=same.uri).get_metric_history(old_id, "reward/mean")
    assert [(m.step, m.value) for m in points] == [(1, 0.25)]


@pytest.mark.claim("resume-after-a-change")
def test_a_resume_with_changed_settings_dates_each_change_in_the_same_mlflow_run(tmp_path: Path) -> None:
    """MLflow refuses to change a logged param (the resumed run died on rank 0 with 'Changing param
    values is not allowed'): the changed ones are logged as ``<key>.from_step_<step>``."""
    import mlflow

    cfg = load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path}"])
    first = Tracker(cfg, active=True)
    first.log_params({"actor_layout": "ep2 dp2", "algorithm.name": "grpo"})
    first.close()
    for step, layout in ((4, "tp2 dp1"), (4, "tp2 dp1"), (6, "ep2 dp2")):  # the second: a restart, no change
        resumed = Tracker(cfg, active=True, run_id=first.run_id)
        resumed.log_params({"actor_layout": layout, "algorithm.name": "grpo", "algorithm.n": 8}, step=step)
        resumed.close()
    params = mlflow.MlflowClient(tracking_uri=first.uri).get_run(first.run_id).data.params
    assert params == {
        "actor_layout": "ep2 dp2",
        "algorithm.name": "grpo",
        "algorithm.n": "8",
        "actor_layout.from_step_4": "tp2 dp1",
        "actor_layout.from_step_6": "ep2 dp2",
    }


@pytest.mark.claim("one-point-per-step")
def test_steps_an_earlier_start_logged_past_its_checkpoint_are_not_logged_twice(tmp_path: Path) -> None:
    """Killed after step 4 with its checkpoint at step 2, a run resumes at step 3: the reopened
    MLflow run keeps one point per step; a start that opens a new MLflow run skips nothing."""
    import mlflow

    cfg = load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path}"])
    first = Tracker(cfg, active=True)
    for step in range(1, 5):
        first.log_metrics({"reward/mean": step / 10}, step=step)
    first.close(status="KILLED")
    resumed = Tracker(cfg, active=True, run_id=first.run_id, logged_until=4)
    for step in range(3, 7):
        resumed.log_metrics({"reward/mean": step / 10 + 0.01}, step=step)
    resumed.log_metrics({"sft/loss": 1.0}, step=3)  # another phase's step 3: logged
    resumed.close()
    client = mlflow.MlflowClient(tracking_uri=resumed.uri)
    points = [(m.step, m.value) for m in client.get_metric_history(first.run_id, "reward/mean")]
    assert sorted(points) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.51), (6, 0.61)]
    assert len(client.get_metric_history(first.run_id, "sft/loss")) == 1
    elsewhere = load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path / 'b'}"])
    fresh = Tracker(elsewhere, active=True, run_id=first.run_id, logged_until=4)  # not in this store
    fresh.log_metrics({"reward/mean": 0.3}, step=3)
    fresh.close()
    assert len(mlflow.MlflowClient(tracking_uri=fresh.uri).get_metric_history(fresh.run_id, "reward/mean")) == 1
