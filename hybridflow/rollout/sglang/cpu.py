"""The environment SGLang's CPU engine needs, in one place; applied only when no CUDA GPU is present.

Every setting below is an environment variable (or ``PYTHONPATH`` entry), because SGLang's
scheduler processes are spawned and read them at import time. They must be in place before
``sglang`` is first imported in this process (``sglang.srt.utils.is_cpu`` caches its answer),
so ``engine.py`` calls ``apply_cpu_environment`` before its lazy ``import sglang``.

Each error below was reproduced on this project's CPU machine by dropping that one setting
(tiny Qwen2, tp=1 for the first two rows, tp=2 for the last two):

=============================  ================================================================
setting                        error without it (SGLang 0.5.23, torch 2.14.1 CUDA build, no GPU)
=============================  ================================================================
SGLANG_USE_CPU_ENGINE=1        SGLang picks no CPU platform; building the model, the rotary
                               embedding imports vllm: ``ModuleNotFoundError: No module named
                               'vllm'`` in the scheduler, which dies.
PYTHONPATH += stand-in dir     ``from sgl_kernel import copy_all_layer_kv_cache_cpu`` in this
                               process imports the installed PyPI ``sglang-kernel`` (CUDA-only):
                               ``ImportError: libcuda.so.1 ... No module named 'common_ops'``.
                               The CPU build is not on PyPI. See ``sgl_kernel_cpu_stub/``.
SGLANG_CPU_OMP_THREADS_BIND    tp > 1: each rank wants a NUMA node of its own:
                               ``AssertionError: SGLANG_CPU_OMP_THREADS_BIND is not set, ...
                               world_size <= n_numa_node``. We give each rank its own slice of
                               the cores this process may run on (set for tp=1 too, so a later
                               engine never inherits another tp's bind string).
SGLANG_NCCL_SO_PATH=<missing>  tp > 1: PyNccl loads the pip ``nvidia-nccl`` library and then
                               ``PyNcclCommunicator`` raises ``ValueError: Expected a cuda
                               device, but got: cpu``. A path that does not exist makes SGLang
                               log that NCCL is unavailable and use gloo only.
=============================  ================================================================

One more variable saves time rather than an error: ``SGLANG_DISABLED_MODEL_ARCHS`` names every
SGLang model module but the one defining the model's architecture (``skipped_model_modules``).
SGLang's model registry imports all of its ~255 model modules when an engine process first loads
it, whatever model it serves: about 1 s of CPU per engine process on this machine, and a logged
"Ignore import error" for each module that needs CUDA (13 per process). Measured on an idle 2-core
machine from a rank that has imported megatron-core (the quickstart model, dummy weights; median
of 3): tp=1 starts in 5.2 s instead of 6.5 s, tp=2 in 5.2 s instead of 6.9 s. GPU engines import
them all, as SGLang does.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import signal
import sys
from collections.abc import Iterator, MutableMapping, Sequence
from multiprocessing import resource_tracker
from pathlib import Path

__all__ = [
    "DISABLED_MODELS_ENV",
    "STUB_LOG_ENV",
    "STUB_PATH",
    "apply_cpu_environment",
    "cpu_environment",
    "forked_engine_processes",
    "gpu_kernels_absent",
    "has_cuda_gpu",
    "omp_threads_bind",
    "register_architectures",
    "skipped_model_modules",
]

logger = logging.getLogger(__name__)

STUB_PATH = Path(__file__).resolve().parent / "sgl_kernel_cpu_stub"
"""Directory holding the ``sgl_kernel`` stand-in package; goes first on PYTHONPATH."""
STUB_LOG_ENV = "HYBRIDFLOW_SGL_KERNEL_STUB_LOG"
"""If set, the stand-in appends ``pid name`` here before raising (same name as in the stub)."""
MISSING_NCCL_PATH = "/nonexistent/hybridflow-no-nccl/libnccl.so.2"
"""Deliberately absent: SGLang then treats NCCL as unavailable."""
DISABLED_MODELS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
"""SGLang's comma-separated list of model module names its registry skips (``sglang.srt.environ``)."""
MODELS_PACKAGE = "sglang.srt.models"


def has_cuda_gpu() -> bool:
    """True when torch sees a CUDA device (then SGLang runs its normal GPU engine)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def omp_threads_bind(tp: int, cores: list[int] | None = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` value: the usable cores cut into ``tp`` contiguous groups.

    With fewer cores than ranks, ranks share cores round-robin (slow, but it runs).
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if not cores:
        raise ValueError("no CPU cores available to bind SGLang ranks to")
    if len(cores) < tp:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(tp))
    per_rank, extra = divmod(len(cores), tp)
    groups, start = [], 0
    for rank in range(tp):
        size = per_rank + (rank < extra)
        groups.append(_core_range(cores[start : start + size]))
        start += size
    return "|".join(groups)


def _core_range(group: list[int]) -> str:
    """``"a-b"`` for consecutive cores, else a comma list (SGLang accepts both)."""
    if group == list(range(group[0], group[-1] + 1)):
        return str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}"
    return ",".join(map(str, group))


def _model_sources() -> dict[str, Path]:
    """SGLang's model modules (name -> file), found without importing any of them (not even
    ``sglang.srt``, whose import takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folders = [Path(root, *MODELS_PACKAGE.split(".")[1:]) for root in spec.submodule_search_locations]
    return {path.stem: path for folder in folders for path in sorted(folder.glob("*.py")) if path.stem != "__init__"}


