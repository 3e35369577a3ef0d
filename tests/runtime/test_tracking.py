"""``run.tracking``: TensorBoard event files and an offline wandb run beside (or instead of) MLflow,
read back from disk (wandb's transaction log with its own protobuf schema)."""

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
    tracker = _tracker(tmp_path, "run.tracking.trackers=[]")
    assert tracker.tensorboard_dir is None
    tracker.log_metrics({"reward/mean": 0.5}, step=1)
    tracker.close()
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.claim("tracking-mlflow-tensorboard")
def test_tensorboard_alone_writes_event_files_a_reader_reads_back(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, "run.tracking.trackers=[tensorboard]")
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

    tracker = _tracker(tmp_path, "run.tracking.trackers=[mlflow,tensorboard]")
    tracker.log_metrics({"reward/mean": 0.5}, step=3)
    run_id, uri = tracker.run_id, tracker.uri
    tracker.close()
    assert _scalars(str(tmp_path / "tensorboard")) == {"reward/mean": [(3, 0.5)]}
    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(3, 0.5)]


def test_an_inactive_rank_writes_no_event_files(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, "run.tracking.trackers=[mlflow,tensorboard,wandb]", active=False)
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


@pytest.mark.claim("tracking-wandb")
def test_an_offline_wandb_run_holds_the_metrics_tables_and_figure_and_a_resume_continues_it(
    tmp_path: Path, monkeypatch
) -> None:
    """No key here: ``auto`` writes offline under the run directory; the transaction log read back
    holds the config, each phase's steps on its own axis, the table, the figure; a second start
    with the kept id writes the same wandb run on."""
    import json

    from tests.wandb_log import history, offline_runs, run_record

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    figure = tmp_path / "run.png"
    figure.write_bytes(_png())
    tracker = _tracker(tmp_path, "run.tracking.trackers=[wandb]")
    run_id = tracker.wandb_run_id
    assert run_id and tracker.run_id is None  # no MLflow
    tracker.log_metrics({"sft/loss": 2.0}, step=1)
    tracker.log_metrics({"reward/mean": 0.25, "actor/kl": float("nan")}, step=1)
    tracker.log_metrics({"reward/mean": 0.75}, step=2)
    records = [{"step": 2, "sample": 0, "prompt": "max(1,5)=", "response": "5", "reward": 1.0, "scores": {}}]
    tracker.log_table("heldout/step_000002", records, ("step", "sample", "prompt", "response", "reward", "scores"))
    tracker.log_artifact(figure)
    tracker.close()
    (first,) = offline_runs(tmp_path)
    run = run_record(first)
    assert run.run_id == run_id and run.project == "hybridflow" and run.display_name == "quickstart_cpu"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["run"]["tracking"]["trackers"] == ["wandb"] and config["algorithm"]["name"] == "grpo"
    rows = history(first)
    assert [(r["sft/step"], r["sft/loss"]) for r in rows if "sft/loss" in r] == [(1, 2.0)]
    assert [(r["rl/step"], r["reward/mean"]) for r in rows if "reward/mean" in r] == [(1, 0.25), (2, 0.75)]
    (table_row,) = [r for r in rows if "heldout/step_000002/path" in r]
    table = json.loads((first.parent / "files" / table_row["heldout/step_000002/path"]).read_text())
    assert table["columns"] == ["step", "sample", "prompt", "response", "reward", "scores"]
    assert table["data"] == [[2, 0, "max(1,5)=", "5", 1.0, "{}"]]
    (image_row,) = [r for r in rows if "figures/run/path" in r]
    assert (first.parent / "files" / image_row["figures/run/path"]).read_bytes() == figure.read_bytes()
    # a resumed start: the same wandb run, its next step
    again = Tracker(load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path}",
                    "run.tracking.trackers=[wandb]"]), active=True, wandb_run_id=run_id)  # fmt: skip
    again.log_metrics({"reward/mean": 1.0}, step=3)
    again.close()
    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and run_record(runs[1]).run_id == run_id
    assert [(r["rl/step"], r["reward/mean"]) for r in history(runs[1]) if "reward/mean" in r] == [(3, 1.0)]


