"""Weights & Biases beside MLflow and TensorBoard (``run.tracking.trackers`` lists ``wandb``).

The run's settings are its config; every logged step is a row of its history with the phase's own
step (``rl/step``, ``sft/step``, ``rm/step``: a run's SFT steps and RL steps both start at 1);
held-out generations and each step's samples are ``wandb.Table`` s, the figures images. Without a
network or an API key (``run.tracking.wandb_mode=auto``, the default, decides from
``WANDB_API_KEY`` and ``~/.netrc``) the run is written offline under ``<output_dir>/wandb``, which
``wandb sync <output_dir>/wandb/offline-run-*`` uploads later. A resumed run reopens the same
wandb run (its id is kept in the run state). A call that fails warns once and turns wandb off for
the rest of the run: a tracker never stops training.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import netrc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hfschema import gc_pause
from hybridflow.config import HybridflowConfig

logger = logging.getLogger(__name__)

PHASES = ("sft", "rm")
"""Metric prefixes with a step of their own; everything else is an RL step's (``rl/step``)."""


def wandb_mode(setting: str) -> str:
    """``online`` or ``offline``: ``auto`` is online where an API key is known (the environment's
    ``WANDB_API_KEY`` or a ``~/.netrc`` entry for api.wandb.ai)."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


@functools.cache
def _drop_inherited_service() -> None:
    """Forget a wandb service this process inherited (``WANDB_SERVICE``, which wandb exports to
    the children of a process that started one): the service belongs to the parent and outlives
    a start of ours that is killed, keeping that start's run open, so the resumed start's
    ``wandb.init`` of the same id was refused ('run ID ... is in use'). Once per process: the
    service this process starts itself is then its own, and exported for the same reason."""
    os.environ.pop("WANDB_SERVICE", None)


class WandbRun:
    """One hybridflow run's wandb run on rank 0."""

    def __init__(self, cfg: HybridflowConfig, run_id: str | None) -> None:
        import wandb

        _drop_inherited_service()

        tracking, out_dir = cfg.run.tracking, Path(cfg.run.output_dir).resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.mode = wandb_mode(tracking.wandb_mode)
        with gc_pause.paused():  # wandb's import and its service's start: start-up objects
            self.run = wandb.init(
                project=tracking.wandb_project,
                name=cfg.run.name,
                dir=str(out_dir),
                mode=self.mode,
                id=run_id,
                resume="allow" if run_id else None,
                config=dataclasses.asdict(cfg),
                settings=wandb.Settings(silent=True, console="off", init_timeout=60),
            )
        for phase in ("rl", *PHASES):
            self.run.define_metric(f"{phase}/step")
        for phase in PHASES:
            self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
        self.failed = False
        where = f"{self.run.dir}" if self.mode == "offline" else self.run.url
        logger.info("wandb run %s (%s) at %s", self.run.id, self.mode, where)

    @property
    def id(self) -> str:
        return self.run.id

    def _call(self, what: str, call: Callable[[], None]) -> None:
        """``call``, unless wandb failed before; a failure warns once and turns wandb off."""
        if self.failed:
            return
        try:
            call()
        except Exception as error:  # noqa: BLE001 - any wandb failure: the run goes on without it
            self.failed = True
            logger.warning("wandb: %s failed (%s); the run goes on without wandb", what, error)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        phase = next((p for p in PHASES if any(k.startswith(f"{p}/") for k in metrics)), "rl")
        self._call("logging metrics", lambda: self.run.log({**metrics, f"{phase}/step": step}))

    def log_table(self, name: str, records: list[dict[str, Any]], columns: Sequence[str], cell) -> None:
        import wandb

        def log() -> None:
            table = wandb.Table(columns=list(columns), data=[[cell(r.get(c)) for c in columns] for r in records])
            self.run.log({name: table})

        self._call(f"logging the table {name}", log)

    def log_file(self, path: Path) -> None:
        """A figure as an image (``figures/<name>``); any other file saved with the run."""
        import wandb

        if path.suffix == ".png":
            self._call(f"logging {path.name}", lambda: self.run.log({f"figures/{path.stem}": wandb.Image(str(path))}))
        else:
            self._call(f"saving {path.name}", lambda: self.run.save(str(path), base_path=str(path.parent)))

    def finish(self, status: str) -> None:
        self._call("finishing", lambda: self.run.finish(exit_code=0 if status == "FINISHED" else 1))
