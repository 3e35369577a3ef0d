"""Metrics to MLflow (rank 0 only), or nowhere with ``run.tracking.backend=none``.

The default store is local: a SQLite database under the run directory
(``<output_dir>/mlflow.db``, artifacts beside it), so a laptop run needs no server and
``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`` shows it. A resumed run
reopens the same MLflow run (its id is kept in the run state) and keeps logging at the next step.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from hybridflow.config import HybridflowConfig

__all__ = ["Tracker", "default_tracking_uri"]

logger = logging.getLogger(__name__)


def default_tracking_uri(output_dir: str | os.PathLike) -> str:
    """The local store of a run directory."""
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


class Tracker:
    """Logs params, metrics and artifacts of one run; inert on ranks other than 0."""

    def __init__(self, cfg: HybridflowConfig, *, active: bool, run_id: str | None = None) -> None:
        self.run_id: str | None = None
        self.uri: str | None = None
        self._mlflow = None
        if not active or cfg.run.tracking.backend == "none":
            return
        import mlflow

        uri = cfg.run.tracking.uri or default_tracking_uri(cfg.run.output_dir)
        mlflow.set_tracking_uri(uri)
        artifacts = Path(cfg.run.output_dir).resolve() / "mlartifacts"
        name = cfg.run.tracking.experiment
        if mlflow.get_experiment_by_name(name) is None:
            # artifacts beside the local store, not under the current directory
            location = artifacts.as_uri() if cfg.run.tracking.uri is None else None
            mlflow.create_experiment(name, artifact_location=location)
        mlflow.set_experiment(name)
        run = mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(run_name=cfg.run.name)
        self._mlflow = mlflow
        self.run_id = run.info.run_id
        self.uri = uri
        logger.info("MLflow run %s at %s (artifacts under %s)", self.run_id, uri, artifacts)

    def log_params(self, params: dict[str, Any]) -> None:
        if self._mlflow is not None:
            self._mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._mlflow is None:
            return
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self._mlflow.log_metrics(finite, step=step)

    def log_artifact(self, path: str | os.PathLike) -> None:
        if self._mlflow is not None:
            self._mlflow.log_artifact(str(path))

    def close(self, status: str = "FINISHED") -> None:
        if self._mlflow is not None:
            self._mlflow.end_run(status=status)
            self._mlflow = None
