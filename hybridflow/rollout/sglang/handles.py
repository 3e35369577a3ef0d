"""Per-rank payloads for SGLang's ``load_format="direct"`` pushes, made in the process that owns the data.

SGLang's ``update_weights_from_tensor`` takes, for every parameter, one pickled value per TP rank
(``LocalSerializedTensor``), and scheduler r unpickles ``values[r]`` only. The value need not
carry the weights: torch's multiprocessing pickler writes a CUDA tensor as a CUDA-IPC handle and,
under the ``file_system`` sharing strategy, a CPU tensor as the name of a shared-memory segment.
Any process on the node can open either. So the actor process that holds engine rank r's share
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

``file_system`` is chosen over torch's default ``file_descriptor`` strategy because a descriptor
can only be handed over by the process that owns it, through a socket authenticated with that
process's multiprocessing key, which the engine's schedulers (children of another process) do
not share. The strategy is switched only around the pickling and restored after. torch serves it with a
``torch_shm_manager`` child process (which the engine's shutdown leaves alone: see ``engine._shutdown``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing

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


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def share(tensor: torch.Tensor) -> bytes:
    """``tensor`` pickled as a handle another process on this node can open (no copy of the data
    travels). The caller keeps ``tensor`` alive until the receiver has copied it."""
    buffer = io.BytesIO()
    if tensor.is_cuda:
        _device_uuid_reductions()
        ForkingPickler(buffer).dump(tensor)
    else:
        with _file_system_sharing():
            ForkingPickler(buffer).dump(tensor)
    return buffer.getvalue()


def open_handle(handle: bytes) -> torch.Tensor:
    """The tensor a ``share`` handle names, opened in this process without copying its data (what
    each SGLang scheduler does with its ``values[r]``)."""
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