def test_a_start_killed_with_its_wandb_run_open_does_not_stop_the_resume_reopening_it(tmp_path: Path) -> None:
    """The launching process (here pytest) has a wandb service of its own with the run still open,
    as a killed start leaves it, and exports it to its children; the resumed trainer uses a
    service of its own and reopens the run (before, the inherited service refused the id as in use)."""
    import os
    import subprocess
    import sys

    overrides = [f"run.output_dir={tmp_path}", "run.tracking.trackers=[wandb]", "run.tracking.wandb_mode=offline"]
    killed = Tracker(load_config("configs/quickstart_cpu.yaml", overrides), active=True)
    killed.log_metrics({"reward/mean": 0.25}, step=1)
    assert "WANDB_SERVICE" in os.environ  # what every child of this process inherits
    resume = (
        "import sys; from hybridflow.config import load_config; from hybridflow.runtime.tracking import Tracker; "
        "t = Tracker(load_config('configs/quickstart_cpu.yaml', sys.argv[2:]), active=True, wandb_run_id=sys.argv[1]); "
        "assert not t._wandb.failed; t.log_metrics({'reward/mean': 0.5}, step=2); t.close()"
    )
    run_id = killed._wandb.id
    done = subprocess.run(
        [sys.executable, "-c", resume, run_id, *overrides], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "in use" not in done.stderr, done.stderr[-2000:]
    killed.close()
    from tests.wandb_log import history, offline_runs, run_record

    runs = offline_runs(tmp_path)
    assert len(runs) == 2 and {run_record(run).run_id for run in runs} == {run_id}
    assert [(r["rl/step"], r["reward/mean"]) for run in runs for r in history(run) if "reward/mean" in r] == [
        (1, 0.25),
        (2, 0.5),
    ]


def _png() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def test_a_failing_wandb_warns_once_and_the_run_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    import logging

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tracker = _tracker(tmp_path, "run.tracking.trackers=[mlflow,wandb]", "run.tracking.wandb_mode=offline")

    def broken(*args, **kwargs):
        raise OSError("wandb-core is gone")

    monkeypatch.setattr(tracker._wandb.run, "log", broken)
    with caplog.at_level(logging.WARNING, logger="hybridflow.runtime.wandb_tracker"):
        tracker.log_metrics({"reward/mean": 0.5}, step=1)
        tracker.log_metrics({"reward/mean": 0.6}, step=2)  # MLflow still gets it; wandb is not tried
    assert [r.getMessage() for r in caplog.records if r.name == "hybridflow.runtime.wandb_tracker"] == [
        "wandb: logging metrics failed (wandb-core is gone); the run goes on without wandb"
    ]
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=tracker.uri).get_metric_history(tracker.run_id, "reward/mean")
    assert [m.value for m in history] == [0.5, 0.6]
    tracker.close()


def test_wandb_mode_auto_is_online_only_with_a_key(tmp_path: Path, monkeypatch) -> None:
    from hybridflow.runtime.wandb_tracker import wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode("auto") == "offline" and wandb_mode("online") == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"


@pytest.mark.claim("tracking-mlflow-tensorboard")
def test_a_new_local_store_is_a_copy_of_the_machines_empty_one_and_runs_no_migrations(
    tmp_path: Path, monkeypatch
) -> None:
    import mlflow
    import mlflow.store.db.utils as db_utils
    from mlflow import MlflowClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = _tracker(tmp_path / "first")  # makes the empty store once
    first.log_metrics({"reward/mean": 0.5}, step=1)
    first.close()
    template = tmp_path / "cache" / "hybridflow" / f"mlflow-{mlflow.__version__}.db"
    assert template.is_file()

    def migrate(engine):
        raise AssertionError("a store copied from the empty one ran MLflow's migrations")

    monkeypatch.setattr(db_utils, "_initialize_tables", migrate)
    second = _tracker(tmp_path / "second")
    second.log_metrics({"reward/mean": 0.75}, step=1)
    second.close()
    client = MlflowClient(tracking_uri=second.uri)
    assert [m.value for m in client.get_metric_history(second.run_id, "reward/mean")] == [0.75]
    assert MlflowClient(tracking_uri=first.uri).get_run(first.run_id).data.metrics["reward/mean"] == 0.5
