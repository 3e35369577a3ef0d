"""Metrics, tables and figures to the trackers ``run.tracking.trackers`` lists (rank 0 only):
MLflow, TensorBoard event files, Weights & Biases (``runtime.wandb_tracker``); [] = none.

The default store is local: a SQLite database under the run directory
(``<output_dir>/mlflow.db``, artifacts beside it), so a laptop run needs no server and
``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`` shows it. A resumed run
reopens the same MLflow run (its id is kept in the run state) and keeps logging at the next step;
where the store does not hold that run (a checkpoint copied into another run directory, or the
store removed), it says so and starts a new MLflow run holding the checkpoint's history so far.
TensorBoard's files go to ``<output_dir>/tensorboard`` (``tensorboard --logdir`` it); a resumed
run adds a new event file there, which TensorBoard reads as the same run.

A new local store starts as a copy of an empty one MLflow created once per machine and MLflow
version (``<XDG_CACHE_HOME or ~/.cache>/hybridflow/mlflow-<version>.db``): MLflow builds a fresh
SQLite store by running every schema migration, 1.2 of the 1.9 s a new run's store took here.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfschema import gc_pause
from hybridflow.config import HybridflowConfig

__all__ = ["Tracker", "default_tracking_uri"]

logger = logging.getLogger(__name__)


def default_tracking_uri(output_dir: str | os.PathLike) -> str:
    """The local store of a run directory."""
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


_FROM_STEP = ".from_step_"
"""A setting changed on a resume is logged as ``<key>.from_step_<step>`` (``Tracker.log_params``)."""


@dataclass(frozen=True)
class _MlflowRun:
    client: Any
    """An ``mlflow.MlflowClient`` of the store: every call names the run (no process-wide state)."""
    run_id: str
    uri: str


class Tracker:
    """Logs params, metrics and artifacts of one run; inert on ranks other than 0.

    MLflow is called through an ``MlflowClient`` naming the run in every call (no process-wide
    active run). The run starts here, in the caller's thread: a start in a thread of its own
    hung the suite, see docs/speed.md."""

    def __init__(
        self,
        cfg: HybridflowConfig,
        *,
        active: bool,
        run_id: str | None = None,
        wandb_run_id: str | None = None,
        history: list[dict[str, float]] = (),
        logged_until: int = 0,
    ) -> None:
        """``run_id`` / ``wandb_run_id``: the MLflow and wandb runs an earlier start logged into.
        ``logged_until``: the last RL step an earlier start logged (it may have gone past the
        checkpoint this start resumes from): those steps are not logged twice."""
        self.tensorboard_dir: str | None = None
        self._logged_until = logged_until
        self._mlflow: _MlflowRun | None = None
        self._wandb = None
        self._closed = False
        self._tensorboard = None
        if not active:
            return
        trackers = cfg.run.tracking.trackers
        if "mlflow" in trackers:
            with gc_pause.paused():  # MLflow's import and its store's schema: start-up objects
                self._mlflow = _start_mlflow(cfg, run_id, list(history))
            if self._mlflow.run_id != run_id:  # a new MLflow run: it holds none of those steps
                self._logged_until = 0
        if "tensorboard" in trackers:
            self._start_tensorboard(Path(cfg.run.output_dir).resolve() / "tensorboard")
        if "wandb" in trackers:
            from hybridflow.runtime.wandb_tracker import WandbRun

            try:
                self._wandb = WandbRun(cfg, wandb_run_id)
            except Exception as error:  # noqa: BLE001 - a tracker never stops training
                logger.warning("wandb: starting the run failed (%s); the run goes on without wandb", error)

    @property
    def run_id(self) -> str | None:
        return self._mlflow.run_id if self._mlflow is not None else None

    @property
    def uri(self) -> str | None:
        return self._mlflow.uri if self._mlflow is not None else None

    @property
    def wandb_run_id(self) -> str | None:
        return self._wandb.id if self._wandb is not None else None

    def _to_mlflow(self, call: Callable[[_MlflowRun], None]) -> None:
        if self._mlflow is not None and not self._closed:
            call(self._mlflow)

    def _start_tensorboard(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._tensorboard = SummaryWriter(log_dir=str(log_dir))
        self.tensorboard_dir = str(log_dir)
        logger.info("TensorBoard event files under %s", log_dir)

    def log_params(self, params: dict[str, Any], *, step: int = 0) -> None:
        """Log the run's settings; on a resume (``step`` > 0) into an MLflow run that holds other
        values for some of them, each changed one is logged as ``<key>.from_step_<step>``.

        MLflow refuses to change a logged param. The resumed run stays one MLflow run, so its
        curves go on as one line, with the first values kept and each change dated by its step."""
        values = {k: str(v)[:500] for k, v in params.items()}
        self._to_mlflow(functools.partial(_log_params, values, step))
        if self._tensorboard is not None:
            table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
            self._tensorboard.add_text("params", f"| param | value |\n|---|---|\n{table}")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log a step's finite numbers; an RL step an earlier start already logged is not logged
        again (its points stand: one point per step, however often the run resumed)."""
        if 0 < step <= self._logged_until and not any(k.startswith(("sft/", "rm/")) for k in metrics):
            return
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self._to_mlflow(functools.partial(_log_metrics, finite, step))
        if self._wandb is not None and not self._closed:
            self._wandb.log_metrics(finite, step)
        if self._tensorboard is not None:
            for name, value in finite.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            # a step's points reach the disk now, not at the writer's next timed flush: a job
            # killed by Slurm or the reaper keeps every step it finished
            self._tensorboard.flush()

    def log_table(
        self, name: str, records: list[dict[str, Any]], columns: Sequence[str], *, mlflow: bool = True
    ) -> None:
        """``records``' ``columns`` as a table: in MLflow (``mlflow``: ``<name>.json`` among the
        run's artifacts, shown in the UI's evaluation view) and wandb; values that are not text or
        numbers go as JSON text."""
        data = {column: [_cell(r.get(column)) for r in records] for column in columns}
        if mlflow:
            self._to_mlflow(lambda run: run.client.log_table(run.run_id, data=data, artifact_file=f"{name}.json"))
        if self._wandb is not None and not self._closed:
            self._wandb.log_table(name, records, columns, _cell)

    def log_artifact(self, path: str | os.PathLike) -> None:
        self._to_mlflow(lambda run: run.client.log_artifact(run.run_id, str(path)))
        if self._wandb is not None and not self._closed:
            self._wandb.log_file(Path(path))

    def close(self, status: str = "FINISHED") -> None:
        if self._mlflow is not None and not self._closed:
            self._mlflow.client.set_terminated(self._mlflow.run_id, status=status)
        if self._wandb is not None and not self._closed:
            self._wandb.finish(status)
        self._closed = True
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _cell(value: Any) -> Any:
    """A table cell: text and numbers as they are, anything else as JSON text."""
    return value if isinstance(value, (str, int, float)) or value is None else json.dumps(value)


