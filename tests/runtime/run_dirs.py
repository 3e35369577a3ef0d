"""Run directories with checkpoints laid out as ``hybridflow.runtime.worker`` writes them, built
in one process in well under a second: torch's dist-checkpoint writer (the one megatron's
``torch_dist`` format goes through) stores a few small tensors as the actor's shards."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from hybridflow.runtime import state


def model_dir(directory: Path) -> Path:
    """A complete model directory: ``.metadata`` and its shard, megatron's ``metadata.json`` and
    ``common.pt``, and ``hybridflow.json``."""
    directory.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process on purpose
        dcp.save(
            {"decoder.weight": torch.arange(12.0).reshape(4, 3), "output.weight": torch.ones(5)},
            storage_writer=dcp.FileSystemWriter(str(directory)),
            no_dist=True,
        )
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({}, directory / "common.pt")
    (directory / "hybridflow.json").write_text(json.dumps({"format": "megatron-core torch_dist", "step": 0}))
    return directory


def checkpoint(root: Path, name: str, step: int, *, config: str | None = None) -> Path:
    """``root/checkpoints/<name>`` with its run state, the actor and, if given, its config.yaml."""
    path = root / "checkpoints" / name
    model_dir(path / "actor")
    state.save_state(path, state.RunState(step=step, sft_done=True))
    if config is not None:
        (path / state.CONFIG_FILE).write_text(config)
    return path


def shard(path: Path) -> Path:
    """The (only) shard file of a checkpoint's actor."""
    (found,) = (path / "actor").glob("*.distcp")
    return found
