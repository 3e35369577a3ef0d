"""Run directories, checkpoints and ``resume: auto``.

```
<output_dir>/
  config.yaml                 the resolved config of the first start
  model/                      the rollout engine's starting model directory
  data/                       generated task files (when data.train_files is empty)
  checkpoints/
    sft_000040/               actor with optimizer state mid-SFT (a checkpoint request, or
                              sft.checkpoint_every); removed once sft/ is complete
    sft/                      actor after the SFT warm-up (+ state.json), and hf/: the same as a
                              Hugging Face directory, which RL loads through model.path's loader
    initial/                  a random model's initial actor (+ hf/), written by a fresh start
                              without SFT whose reference reads it (under any layout); never
                              resumed from
    step_000010/              actor with optimizer state (+ state.json: step, history, MLflow run;
                              config.yaml: the resolved config it was saved under)
    step_000020.partial/      being written: never read, removed by the next save
    step_000030.damaged/      found incomplete at a start and set aside (run.resume_fallback=previous)
  progress.json               phase, steps done / total, the driver's pid (runtime.progress)
  summary.json, reward_curve.png, mlflow.db, mlartifacts/
```

A checkpoint directory is complete only once it has its final name: everything is written
under ``.partial`` (the actor through ``megatron_adapters.checkpoint``, which stages itself too),
``state.json`` last, then one rename. A crash at any point leaves either the previous complete
checkpoint or a ``.partial`` directory that resume ignores.

A published checkpoint can still be damaged later (a deleted or truncated shard, a disk that
filled during a copy, bytes changed in place). ``checkpoint_problem`` reads what the checkpoint
itself lists, without loading a tensor: ``state.json``, each model directory's meta file
(``hybridflow.json``, or FSDP2's ``trainer.json``), megatron's ``metadata.json`` and
``common.pt``, torch's ``.metadata`` and every shard file it names, at least as long as the
byte ranges it records; then every file's CRC-32 against ``checksums.json``, written with the
checkpoint (``runtime.checksums``).
``find_resume`` walks the checkpoints newest first under ``run.resume_fallback``: ``previous``
passes over damaged ones (named with the file) to the newest complete one, ``stop`` refuses
the start. ``config_changes`` compares the config a checkpoint was saved under with this
start's, key by key: a change of the model's tensor shapes cannot load.
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

from hfschema.files import publish_directory, restore_previous, shard_problems, write_atomic
from hybridflow.runtime import checksums

__all__ = [
    "Resume",
    "RunState",
    "checkpoint_dirs",
    "checkpoint_problem",
    "config_changes",
    "find_resume",
    "initial_checkpoint",
    "is_rl_checkpoint",
    "latest_checkpoint",
    "read_state",
    "rm_progress_dirs",
    "write_json_atomic",
]

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
HF_EXPORT = "hf"
"""The SFT checkpoint's Hugging Face export (``checkpoints/sft/hf``)."""
INITIAL = "initial"
"""``checkpoints/initial``: a random model's initial weights (with their export), which the
reference reads when no SFT warm-up or ``model.path`` gives them; never resumed from."""
DAMAGED_SUFFIX = ".damaged"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SFT_DIR = re.compile(r"^sft_(\d+)$")
_RM_DIR = re.compile(r"^rm_(\d+)$")
_MODEL_DIRS = ("actor", "critic")  # the actor always; the critic when the run trained one
_MODEL_FILES = {  # what a complete save writes, by the trainer that wrote it (its meta file first)
    "megatron": ("hybridflow.json", "metadata.json", "common.pt", ".metadata"),
    "fsdp2": ("trainer.json", ".metadata"),
}
_SHOWN_PROBLEMS = 3