def skipped_model_modules(architectures: Sequence[str]) -> list[str]:
    """SGLang's model modules that define none of ``architectures`` (``config.json``'s, e.g.
    ``Qwen3MoeForCausalLM``), read as text. Empty when no module defines one: then none is skipped,
    and SGLang's registry reports an unknown architecture as it always does."""
    sources = _model_sources()
    classes = [re.compile(rf"^class {re.escape(name)}\b", re.MULTILINE) for name in architectures]
    needed = {
        name for name, path in sources.items() if any(c.search(path.read_text(errors="replace")) for c in classes)
    }
    return sorted(set(sources) - needed) if needed else []


def register_architectures(architectures: Sequence[str]) -> None:
    """In a process whose SGLang model registry was already loaded (with other modules skipped for
    an earlier engine), add the modules defining ``architectures``: a forked engine process inherits
    that registry and does not load it again."""
    registry = sys.modules.get(f"{MODELS_PACKAGE}.registry")
    if registry is None:
        return
    import importlib

    models = registry.ModelRegistry.models
    missing = set(architectures) - set(models)
    for name in sorted(set(_model_sources()) - set(skipped_model_modules(sorted(missing))) if missing else ()):
        entry = getattr(importlib.import_module(f"{MODELS_PACKAGE}.{name}"), "EntryClass", ())
        for cls in entry if isinstance(entry, list) else [entry]:
            models.setdefault(cls.__name__, cls)


def cpu_environment(
    tp: int, environ: MutableMapping[str, str] | None = None, *, architectures: Sequence[str] = ()
) -> dict[str, str]:
    """The variables the CPU engine needs for ``tp`` ranks serving ``architectures``, as a dict
    (nothing is changed)."""
    environ = os.environ if environ is None else environ
    path_entries = [str(STUB_PATH)] + [
        p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(STUB_PATH)
    ]
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join(path_entries),
        "SGLANG_CPU_OMP_THREADS_BIND": omp_threads_bind(tp),
        "SGLANG_NCCL_SO_PATH": MISSING_NCCL_PATH,
    }
    # set for every start (empty: skip none), so that an engine never inherits another model's list
    env[DISABLED_MODELS_ENV] = ",".join(skipped_model_modules(architectures))
    return env


def apply_cpu_environment(tp: int, *, architectures: Sequence[str] = ()) -> bool:
    """On a machine without a CUDA GPU, set the CPU engine's environment; return whether it did.

    Must run before ``sglang`` is imported. The stand-in also goes first on this process's
    ``sys.path``: the engine's own process imports ``sgl_kernel`` too.
    """
    if has_cuda_gpu():
        return False
    if "sglang.srt.utils" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        logger.warning("sglang was imported before the CPU environment was set; its CPU checks may be cached wrong")
    _drop_cuda_sgl_kernel()
    os.environ.update(cpu_environment(tp, architectures=architectures))
    register_architectures(architectures)
    # first, even if it is already further down (something inserted a path before it since)
    sys.path[:] = [str(STUB_PATH)] + [p for p in sys.path if p != str(STUB_PATH)]
    logger.info("no CUDA GPU: SGLang CPU engine environment set (tp=%d, sgl_kernel stand-in)", tp)
    return True


def gpu_kernels_absent():
    """A block in which GPU kernel packages SGLang reaches through guarded imports are absent
    (``megatron_adapters.cpu_compat.GPU_KERNEL_PACKAGES``): importing SGLang's engine on a CPU
    then skips flashinfer's FP4 quantization and its CUTLASS DSL, 1.2-1.8 CPU s of the 6-8 s import
    in every rank that starts an engine, for kernels a CPU never runs. They import normally after
    the block, before the engine forks its processes."""
    from megatron_adapters.cpu_compat import GPU_KERNEL_PACKAGES, absent_while_importing

    return absent_while_importing(GPU_KERNEL_PACKAGES)


def _drop_cuda_sgl_kernel() -> None:
    """Forget a CUDA ``sgl_kernel`` imported earlier so the stand-in is the one found."""
    module = sys.modules.get("sgl_kernel")
    if module is not None and not getattr(module, "IS_HYBRIDFLOW_CPU_STUB", False):
        for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
            del sys.modules[name]


