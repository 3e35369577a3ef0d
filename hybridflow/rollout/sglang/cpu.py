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
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

__all__ = [
    "STUB_LOG_ENV",
    "STUB_PATH",
    "apply_cpu_environment",
    "cpu_environment",
    "has_cuda_gpu",
    "omp_threads_bind",
]

logger = logging.getLogger(__name__)

STUB_PATH = Path(__file__).resolve().parent / "sgl_kernel_cpu_stub"
"""Directory holding the ``sgl_kernel`` stand-in package; goes first on PYTHONPATH."""
STUB_LOG_ENV = "HYBRIDFLOW_SGL_KERNEL_STUB_LOG"
"""If set, the stand-in appends ``pid name`` here before raising (same name as in the stub)."""
MISSING_NCCL_PATH = "/nonexistent/hybridflow-no-nccl/libnccl.so.2"
"""Deliberately absent: SGLang then treats NCCL as unavailable."""


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


def cpu_environment(tp: int, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The variables the CPU engine needs for ``tp`` ranks, as a dict (nothing is changed)."""
    environ = os.environ if environ is None else environ
    path_entries = [str(STUB_PATH)] + [
        p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(STUB_PATH)
    ]
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join(path_entries),
        "SGLANG_CPU_OMP_THREADS_BIND": omp_threads_bind(tp),
        "SGLANG_NCCL_SO_PATH": MISSING_NCCL_PATH,
    }


def apply_cpu_environment(tp: int) -> bool:
    """On a machine without a CUDA GPU, set the CPU engine's environment; return whether it did.

    Must run before ``sglang`` is imported. The stand-in also goes first on this process's
    ``sys.path``: the engine's own process imports ``sgl_kernel`` too.
    """
    if has_cuda_gpu():
        return False
    if "sglang.srt.utils" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        logger.warning("sglang was imported before the CPU environment was set; its CPU checks may be cached wrong")
    _drop_cuda_sgl_kernel()
    os.environ.update(cpu_environment(tp))
    # first, even if it is already further down (something inserted a path before it since)
    sys.path[:] = [str(STUB_PATH)] + [p for p in sys.path if p != str(STUB_PATH)]
    logger.info("no CUDA GPU: SGLang CPU engine environment set (tp=%d, sgl_kernel stand-in)", tp)
    return True


def _drop_cuda_sgl_kernel() -> None:
    """Forget a CUDA ``sgl_kernel`` imported earlier so the stand-in is the one found."""
    module = sys.modules.get("sgl_kernel")
    if module is not None and not getattr(module, "IS_HYBRIDFLOW_CPU_STUB", False):
        for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
            del sys.modules[name]