@dataclass
class RunState:
    """What a resumed run needs besides the actor's weights and optimizer."""

    step: int = 0
    """RL steps completed."""
    sft_done: bool = False
    """Whether the SFT warm-up finished (its checkpoint is ``checkpoints/sft``)."""
    sft_step: int = 0
    """SFT steps completed when an unfinished SFT was checkpointed (``checkpoints/sft_<step>``)."""
    heldout_after_sft: float | None = None
    """Held-out reward measured right after SFT."""
    history: list[dict[str, float]] = field(default_factory=list)
    """One metrics dict per completed RL step (with its ``step``)."""
    heldout: list[tuple[int, float]] = field(default_factory=list)
    heldout_teacher_kl: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean reverse KL to the distillation teacher on the held-out greedy responses)."""
    """(step, held-out reward) measurements."""
    sft_losses: list[float] = field(default_factory=list)
    """SFT loss per step."""
    rm_step: int = 0
    """``run.mode=rm``: reward-model steps completed (``checkpoints/rm_<step>``)."""
    rm_losses: list[float] = field(default_factory=list)
    """``run.mode=rm``: Bradley-Terry loss per step."""
    rm_heldout_before: float | None = None
    """``run.mode=rm``: held-out pair accuracy before the first step."""
    mlflow_run_id: str | None = None
    """The MLflow run to keep logging into."""
    wandb_run_id: str | None = None
    """The wandb run to keep logging into."""
    wall_seconds: float = 0.0
    """Wall time spent by the starts of this run up to this checkpoint (the sum of ``start_seconds``)."""
    start_seconds: list[float] = field(default_factory=list)
    """Each start's wall seconds up to the checkpoint it left last (the saving start's last): a
    killed attempt's share stays visible instead of hiding in the total."""
    reward_errors: int = 0
    """Reward calls that raised (scored 0) up to this checkpoint, so a resumed run's summary
    counts the earlier starts' errors too."""
    async_buffer: list[list[int]] = field(default_factory=list)
    """Asynchronous RL: the [batch, policy version] pairs pending at this checkpoint, whose samples
    the engine drivers saved beside it (``async_rl.resume=checkpoint``)."""
    checksummed: bool = False
    """Whether the checkpoint's files have their checksums in ``checksums.json`` (``runtime.checksums``;
    False for checkpoints written before checksums were)."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """Settings changed at each resume: ``{"step": RL steps done then, "changed": ["key: was -> now", ...]}``."""


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it over ``path``."""
    write_atomic(path, json.dumps(payload, indent=2))


def read_state(directory: str | os.PathLike) -> RunState:
    """The run state saved in a checkpoint directory; ValueError names the file if it is bad."""
    path = Path(directory) / STATE_FILE
    try:
        raw = json.loads(path.read_text())
        raw["heldout"] = [tuple(x) for x in raw.get("heldout", [])]
        return RunState(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"checkpoint run state {path} is unreadable ({e}); delete that checkpoint "
            "directory to resume from an earlier one"
        ) from None


def save_state(directory: str | os.PathLike, state: RunState) -> None:
    write_json_atomic(Path(directory) / STATE_FILE, asdict(state))


def _numbered(output_dir: str | os.PathLike, pattern: re.Pattern) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Complete RL checkpoints, oldest first."""
    return _numbered(output_dir, _STEP_DIR)


def sft_progress_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints of an unfinished SFT (``sft_<step>``), oldest first."""
    return _numbered(output_dir, _SFT_DIR)


def rm_progress_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints of ``run.mode=rm``'s reward model (``rm_<step>``), oldest first."""
    return _numbered(output_dir, _RM_DIR)


def is_rl_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an RL step's checkpoint (the actor with its RL optimizer state)."""
    return _STEP_DIR.match(path.name) is not None