class _Forking:
    installed = False
    """SGLang's start-method call is wrapped and the at-fork hook registered (once a process)."""
    active = False
    """An engine is being started under ``forked_engine_processes``: a fork now makes one of its processes."""
    inherited_world = None
    """In a forked engine process: the rank's process groups, kept referenced so that they are never
    destroyed there (their gloo threads did not survive the fork; a destructor would wait on them)."""
    lora = False
    """The engine being started serves LoRA adapters (its forked processes then drop pinned memory)."""


def _drop_pinned_host_memory() -> None:
    """Make ``pin_memory`` (the factories' keyword and ``Tensor.pin_memory()``) a no-op for the
    rest of this process: a forked CPU engine process that serves LoRA adapters.

    SGLang's LoRA layers stage offsets and adapter weights in pinned host memory for GPU copies;
    pinning needs a CUDA driver, so without a GPU the engine died at start with ``RuntimeError:
    Found no NVIDIA driver on your system`` (``sglang/srt/lora/layers.py``). On a CPU engine the
    host memory is the device memory: an unpinned tensor serves the same.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class UnpinnedHostMemory(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.pin_memory:
                return args[0]
            kwargs = kwargs or {}
            if kwargs.get("pin_memory"):
                kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
            return func(*args, **kwargs)

    UnpinnedHostMemory().__enter__()  # left open: SGLang builds and loads adapters at any time


def can_fork_engine_processes() -> bool:
    """Whether this process may fork the engine's processes: it never ran OpenMP with more than one
    thread. GNU OpenMP is not fork-safe: a child of a process whose thread team exists hangs in
    its first parallel region. hybridflow's CPU ranks run one OpenMP thread (``launch.torchrun``)."""
    import torch

    return os.environ.get("OMP_NUM_THREADS") == "1" and torch.get_num_threads() == 1


@contextlib.contextmanager
def forked_engine_processes() -> Iterator[None]:
    """CPU only: the engine started in this block forks its scheduler and detokenizer processes
    from this one instead of spawning them, where ``can_fork_engine_processes`` allows.

    Why: a spawned SGLang process re-imports torch, transformers and SGLang before it does
    anything, about 20 s of CPU each (a tp=2 engine starts three), while this process has
    imported all of it already (``sglang.Engine`` imports the scheduler's module). Measured here
    on an idle machine: a tp=2 engine starts in 22 s instead of 66 s, tp=1 in 19 s instead of 38 s.
    SGLang sets the spawn method because CUDA cannot be used in a forked child; without a GPU
    nothing touches CUDA. A forked child starts as a spawned one would: the signal handlers of a
    fresh interpreter, and no process group (SGLang creates its own). ``sglang.Engine`` leaves
    the start method at spawn again.
    """
    if not can_fork_engine_processes():
        logger.info("SGLang's processes are spawned: OMP_NUM_THREADS is not 1 here, so forking could hang them")
        yield
        return
    _install_fork_hooks()
    # a spawned child is handed its parent's resource tracker; a forked one uses the parent's only
    # if it already runs, else the first child to make a semaphore starts its own, a grandchild
    # that the engine's shutdown orphans (a zombie under the launcher, waited on for 20 s)
    resource_tracker.ensure_running()
    _Forking.active = True
    try:
        yield
    finally:
        _Forking.active = False
        multiprocessing.set_start_method("spawn", force=True)


def _install_fork_hooks() -> None:
    if _Forking.installed:
        return
    from sglang.srt.entrypoints import engine as sglang_engine

    set_envs_and_config = sglang_engine._set_envs_and_config  # ends with set_start_method("spawn", force=True)

    def set_envs_config_then_fork(server_args) -> None:
        set_envs_and_config(server_args)
        if _Forking.active:
            multiprocessing.set_start_method("fork", force=True)
            _Forking.lora = bool(server_args.enable_lora)

    sglang_engine._set_envs_and_config = set_envs_config_then_fork
    os.register_at_fork(after_in_child=_as_if_spawned)
    _Forking.installed = True


def _as_if_spawned() -> None:
    """In a forked engine process: a fresh interpreter's signal handlers, no process group and no
    device guard (the tests' placement tracker, ``megatron_adapters/device_guard.py``)."""
    if not _Forking.active:
        return
    _Forking.active = False
    # looked up, not imported: this package does not depend on megatron_adapters, and a process
    # that never imported the guard has none to leave
    guard = sys.modules.get("megatron_adapters.device_guard")
    if guard is not None:
        guard.uninstall()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _Forking.lora:
        _drop_pinned_host_memory()
    from torch.distributed import distributed_c10d

    # ``_world`` is c10d's documented point of override for its process-group registry
    _Forking.inherited_world = distributed_c10d._world
    distributed_c10d._world = distributed_c10d._World()
