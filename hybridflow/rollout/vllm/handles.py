"""Per-rank payloads of a sliced push into vLLM, made in the process that holds the rank's share.

```
actor process r (holds tp rank r's share)            driver                      vLLM worker r
  prepare_rank_payload(r, tensors, params[r])
    check names and shapes, cast
    write one safetensors file in /dev/shm ── gather ──► push_rank_payloads ──► maps paths[r], copies
  (the driver removes the files after the push)            ({"op": "load_ranks"})   (placement.py)
```

The file is the boundary between two interpreters with different torch builds: plain bytes that
vLLM's worker maps without a copy. One copy is made, into the file (from a GPU: device to host;
CUDA IPC across the two torch builds is not attempted in this version).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["RankPayload", "prepare_rank_payload"]


@dataclasses.dataclass(frozen=True)
class RankPayload:
    """One tp rank's share: a file in shared memory, and the bytes of its tensors."""

    rank: int
    path: str
    nbytes: int


def prepare_rank_payload(
    rank: int, tensors: Mapping[str, torch.Tensor], params: Mapping[str, Mapping[str, Any]]
) -> tuple[RankPayload, list[torch.Tensor]]:
    """``tensors`` checked against tp rank ``rank``'s ``params`` (``VLLMEngine.rank_params()[rank]``),
    cast to their dtypes and written to one file. Returns the payload and the tensors as written
    (for the refit check's digests). ValueError naming the tensor and the rank before anything is
    written."""
    from safetensors.torch import save_file

    if not tensors:
        raise ValueError(f"sliced push: no tensors for vLLM rank {rank}")
    for name, tensor in tensors.items():
        if name not in params:
            raise ValueError(
                f"sliced push: {name!r} (rank {rank}) is not a parameter of vLLM's model; its parameters are "
                f"named like {sorted(params)[:3]}"
            )
        if list(tensor.shape) != list(params[name]["shape"]):
            raise ValueError(
                f"sliced push: {name!r} {list(tensor.shape)} (rank {rank}) does not fit vLLM's parameter of shape "
                f"{list(params[name]['shape'])}"
            )
    kept = [t.detach().to("cpu", getattr(torch, params[n]["dtype"])).contiguous() for n, t in tensors.items()]
    directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=f"hybridflow-vllm-rank{rank}-", suffix=".safetensors", dir=directory)
    os.close(fd)
    save_file(dict(zip(tensors, kept)), path)
    return RankPayload(rank=rank, path=path, nbytes=sum(t.numel() * t.element_size() for t in kept)), kept
