"""torchrun worker (2 processes, EP=2) for the device guard: the policy passes under it, and two
planted GPU bugs are caught on this CPU.

Run as ``torchrun --standalone --nproc-per-node 2 guard_worker.py OUT.json`` with
``HYBRIDFLOW_DEVICE_GUARD=1``. Rank 0 writes what each scenario raised (or "ok").
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron.core import parallel_state  # noqa: E402
from worker import make_policy, score, step  # noqa: E402

from megatron_adapters import parallel  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402


def _host_grads_finite(self) -> bool:
    """The pre-fix check: its flag tensor is made on the host, then all-reduced."""
    bad = torch.zeros(1)
    for chunk in self.chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            bad += (~torch.isfinite(buffer.grad_data)).any()
    dist.all_reduce(bad)
    return bad.item() == 0


def _rows_left_on_host(self, batch, local_rows=False):
    """The pre-fix batching: this rank's rows, never moved to the device."""
    if local_rows:
        return dict(batch)
    share = batch["input_ids"].shape[0] // self.layout.dp
    rank = parallel_state.get_data_parallel_rank()
    return {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}


def _attempt(fn) -> str:
    try:
        fn()
    except Exception as error:  # the outcome is the result
        return f"{type(error).__name__}: {error}"
    return "ok"


def main() -> None:
    parallel.init_default_group()
    policy = make_policy("qwen3_moe", {"ep": 2})
    results = {"clean": _attempt(lambda: (score(policy), step(policy)))}
    original = MegatronPolicy._grads_finite
    MegatronPolicy._grads_finite = _host_grads_finite
    results["host_flag_in_all_reduce"] = _attempt(lambda: step(policy))
    MegatronPolicy._grads_finite = original
    original_rows = MegatronPolicy._dp_rows
    MegatronPolicy._dp_rows = _rows_left_on_host
    results["batch_not_moved"] = _attempt(lambda: score(policy))
    MegatronPolicy._dp_rows = original_rows
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(results, out)
    parallel.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
