"""Per-rank payloads for SGLang's ``load_format="direct"`` pushes, made in the process that owns the data.

SGLang's ``update_weights_from_tensor`` takes, for every parameter, one pickled value per TP rank
(``LocalSerializedTensor``), and scheduler r unpickles ``values[r]`` only. On a GPU the value need
not carry the weights: torch's multiprocessing pickler writes a CUDA tensor as a CUDA-IPC handle,
which any process on the node can open. So the actor process that holds engine rank r's share
after the reshard pickles it there and ships a few hundred bytes per tensor to the process that
drives the engine; engine rank r then maps its share straight from the owner's memory.

```
actor process r (holds rank r's share)         driver (rank 0)                  SGLang scheduler r
  prepare_rank_payload(r, tensors, params[r])
    check names + shapes, pad, cast
    share(t) -> handle bytes  ── gather ──►  push_rank_payloads([p0, p1, ...])
  keep the tensors alive                        LocalSerializedTensor(values) ──►  open values[r], copy
  until the push returned (barrier)
```

A CPU tensor (CPU runs and tests only) travels by value: its bytes are in the pickle. Neither of
torch's CPU sharing strategies holds up here. ``file_descriptor`` hands a descriptor over a socket
authenticated with the owner's multiprocessing key, which the engine's schedulers (children of
another torchrun worker) do not share. ``file_system`` registers every segment with a
``torch_shm_manager`` helper process that must answer within one second: on a loaded 2-core CI
machine it once did not, and the owner's push failed with "Shared memory manager connection has
timed out". The CPU models are small, so the copy costs nothing that matters.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from hybridflow.rollout.sglang.padding import to_engine_layout

__all__ = [
    "RankPayload",
    "check_rank_tensor",
    "engine_tensor",
    "nbytes",
    "open_handle",
    "prepare_rank_payload",
    "share",
]


@dataclasses.dataclass(frozen=True)
class RankPayload:
    """One engine rank's handles: small, picklable, sent to the driving process."""

    rank: int
    handles: dict[str, bytes]
    """Parameter name -> the pickled handle of the tensor in the engine's shape and dtype."""
    nbytes: int
    """Bytes of weights the engine rank receives (its tensors, padding included)."""


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def check_rank_tensor(
    rank: int, name: str, tensor: torch.Tensor, params: Mapping[str, Mapping[str, Any]]
) -> tuple[tuple[int, ...], torch.dtype]:
    """The engine's (shape, dtype) for ``name`` on ``rank``; ValueError if the engine has no such
    parameter or ``tensor`` cannot be padded to its shape. Allocates nothing."""
    if name not in params:
        raise ValueError(
            f"sliced push: {name!r} (rank {rank}) is not a parameter of the engine's model; "
            f"its parameters are named like {sorted(params)[:3]}"
        )
    shape = tuple(params[name]["shape"])
    try:  # on the meta device: checks the padding rule without allocating
        to_engine_layout(name, torch.empty(tensor.shape, device="meta"), shape)
    except ValueError as error:
        raise ValueError(f"sliced push, rank {rank}: {error}") from None
    return shape, getattr(torch, params[name]["dtype"])


def engine_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` padded to the engine's shape, in its dtype, in storage of its own."""
    return to_engine_layout(name, tensor.detach().to(dtype=dtype), shape).contiguous().clone()


def share(tensor: torch.Tensor) -> bytes:
    """``tensor`` pickled so that another process on this node can open it with SGLang's restricted
    unpickler: a CUDA tensor as an IPC handle (no copy of the data travels; the caller keeps
    ``tensor`` alive until the receiver has copied it), a CPU tensor by value (module docstring)."""
    if not tensor.is_cuda:
        return pickle.dumps(tensor)
    _device_uuid_reductions()
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(tensor)
    return buffer.getvalue()


def open_handle(handle: bytes) -> torch.Tensor:
    """The tensor a ``share`` handle names, opened in this process (what each SGLang scheduler
    does with its ``values[r]``); a CUDA tensor's data is not copied."""
    _device_uuid_reductions()
    return ForkingPickler.loads(handle)


def _device_uuid_reductions() -> None:
    """SGLang's CUDA reductions, which name the device by UUID so that a scheduler seeing the GPUs
    under other indices opens the right one (both sides must use them); without SGLang installed
    (the GPU check machine) torch's own, which name it by index: right within one process tree."""
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        return
    monkey_patch_torch_reductions()


def prepare_rank_payload(
    rank: int, tensors: Mapping[str, torch.Tensor], params: Mapping[str, Mapping[str, Any]]
) -> tuple[RankPayload, list[torch.Tensor]]:
    """Check ``tensors`` against engine rank ``rank``'s ``params`` (``SGLangEngine.rank_params()[rank]``),
    lay them out as the engine's parameters and share them.

    Returns the payload and the shared tensors, which the caller must hold until the push has
    returned. ValueError (naming the tensor and the rank) before anything is shared.
    """
    if not tensors:
        raise ValueError(f"sliced push: no tensors for engine rank {rank}")
    targets = {name: check_rank_tensor(rank, name, tensor, params) for name, tensor in tensors.items()}
    kept = [engine_tensor(name, tensors[name], *targets[name]) for name in tensors]
    handles = {name: share(tensor) for name, tensor in zip(tensors, kept)}
    total = sum(nbytes(shape, dtype) for shape, dtype in targets.values())
    return RankPayload(rank=rank, handles=handles, nbytes=total), kept
