"""Device guard: a CPU test mode that catches tensors a GPU run would leave on the host.

On a GPU every rank computes on ``cuda:LOCAL_RANK`` and NCCL refuses a host tensor; on a CPU
every tensor is on the CPU, so a tensor created without ``device=`` (or moved with ``.cpu()``)
is on the "right" device by accident and every CPU test passes. With
``HYBRIDFLOW_DEVICE_GUARD=1`` (set by the torchrun tests) a process follows where each tensor
*would* be on a GPU:

```
torch.zeros(3)  torch.tensor([..])  x.cpu()  x.to("cpu")  torch.from_numpy(a)   -> marked host
torch.zeros(3, device=d)  x.to(d)  x.cuda()  megatron's device="cuda" buffers   -> device
any other op: host if a non-scalar input is host (0-dim host scalars mix with device
tensors on GPUs too, except inside cat / stack lists); in-place ops keep their target's mark
                                  │
torch.distributed collectives on a device group (every group not created with
backend="gloo")  and  check_on_device(...)  ──►  DeviceGuardError naming the call, the tensor
                                                   and the line that made it host
```

What it cannot see: placements spelled ``device="cpu"`` or ``device=t.device`` (explicit, so
taken as the rank's device), tensors made inside C++ (autograd, kernels), object collectives
(``broadcast_object_list`` picks its own device), code paths no test runs, and CUDA-only
behaviour itself (streams, IPC, memory). It checks device placement, not values.

It lives beside its two callers, ``parallel.initialize`` (installs it from the environment) and
the policy (checks its inputs), and imports nothing else of the project.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

__all__ = ["ENV", "DeviceGuardError", "check_on_device", "enabled", "install", "is_host", "uninstall"]

ENV = "HYBRIDFLOW_DEVICE_GUARD"
"""Set to 1 to turn the guard on in this process (and the processes it starts)."""

_MARK = "_hybridflow_host_origin"
_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.eye,
    torch.from_numpy,
}
_LIST_OPS = {torch.cat, torch.stack, torch.concat}
_SAME_AS_SELF = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}  # CPU indices index GPU tensors
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "gather",
    "scatter",
    "_all_gather_base",
    "_reduce_scatter_base",
)
_host_groups: set[int] = set()
_mode: "_TrackPlacement | None" = None
_replaced: dict[tuple[Any, str], Any] = {}
"""(module, name) -> the function ``install`` replaced there, for ``uninstall``."""


class DeviceGuardError(RuntimeError):
    """A tensor a GPU run would hold on the host reached device-only code."""


def enabled() -> bool:
    """Whether ``HYBRIDFLOW_DEVICE_GUARD`` asks for the guard in this process."""
    return os.environ.get(ENV, "") not in ("", "0")


def is_host(tensor: torch.Tensor) -> bool:
    """Whether the guard marked ``tensor`` as held on the host."""
    return _origin(tensor) is not None


def check_on_device(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor], where: str) -> None:
    """Raise ``DeviceGuardError`` when a tensor is marked host (no-op with the guard off)."""
    if _mode is None:
        return
    items = tensors.items() if isinstance(tensors, Mapping) else enumerate(tensors)
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor) and is_host(tensor):
            raise DeviceGuardError(
                f"{where}: tensor {name!r} {tuple(tensor.shape)} is on the host "
                f"(made at {_origin(tensor)}); move it to the rank's device"
            )


def install() -> None:
    """Turn the guard on for this process (idempotent): placement tracking and collective checks.

    Install it before megatron-core creates its process groups: the groups it makes with
    ``backend="gloo"`` are host groups, every other group is a device group."""
    global _mode
    if _mode is not None:
        return
    _replace(dist, "new_group", _host_group_recorder(dist.new_group))
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            _replace(dist, name, _checked(getattr(dist, name), name))
    # P2POp accepts only the functions named isend / irecv in c10d's own namespace: rebind those
    # two there as well (the others stay: object collectives call them with host tensors of
    # their own, which is right for gloo and which they move themselves for NCCL)
    _replace(c10d, "isend", dist.isend)
    _replace(c10d, "irecv", dist.irecv)
    _replace(dist, "batch_isend_irecv", _checked_p2p(dist.batch_isend_irecv))
    _mode = _TrackPlacement()
    _mode.__enter__()


def uninstall() -> None:
    """Turn the guard off again (idempotent): the wrapped functions restored, the tracking mode left.

    For a process forked from a guarded rank that is not a rank itself (SGLang's forked engine
    processes, ``hybridflow/rollout/sglang/cpu.py``): a spawned one would never have had it, and
    under the tracking mode SGLang's tp=2 CPU forward gave uniform logits (every log-prob
    -log V), which the guard must never do to a result."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    for (module, name), original in _replaced.items():
        setattr(module, name, original)
    _replaced.clear()
    _host_groups.clear()


