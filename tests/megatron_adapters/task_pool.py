"""The task loop of the torchrun test workers: one process pool, many tasks.

Every rank runs every task of the JSON list named by ``sys.argv[1]``; rank 0 writes each result
to the task's ``out`` (temporary file, then rename). A task that raises records its traceback
there instead, so one failing case does not hide the others.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_adapters import parallel


def run_tasks(run: Callable[[dict], object]) -> None:
    """Initialise the default group, ``run(task)`` each task (without its ``out``), tear down."""
    tasks = json.loads(open(sys.argv[1]).read())
    # the workers' imports live as long as the pool: frozen, no task's collections scan them again
    # (as a rank of hybridflow train does after its imports, hfschema/gc_pause.py)
    gc.freeze()
    parallel.init_default_group()
    for task in tasks:
        out = task.pop("out")
        try:
            result = run(task)
        except Exception:
            result = {"exception": traceback.format_exc()}
        finally:
            parallel.teardown()
        if dist.get_rank() == 0:
            torch.save(result, out + ".tmp")
            os.replace(out + ".tmp", out)
        dist.barrier()
    dist.destroy_process_group()