def sft_checkpoint(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints" / "sft"


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint to resume from: an RL step, else a reward model's, else the
    SFT one, else None."""
    steps = checkpoint_dirs(output_dir) or rm_progress_dirs(output_dir)
    if steps:
        return steps[-1]
    sft = sft_checkpoint(output_dir)
    return sft if (sft / STATE_FILE).is_file() else None


def initial_checkpoint(output_dir: str | os.PathLike) -> Path:
    """A random model's initial weights, kept by a fresh start whose reference reads them."""
    return Path(output_dir) / "checkpoints" / INITIAL


def staging_dir(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def publish(staging: Path, final: Path) -> None:
    """Make a fully written checkpoint visible under its final name (rank 0 only), without
    removing an older copy under that name before the new one is in (``publish_directory``)."""
    publish_directory(staging, final)


def prune(output_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` RL (or reward-model) checkpoints, and the mid-SFT ones
    past the newest ``keep`` or once ``sft`` is complete (rank 0 only, after a save completed)."""
    sft_done = (sft_checkpoint(output_dir) / STATE_FILE).is_file()
    progress = sft_progress_dirs(output_dir)
    steps = checkpoint_dirs(output_dir)[:-keep] + rm_progress_dirs(output_dir)[:-keep]
    for old in steps + (progress if sft_done else progress[:-keep]):
        shutil.rmtree(old, ignore_errors=True)
        logger.debug("removed old checkpoint %s", old)  # housekeeping: not worth breaking a progress bar


# --------------------------------------------------------------------------- resume


def _shard_problems(directory: Path) -> list[str]:
    """Shard files torch's ``.metadata`` lists that are missing or shorter than listed."""
    from torch.distributed.checkpoint import FileSystemReader  # here: the rest of this module is torch-free

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # a truncated or foreign pickle: any error means unreadable
        return [f"{directory / '.metadata'} is unreadable ({type(error).__name__}: {error})"]
    return shard_problems(directory, metadata.storage_data)


def _trainer_of(checkpoint: Path) -> str:
    """The trainer backend whose files the checkpoint's model directories hold: its config's
    ``actor.backend`` (megatron for a checkpoint saved before the setting, or without a config)."""
    import yaml

    try:
        saved = yaml.safe_load((checkpoint / CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "megatron"
    return (saved.get("actor") or {}).get("backend") or "megatron"


def _model_dir_problems(directory: Path, trainer: str) -> list[str]:
    if not directory.is_dir():
        return [f"{directory} is missing"]
    files = _MODEL_FILES[trainer]
    missing = [f"{directory / name} is missing" for name in files if not (directory / name).is_file()]
    if missing:
        return missing
    try:
        json.loads((directory / files[0]).read_text())
    except (OSError, ValueError) as error:
        return [f"{directory / files[0]} is unreadable ({error})"]
    return _shard_problems(directory)


def checkpoint_problem(directory: str | os.PathLike, *, content: bool = True) -> str | None:
    """What makes a published checkpoint unusable (the files named), or None when it is complete.
    ``content``: also compare every file with its recorded checksum (skipped for the checkpoint
    preflight compared already, ``checksums.verified_elsewhere``)."""
    directory = Path(directory)
    try:
        saved = read_state(directory)
    except ValueError:
        return f"{directory / STATE_FILE} is missing or unreadable"
    problems, trainer = [], _trainer_of(directory)
    for name in _MODEL_DIRS:
        if name == "actor" or (directory / name).exists():
            problems += _model_dir_problems(directory / name, trainer)
    if not problems and content and saved.checksummed and not checksums.verified_elsewhere(directory):
        problems = checksums.problems(directory)
    if not problems:
        return None
    more = len(problems) - _SHOWN_PROBLEMS
    return "; ".join(problems[:_SHOWN_PROBLEMS]) + (f" (and {more} more)" if more > 0 else "")


@dataclass(frozen=True)
class Resume:
    """Where a start continues from, and the newer checkpoints passed over on the way."""

    path: Path | None
    """The newest complete checkpoint; None: a fresh start."""
    damaged: tuple[tuple[Path, str], ...] = ()
    """(checkpoint, what is wrong with it) for each newer one found damaged, newest first."""


def _candidates(output_dir: Path) -> list[Path]:
    """Published checkpoints, newest first: the RL steps, the reward model's (``run.mode=rm``),
    the SFT one, then an unfinished SFT's."""
    sft = sft_checkpoint(output_dir)
    return (
        list(reversed(checkpoint_dirs(output_dir)))
        + list(reversed(rm_progress_dirs(output_dir)))
        + ([sft] if sft.is_dir() else [])
        + list(reversed(sft_progress_dirs(output_dir)))
    )


def find_resume(
    output_dir: str | os.PathLike, resume: str, *, fallback: str = "previous", content: bool = True
) -> Resume:
    """The checkpoint a start continues from under ``run.resume`` and ``run.resume_fallback``;
    ValueError (naming the files and the fix) when ``never`` meets a directory that holds
    checkpoints, when ``stop`` meets a damaged newest one, or when none is complete.
    ``content``: compare checksums too (``checkpoint_problem``)."""
    output_dir = Path(output_dir)
    if (output_dir / "checkpoints").is_dir():  # a publish cut short between its renames (publish_directory)
        for path in restore_previous(output_dir / "checkpoints"):
            logger.warning("restored checkpoint %s, whose replacement was cut short", path)
    candidates = _candidates(output_dir)
    if candidates and resume == "never":
        raise ValueError(
            f"run.output_dir={output_dir} already holds checkpoints ({candidates[0].name}); set "
            "run.resume=auto to continue that run, or pick a new run.name / run.output_dir"
        )
    damaged: list[tuple[Path, str]] = []
    for path in candidates:
        problem = checkpoint_problem(path, content=content)
        if problem is None:
            return Resume(path=path, damaged=tuple(damaged))
        if fallback == "stop":
            raise ValueError(
                f"checkpoint {path.name} is damaged: {problem}; set run.resume_fallback=previous to "
                f"resume from the newest complete checkpoint, or move {path} away"
            )
        damaged.append((path, problem))
    if damaged:
        raise ValueError(
            f"no complete checkpoint in {output_dir / 'checkpoints'} (newest: {damaged[0][0].name}: "
            f"{damaged[0][1]}); restore the files, or set a new run.output_dir to start over"
        )
    return Resume(path=None)


def set_aside(damaged: tuple[tuple[Path, str], ...]) -> None:
    """Rename damaged checkpoints to ``<name>.damaged`` (rank 0 only): resume and pruning no longer
    see them, and their files stay for a look."""
    for path, problem in damaged:
        target = path.with_name(path.name + DAMAGED_SUFFIX)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(path, target)
        logger.warning("checkpoint %s is damaged (%s); set aside as %s", path, problem, target.name)


def resume_point(
    output_dir: str | os.PathLike, resume: str, *, fallback: str = "previous", set_aside_damaged: bool = False
) -> Path | None:
    """The checkpoint a start continues from (``find_resume``); with ``set_aside_damaged`` (the
    run's rank 0) the damaged newer ones are renamed out of the way."""
    found = find_resume(output_dir, resume, fallback=fallback)
    if set_aside_damaged:
        set_aside(found.damaged)
    if found.path is not None:
        logger.info("resuming from %s", found.path)
    return found.path


# --------------------------------------------------------------------------- config changes


def recorded_config(checkpoint: Path, output_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """The config a checkpoint was saved under: its own ``config.yaml``, else the run's first start's."""
    import yaml

    for path in (checkpoint / CONFIG_FILE, Path(output_dir) / CONFIG_FILE):
        if path.is_file():
            try:
                loaded = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(loaded, dict):
                return path, loaded
    return None


class _Absent:
    def __repr__(self) -> str:
        return "(no such key now)"


_ABSENT = _Absent()


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model.num_layers": 2, ...}`` for nested mappings (lists stay values)."""
    if not isinstance(tree, dict) or not tree and prefix:
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _tensor_shapes(model: dict) -> dict[str, tuple[int, ...]] | None:
    """The model's Hugging Face tensors and shapes (what the checkpoint's shapes follow), or None
    when ``model`` is no longer a valid model section."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from hybridflow.config import ModelSection
    from reshard.families import canonical_tensors

    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelSection), model))
        return {t.name: t.shape for t in canonical_tensors(config)}
    except (OmegaConfBaseException, ValueError, TypeError):
        return None


def config_changes(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(changes the checkpoint cannot load into, other changes) between the config a checkpoint
    was saved under and this start's (both plain resolved dicts), one ``key: was -> now`` each.

    The first list is the model keys that changed when the model's tensors changed name or shape
    (megatron would fail with a shape error); everything else loads and is only reported. Keys
    the recorded config lacks (fields added since, at their defaults) are not changes.
    """
    before, after = _flat(recorded), _flat(current)
    changed = sorted(k for k in before if before[k] != after.get(k, _ABSENT))
    lines = {k: f"{k}: {before[k]!r} -> {after.get(k, _ABSENT)!r}" for k in changed}
    model_keys = [k for k in changed if k.startswith("model.")]
    shapes_before, shapes_after = _tensor_shapes(recorded.get("model", {})), _tensor_shapes(current.get("model", {}))
    # a recorded model this version cannot read (a field since removed) is not refused here
    blocking = model_keys if shapes_before is not None and shapes_before != shapes_after else []
    return [lines[k] for k in blocking], [lines[k] for k in changed if k not in blocking]


def check_config_loads(checkpoint: Path, output_dir: str | os.PathLike, current: dict) -> list[str]:
    """The changes since ``checkpoint`` was saved (``current``: this start's resolved config as a
    plain dict) that it loads despite; ValueError naming each key it cannot load into."""
    recorded = recorded_config(checkpoint, output_dir)
    if recorded is None:
        return []  # a run from before configs were kept: megatron's own error is all there is
    path, config = recorded
    blocking, other = config_changes(config, current)
    if blocking:
        raise ValueError(
            f"checkpoint {checkpoint.name} holds a different model than this config "
            f"({'; '.join(blocking)}; saved under {path}): restore those model keys to resume, "
            "or set a new run.output_dir for a new run"
        )
    return other
