"""CPU stand-in for SGLang's ``sgl_kernel``: importable, but every kernel raises when called.

SGLang's CPU engine imports the CPU build of ``sgl_kernel`` (not on PyPI; the PyPI
``sglang-kernel`` wheels are CUDA-only and fail to import without a GPU). On a CPU without
AMX, SGLang falls back to torch-native attention, sampling, norms and MoE and never calls a
kernel, so names resolve here to functions that record the call and raise. Only
``hybridflow.rollout.sglang.cpu`` puts this directory on ``PYTHONPATH``, and only when no CUDA
GPU is present.

A call is appended (one line: pid and name) to the file named by
``HYBRIDFLOW_SGL_KERNEL_STUB_LOG`` before raising, so a test can prove across SGLang's
spawned processes that no kernel was ever called. Submodules (``sgl_kernel.kvcacheio``, ...)
resolve the same way through a meta-path finder.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.0.0+hybridflow-cpu-stub"
IS_HYBRIDFLOW_CPU_STUB = True
LOG_ENV = "HYBRIDFLOW_SGL_KERNEL_STUB_LOG"


class StubKernelCalled(RuntimeError):
    """A CPU stand-in kernel was called: this SGLang path needs the real CPU sgl_kernel."""


def _record(qualname: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as log:
            log.write(f"{os.getpid()} {qualname}\n")


class _StubKernel:
    """A kernel (or namespace of kernels, e.g. ``scalar_types.uint4b8``) that raises when called.

    Attribute chains give more stubs, so module-level tables that only *name* kernels or
    scalar types import fine; only a call records and raises.
    """

    def __init__(self, qualname: str):
        self._qualname = qualname
        self.__name__ = self.__qualname__ = qualname.rsplit(".", 1)[-1]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubKernel(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        _record(self._qualname)
        raise StubKernelCalled(
            f"{self._qualname} was called, but sgl_kernel is hybridflow's CPU stand-in "
            "(hybridflow/rollout/sglang/sgl_kernel_cpu_stub): this SGLang code path needs the real kernels"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU stand-in {self._qualname}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        # dunder look-ups (``__path__``, ``__file__`` probes by inspect / pickle) must fail
        # normally, or importers mistake the stub for something it is not
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _StubKernel(f"{module_name}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import sgl_kernel.<anything>`` give a stub module like this one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())
