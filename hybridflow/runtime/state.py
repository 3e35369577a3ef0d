"""Run directories, checkpoints and ``resume: auto``.

```
<output_dir>/
  config.yaml                 the resolved config of the first start
  model/                      the rollout engine's starting model directory
  data/                       generated task files (when data.train_files is empty)
  checkpoints/
    sft/                      actor after the SFT warm-up (+ state.json)
    step_000010/              actor with optimizer state (+ state.json: step, history, MLflow run)
    step_000020.partial/      being written: never read, removed by the next save
  summary.json, reward_curve.png, mlflow.db, mlartifacts/
```

A checkpoint directory is complete only once it has its final name: everything is written
under ``.partial`` (the actor through ``megatron_adapters.checkpoint``, which stages itself too),
``state.json`` last, then one rename. A crash at any point leaves either the previous complete
checkpoint or a ``.partial`` directory that resume ignores.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hfschema.files import write_text_atomic

__all__ = ["RunState", "checkpoint_dirs", "latest_checkpoint", "read_state", "write_json_atomic"]

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class RunState:
    """What a resumed run needs besides the actor's weights and optimizer."""

    step: int = 0
    """RL steps completed."""
    sft_done: bool = False
    """Whether the SFT warm-up finished (its checkpoint is ``checkpoints/sft``)."""
    heldout_after_sft: float | None = None
    """Held-out reward measured right after SFT."""
    history: list[dict[str, float]] = field(default_factory=list)
    """One metrics dict per completed RL step (with its ``step``)."""
    heldout: list[tuple[int, float]] = field(default_factory=list)
    """(step, held-out reward) measurements."""
    sft_losses: list[float] = field(default_factory=list)
    """SFT loss per step."""
    mlflow_run_id: str | None = None
    """The MLflow run to keep logging into."""
    wall_seconds: float = 0.0
    """Wall time spent by earlier starts of this run."""
    reward_errors: int = 0
    """Reward calls that raised (scored 0) up to this checkpoint, so a resumed run's summary
    counts the earlier starts' errors too."""


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it over ``path``."""
    write_text_atomic(path, json.dumps(payload, indent=2))


def read_state(directory: str | os.PathLike) -> RunState:
    """The run state saved in a checkpoint directory; ValueError names the file if it is bad."""
    path = Path(directory) / STATE_FILE
    try:
        raw = json.loads(path.read_text())
        raw["heldout"] = [tuple(x) for x in raw.get("heldout", [])]
        return RunState(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"checkpoint run state {path} is unreadable ({e}); delete that checkpoint "
                         "directory to resume from an earlier one") from None


def save_state(directory: str | os.PathLike, state: RunState) -> None:
    write_json_atomic(Path(directory) / STATE_FILE, asdict(state))


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Complete RL checkpoints, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def sft_checkpoint(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints" / "sft"


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint to resume from: an RL step, else the SFT one, else None."""
    steps = checkpoint_dirs(output_dir)
    if steps:
        return steps[-1]
    sft = sft_checkpoint(output_dir)
    return sft if (sft / STATE_FILE).is_file() else None


def staging_dir(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def publish(staging: Path, final: Path) -> None:
    """Make a fully written checkpoint visible under its final name (rank 0 only)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def prune(output_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` RL checkpoints (rank 0 only, after a save completed)."""
    for old in checkpoint_dirs(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
        logger.info("removed old checkpoint %s", old)


def resume_point(output_dir: str | os.PathLike, resume: str) -> Path | None:
    """The checkpoint a start continues from under ``run.resume``; ValueError when ``never``
    meets a directory that already holds checkpoints (nothing of that run is touched)."""
    latest = latest_checkpoint(output_dir)
    if latest is not None and resume == "never":
        raise ValueError(f"run.output_dir={output_dir} already holds checkpoints ({latest.name}); set "
                         "run.resume=auto to continue that run, or pick a new run.name / run.output_dir")
    return latest