def _empty_store() -> Path:
    """This machine's empty MLflow SQLite store of the installed MLflow's schema (made once)."""
    import mlflow
    from mlflow import MlflowClient

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridflow"
    template = cache / f"mlflow-{mlflow.__version__}.db"
    if not template.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        staging = cache / f"{template.name}.{os.getpid()}.tmp"
        MlflowClient(tracking_uri=f"sqlite:///{staging}").search_experiments()  # creates the schema
        os.replace(staging, template)
    return template


def _seed_local_store(path: Path) -> None:
    """A new local store at ``path`` as a copy of the empty one (see the module docstring); MLflow
    creates it the slow way if that cannot be made."""
    import shutil

    if path.exists():
        return
    try:
        template = _empty_store()
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(path.name + ".tmp")
        shutil.copyfile(template, staging)
        os.replace(staging, path)
    except OSError as error:  # an unwritable cache: MLflow migrates the new store itself
        logger.debug("no empty MLflow store to copy (%s): MLflow creates %s", error, path)


def _start_mlflow(cfg: HybridflowConfig, run_id: str | None, history: list[dict[str, float]]) -> _MlflowRun:
    """The run's MLflow run in its store: the checkpoint's (reopened) or a new one."""
    from mlflow import MlflowClient

    uri = cfg.run.tracking.uri or default_tracking_uri(cfg.run.output_dir)
    if cfg.run.tracking.uri is None:
        _seed_local_store(Path(cfg.run.output_dir).resolve() / "mlflow.db")
    client = MlflowClient(tracking_uri=uri)
    artifacts = Path(cfg.run.output_dir).resolve() / "mlartifacts"
    name = cfg.run.tracking.experiment
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        # artifacts beside the local store, not under the current directory
        location = artifacts.as_uri() if cfg.run.tracking.uri is None else None
        experiment_id = client.create_experiment(name, artifact_location=location)
    else:
        experiment_id = experiment.experiment_id
    if run_id and not _store_holds(client, run_id):
        logger.warning(
            "the checkpoint's MLflow run %s is not in %s (a checkpoint from another run directory, or "
            "the store removed): starting a new MLflow run with the checkpoint's %d steps so far",
            run_id,
            uri,
            len(history),
        )
        run_id = None
    else:
        history = []
    if run_id:
        client.update_run(run_id, status="RUNNING")
    else:
        # the tags a run started by mlflow.start_run has (user, source, git commit): the UI shows them
        from mlflow.tracking.context.registry import resolve_tags

        run_id = client.create_run(experiment_id, run_name=cfg.run.name, tags=resolve_tags()).info.run_id
    run = _MlflowRun(client=client, run_id=run_id, uri=uri)
    logger.info("MLflow run %s at %s (artifacts under %s)", run_id, uri, artifacts)
    for entry in history:
        _log_metrics({k: float(v) for k, v in entry.items() if math.isfinite(v)}, int(entry["step"]), run)
    return run


def _log_params(values: dict[str, str], step: int, run: _MlflowRun) -> None:
    from mlflow.entities import Param

    logged = run.client.get_run(run.run_id).data.params
    latest = _latest_values(logged)
    changed = {f"{k}{_FROM_STEP}{step}": v for k, v in values.items() if k in latest and latest[k] != v}
    if changed:
        logger.info(
            "settings changed since the MLflow run began, logged as of step %d: %s",
            step,
            ", ".join(f"{k}={v}" for k, v in changed.items()),
        )
    fresh = [Param(k, v) for k, v in {**values, **changed}.items() if k not in logged]
    run.client.log_batch(run.run_id, params=fresh)


def _log_metrics(values: dict[str, float], step: int, run: _MlflowRun) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    run.client.log_batch(run.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])


def _latest_values(logged: dict[str, str]) -> dict[str, str]:
    """Each setting's value now: its newest ``<key>.from_step_<step>``, else ``<key>``."""
    latest, dated = {}, sorted((int(k.rpartition(_FROM_STEP)[2]), k) for k in logged if _FROM_STEP in k)
    latest.update({k: v for k, v in logged.items() if _FROM_STEP not in k})
    latest.update({k.rpartition(_FROM_STEP)[0]: logged[k] for _, k in dated})
    return latest


def _store_holds(client, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException:
        return False
    return True
