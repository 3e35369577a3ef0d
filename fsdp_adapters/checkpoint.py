"""An FSDP2 policy's checkpoint: its model and optimizer shards through torch.distributed.checkpoint,
and the schedule's position; loadable under another data-parallel size (DCP reshards on load).

```
<dir>/            written as <dir>.tmp by every rank, published by rank 0 once all are done
  .metadata, __*_*.distcp   the model's and the optimizer's shards (DCP)
  trainer.json              {"steps": optimizer steps taken}
```
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hfschema.files import publish_directory, write_atomic

__all__ = ["load", "save"]

TRAINER_FILE = "trainer.json"


def _state(policy) -> dict:
    if policy.optimizer is None:
        raise RuntimeError("this policy was built with trainable=False: it has no training state to save or load")
    model, optimizer = get_state_dict(policy.model, policy.optimizer)
    return {"model": model, "optimizer": optimizer}


def save(policy, directory: str | Path) -> Path:
    """Write ``policy`` to ``directory`` (every rank calls it); a crash leaves the last copy."""
    final = Path(directory)
    staging = final.with_name(final.name + ".tmp")
    first = policy.group.rank() == 0
    if first:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier(group=policy.group)
    dcp.save(_state(policy), checkpoint_id=str(staging), process_group=policy.group)
    if first:
        write_atomic(staging / TRAINER_FILE, json.dumps({"steps": policy.steps}))
    dist.barrier(group=policy.group)
    if first:
        publish_directory(staging, final)
    dist.barrier(group=policy.group)
    return final


def load(policy, directory: str | Path) -> None:
    """Put a checkpoint ``save`` wrote into ``policy`` (any data-parallel size)."""
    directory = Path(directory)
    state = _state(policy)
    dcp.load(state, checkpoint_id=str(directory), process_group=policy.group)
    set_state_dict(policy.model, policy.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    policy.steps = json.loads((directory / TRAINER_FILE).read_text())["steps"]