def _replace(module: Any, name: str, function: Any) -> None:
    _replaced.setdefault((module, name), getattr(module, name))
    setattr(module, name, function)


def install_from_env() -> None:
    """``install()`` when ``HYBRIDFLOW_DEVICE_GUARD`` is set."""
    if enabled():
        install()


# ---------------------------------------------------------------------------- placement


def _origin(tensor: Any) -> str | None:
    return getattr(tensor, _MARK, None) if isinstance(tensor, torch.Tensor) else None


def _caller() -> str:
    """file:line of the first frame outside torch and this module (where the host tensor came from)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith("device_guard.py"):
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown"


def _inputs(args: tuple, kwargs: dict) -> Iterable[tuple[torch.Tensor, bool]]:
    """(tensor, inside a list) for every tensor argument, one level into lists and tuples."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value, False
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item, True


def _host_input(func, args: tuple, kwargs: dict) -> str | None:
    """The origin of a host input that makes this op's result a host tensor, or None."""
    if func in _SAME_AS_SELF:
        return _origin(args[0]) if args else None
    tensors = list(_inputs(args, kwargs))
    host = [(t, listed) for t, listed in tensors if is_host(t)]
    if not host:
        return None
    if len(host) == len(tensors):
        return _origin(host[0][0])
    for tensor, listed in host:
        if tensor.dim() > 0 or listed or func in _LIST_OPS:
            return _origin(tensor)
    return None  # only 0-dim host scalars beside device tensors: fine on a GPU too


def _to_host(func, args: tuple, kwargs: dict) -> bool | None:
    """True / False when the call moves its result to the host / the device; None otherwise."""
    if func is torch.Tensor.cpu:
        return True
    if func in (torch.Tensor.cuda,):
        return False
    if func is torch.Tensor.to:
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device, int))), None))
        if target is None:
            return None
        return isinstance(target, str) and target == "cpu"  # a literal "cpu": a move to the host
    if "device" in kwargs and kwargs["device"] is not None:
        return False
    if func in _FACTORIES:
        return True
    return None


def _mark_outputs(result: Any, origin: str | None) -> None:
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    for out in outputs:
        if isinstance(out, torch.Tensor):
            if origin is None:
                if hasattr(out, _MARK):
                    delattr(out, _MARK)
            else:
                setattr(out, _MARK, origin)


class _TrackPlacement(TorchFunctionMode):
    """Marks every tensor a GPU run would hold on the host (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__") or name.startswith("__i"):
            return result  # in place: the target keeps its placement (copy_ into a device buffer)
        moved = _to_host(func, args, kwargs)
        if moved is not None and args and result is args[0]:
            # .to(device) / .cuda() / .cpu() returned its input itself (one device here): a GPU run
            # gets a new tensor, so mark an alias and leave the input's own mark as it was
            result = result.view_as(result)
        if moved is None:
            origin = _host_input(func, args, kwargs)
        else:
            origin = _caller() if moved else None
        if origin is not None or moved is False or any(is_host(t) for t, _ in _inputs(args, kwargs)):
            _mark_outputs(result, origin)
        return result


# ---------------------------------------------------------------------------- collectives


def _host_group_recorder(original):
    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if group is not None and isinstance(backend, str) and "gloo" in backend and "nccl" not in backend:
            _host_groups.add(id(group))
        return group

    return new_group


def _check_tensors(name: str, value: Any, group: Any) -> None:
    if group is not None and id(group) in _host_groups:
        return
    tensors = value if isinstance(value, (list, tuple)) else [value]
    for tensor in tensors:
        if isinstance(tensor, (list, tuple)):
            _check_tensors(name, tensor, group)
        elif isinstance(tensor, torch.Tensor) and is_host(tensor):
            raise DeviceGuardError(
                f"torch.distributed.{name} got a host tensor {tuple(tensor.shape)} {tensor.dtype} "
                f"(made at {_origin(tensor)}) on a device group: NCCL would refuse it on a GPU; "
                "create it on the rank's device"
            )


def _checked(collective, name: str):
    @functools.wraps(collective)
    def call(*args, **kwargs):
        group = kwargs.get("group")
        for value in (*args, *kwargs.values()):
            _check_tensors(name, value, group)
        return collective(*args, **kwargs)

    return call


def _checked_p2p(batch):
    @functools.wraps(batch)
    def call(p2p_op_list):
        for op in p2p_op_list:
            _check_tensors("batch_isend_irecv", op.tensor, op.group)
        return batch(p2p_op_list)

    return call
