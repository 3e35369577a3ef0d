"""A rank's device and its default process group, the same for every trainer backend.

``device()`` is decided here once: ``cuda:LOCAL_RANK`` with CUDA, else the CPU. Every tensor a
rank computes with, and every tensor it hands to a collective on the default backend, lives
there; callers take it from here (or from a tensor already on it) instead of writing ``.cuda()``.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["backend", "device", "init_default_group"]


def backend() -> str:
    """The torch.distributed backend for this machine."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's device (see the module's docstring)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_default_group(
    timeout_minutes: int = 10, *, store=None, rank: int | None = None, world_size: int | None = None
) -> None:
    """Start torch.distributed from torchrun's environment (or as one process without it); with
    ``store``, as ``rank`` of ``world_size`` over it instead (one of two worlds that share a
    torchrun job: the actor's and the engine ranks', separate placement)."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    if store is not None:
        dist.init_process_group(backend=backend(), store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group(backend=backend(), timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
