"""An FSDP2 policy's checkpoint: its model (and optimizer) shards through
torch.distributed.checkpoint, the schedule's position, and the model directory's own files;
loadable under another data-parallel size (DCP reshards on load), and readable by one process
alone into a Hugging Face directory (``export.export_checkpoint``).

```
<dir>/            written as <dir>.tmp by every rank, published by rank 0 once all are done
  .metadata, __*_*.distcp   "model.<name>" shards, and "optimizer.*" with the optimizer (DCP)
  trainer.json              {"format", "steps": optimizer steps taken, "step": the run's, "with_optimizer"}
  hf_files/                 the starting directory's config.json, tokenizer, chat template
```
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hfschema.files import publish_directory, write_atomic
from hfschema.hf_config import SIDE_FILE_DIR, side_files

__all__ = ["FORMAT", "TRAINER_FILE", "load", "read_meta", "save"]

TRAINER_FILE = "trainer.json"
FORMAT = "fsdp2 dcp"


def _state(policy, with_optimizer: bool) -> dict:
    if with_optimizer and policy.optimizer is None:
        raise RuntimeError("this policy was built with trainable=False: it has no optimizer state to save or load")
    if not with_optimizer:
        return {"model": get_model_state_dict(policy.model)}
    model, optimizer = get_state_dict(policy.model, policy.optimizer)
    return {"model": model, "optimizer": optimizer}


def save(policy, directory: str | Path, *, with_optimizer: bool = True, step: int = 0) -> Path:
    """Write ``policy`` to ``directory`` (every rank of its group calls it); a crash leaves the
    last copy."""
    final = Path(directory)
    staging = final.with_name(final.name + ".tmp")
    first = policy.group.rank() == 0
    if first:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier(group=policy.group)
    dcp.save(_state(policy, with_optimizer), checkpoint_id=str(staging), process_group=policy.group)
    if first:
        meta = {"format": FORMAT, "steps": policy.steps, "step": step, "with_optimizer": with_optimizer}
        write_atomic(staging / TRAINER_FILE, json.dumps(meta))
        files = staging / SIDE_FILE_DIR
        files.mkdir()
        for file in side_files(policy.source):
            shutil.copy2(file, files / file.name)
    dist.barrier(group=policy.group)
    if first:
        publish_directory(staging, final)
    dist.barrier(group=policy.group)
    return final


def read_meta(directory: str | Path) -> dict:
    """``trainer.json`` of a checkpoint ``save`` wrote; ValueError naming the file otherwise."""
    path = Path(directory) / TRAINER_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: {directory} is not an FSDP2 checkpoint (actor.backend=fsdp2 writes one)")
    return json.loads(path.read_text())


def load(policy, directory: str | Path, *, with_optimizer: bool = False) -> dict:
    """Put a checkpoint ``save`` wrote into ``policy`` (any data-parallel size): the model, and
    with ``with_optimizer`` the optimizer and the schedule's position. Returns its meta."""
    directory = Path(directory)
    meta = read_meta(directory)
    if with_optimizer and not meta["with_optimizer"]:
        raise ValueError(f"{directory} holds no optimizer state (saved without it); load it with_optimizer=False")
    state = _state(policy, with_optimizer)
    dcp.load(state, checkpoint_id=str(directory), process_group=policy.group)
    if with_optimizer:
        set_state_dict(
            policy.model, policy.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        policy.steps = meta["steps"]
    else:
        set_model_state_dict(policy.model, state["model"])
    return meta
