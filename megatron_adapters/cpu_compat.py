"""CPU (gloo) workarounds for megatron-core: the only place hybridflow patches megatron.

megatron-core is written for CUDA and NCCL. On a machine without a GPU (laptops, CI, the CPU
quickstart) a handful of its call sites fail. Each patch below names the error it avoids and is
applied only when ``torch.cuda.is_available()`` is False; on a GPU machine none of them runs.

``block_cuda_only_imports`` must run before the first ``import megatron``; it is called from
``megatron_adapters/__init__.py``. ``apply()`` installs the rest and is idempotent. Tests in
``tests/megatron_adapters/test_cpu_compat.py`` show each failure without its patch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_APPLIED: set[str] = set()
_DEVICE_MODE: "_CudaToCpuMode | None" = None

# CUDA-only packages that sglang installs and megatron imports inside `except ImportError`.
# Their import raises OSError (libcuda.so.1 missing), which those guards do not catch.
CUDA_ONLY_MODULES = ("flash_mla",)
GPU_KERNEL_PACKAGES = ("flashinfer", "deep_ep")
"""GPU kernel libraries that sglang installs and megatron-core's import reaches through guarded
imports (``try: import flashinfer``; inference contexts, the DeepEP token dispatcher). On a CPU
they import fine but only cost time: about 3.5 s of CPU in each process that imports megatron."""


def on_cpu() -> bool:
    """True when this process has no usable CUDA device (the workarounds then apply)."""
    return not torch.cuda.is_available()


def block_cuda_only_imports() -> None:
    """Make CUDA-only extension packages raise ImportError instead of OSError.

    Avoids: ``OSError: Could not load this library: .../flash_mla/cuda.abi3.so`` raised from
    ``megatron/core/transformer/attention.py`` when sglang's flash_mla is installed.
    A ``None`` entry in ``sys.modules`` makes ``import flash_mla`` raise ImportError.
    """
    if not on_cpu():
        return
    if "block_cuda_only_imports" in os.environ.get(SKIP_ENV, ""):
        return
    for name in CUDA_ONLY_MODULES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    _quiet_gpu_extra_fallback_warnings()
    with absent_while_importing(GPU_KERNEL_PACKAGES):
        _disable_jit_fuser()  # imports megatron.core


@contextlib.contextmanager
def absent_while_importing(names: tuple[str, ...]):
    """``names`` raise ImportError inside the block (megatron's and SGLang's guards then take
    their no-kernel branch), and import normally after it: some of SGLang's later imports have
    no guard."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


GPU_EXTRA_WARNINGS = (r"Apex is not installed", r"Transformer Engine and Apex are not installed")
"""megatron-core's import-time UserWarnings for a missing transformer-engine / apex."""


def _quiet_gpu_extra_fallback_warnings() -> None:
    """Hide megatron-core's "Apex is not installed" warnings (and torch's CUDA-runtime one) on a CPU machine.

    Avoids: two to eight warning lines above every ``convert`` error and in every rank's log.
    transformer-engine and apex are the GPU extra (``requirements/gpu.txt``), never installed
    without CUDA, so the fallbacks they announce are the CPU path itself, not a problem to fix.
    Must run before megatron is imported (the warnings fire once, at import).
    """
    import warnings

    for message in GPU_EXTRA_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # the same for torch's "No CUDA runtime is found" when an import reaches its C++ extension
    # builder (a machine without a GPU has no CUDA runtime by definition)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _disable_jit_fuser() -> None:
    """Run megatron's ``@jit_fuser`` functions eagerly on CPU.

    Avoids: a ``torch.compile`` of each fused helper (yarn rotary, router scores, SwiGLU) on its
    first call, several seconds per process on 2 cores, for kernels that fuse nothing on a CPU.
    Must run before megatron's modules that decorate with it are imported.
    """
    from megatron.core import jit

    jit.disable_jit_fuser()


# Comma-separated patch names to leave out: for the tests that show each patch is needed.
SKIP_ENV = "HYBRIDFLOW_CPU_COMPAT_SKIP"


def apply() -> None:
    """Install every CPU workaround (no-op on a GPU machine or when already applied)."""
    if not on_cpu():
        return
    skip = set(filter(None, os.environ.get(SKIP_ENV, "").split(",")))
    for patch in _patches():
        if patch.__name__ not in _APPLIED and patch.__name__ not in skip:
            patch()
            _APPLIED.add(patch.__name__)
            logger.debug("cpu_compat: applied %s", patch.__name__)


def _patches() -> tuple:
    return (
        _patch_cuda_runtime,
        _patch_device_factories,
        _patch_rng_tracker,
        _patch_torch_norm_sequence_parallel,
        _patch_gloo_all_to_all_splits,
        _patch_gloo_uneven_all_gather,
        _patch_moe_utils_te_names,
        _patch_mla_without_te,
        _patch_distrib_optimizer_step_state,
    )


def patch_names() -> set[str]:
    """Every workaround by name, the import-time one included."""
    return {"block_cuda_only_imports"} | {patch.__name__ for patch in _patches()}


def applied() -> frozenset[str]:
    """Names of the patches installed in this process (for tests and logs)."""
    return frozenset(_APPLIED)


# --------------------------------------------------------------------------------------------
# torch.cuda runtime calls
# --------------------------------------------------------------------------------------------


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: ordering on CPU is program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event or _NullEvent()


class _NullEvent:
    """Stands in for ``torch.cuda.Event``; timings read as zero."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_cuda_runtime() -> None:
    """Replace torch.cuda stream / event / device calls that megatron makes unconditionally.

    Avoids: ``torch.AcceleratorError: CUDA error: CUDA driver version is insufficient`` from
    ``torch.cuda.Stream()`` in ``MoEAlltoAllTokenDispatcher.__init__``, and
    ``AssertionError: Torch not compiled with CUDA enabled`` / ``RuntimeError: No CUDA GPUs``
    from ``torch.cuda.current_device()``, ``synchronize()`` and ``current_stream()`` in layer
    constructors, grad sync and the pipeline schedules.
    """
    cuda = torch.cuda
    cuda.Stream = _NullStream  # type: ignore[misc,assignment]
    cuda.Event = _NullEvent  # type: ignore[misc,assignment]
    # A device object, not an ordinal: factories inside autograd backward functions (which
    # run outside the TorchFunctionMode below) then allocate on the CPU too.
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_device = lambda device: None
    cuda.is_current_stream_capturing = lambda: False
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.empty_cache = lambda: None
    # `model_parallel_cuda_manual_seed` seeds the CUDA generator through `cuda.manual_seed`,
    # which on CPU would queue a lazy call that later fails; the CPU tracker below seeds instead.
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None


# --------------------------------------------------------------------------------------------
# device="cuda" in tensor factories, .cuda(), .to("cuda")
# --------------------------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare integer means a CUDA ordinal to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA placements to the CPU for every torch call in the process.

    Avoids: ``RuntimeError: Found no NVIDIA driver`` / ``Torch not compiled with CUDA`` from
    ``torch.empty(..., device=torch.cuda.current_device())``, ``tensor.cuda()`` and
    ``.to("cuda")`` in megatron's mappings, pipeline schedules, optimizer (found-inf buffer)
    and DDP grad buffers. Also reports CPU tensors' ``.type()`` under their CUDA names, which
    avoids ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...
    Received torch.FloatTensor`` in the (distributed) optimizer's parameter sorting.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.pin_memory):
            if func is torch.Tensor.pin_memory:
                return args[0]
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


def _patch_device_factories() -> None:
    """Enter a process-wide TorchFunctionMode that sends CUDA placements to the CPU."""
    global _DEVICE_MODE
    _DEVICE_MODE = _CudaToCpuMode()
    _DEVICE_MODE.__enter__()


# --------------------------------------------------------------------------------------------
# RNG tracker
# --------------------------------------------------------------------------------------------


def _patch_rng_tracker() -> None:
    """Give megatron an RNG tracker over the CPU generator.

    Avoids: ``RuntimeError: Torch not compiled with CUDA enabled`` / ``No CUDA GPUs`` from
    ``CudaRNGStatesTracker.add`` (``torch.cuda.get_rng_state``) and ``fork`` when
    ``model_parallel_cuda_manual_seed`` runs or a TP layer draws dropout masks.
    """
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named RNG states of the CPU generator, forked like the CUDA tracker's."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"rng seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    original_init = mrandom.initialize_rng_tracker

    @functools.wraps(original_init)
    def initialize_rng_tracker(*args: Any, **kwargs: Any) -> None:
        force = kwargs.get("force_reset", False)
        if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED and not force:
            return
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom.CpuRNGStatesTracker = CpuRNGStatesTracker
    initialize_rng_tracker(force_reset=True)


# --------------------------------------------------------------------------------------------
# Norms under sequence parallelism
# --------------------------------------------------------------------------------------------


def _patch_torch_norm_sequence_parallel() -> None:
    """Let megatron's torch-norm wrapper run with sequence parallelism (no apex on CPU).

    Avoids: ``AssertionError: sequence parallel not supported by torch LayerNorm`` from
    ``WrappedTorchNorm``. MoE with TP>1 requires sequence parallelism in megatron-core. The
    norm's weights are replicated across TP ranks while each rank sees a different part of the
    sequence, so their gradients must be all-reduced over TP: tagging them
    ``sequence_parallel = True`` makes megatron's finalize_model_grads do exactly that.
    """
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):  # type: ignore[no-untyped-def]
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# gloo all-to-all
# --------------------------------------------------------------------------------------------


def _split_sizes(sizes: Any) -> Any:
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


def _patch_gloo_all_to_all_splits() -> None:
    """Hand gloo's all_to_all_single its split sizes as Python lists.

    Avoids: ``TypeError: all_to_all_single(): incompatible function arguments`` when
    megatron's alltoall token dispatcher (EP > 1) passes the per-rank token counts as tensors.
    """
    original_all_to_all = dist.all_to_all_single

    @functools.wraps(original_all_to_all)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        # gloo takes split sizes as Python lists; the alltoall dispatcher passes tensors.
        return original_all_to_all(
            output, input, _split_sizes(output_split_sizes), _split_sizes(input_split_sizes), **kw
        )

    dist.all_to_all_single = all_to_all_single


def _patch_gloo_uneven_all_gather() -> None:
    """Let gloo's all_gather take outputs of different row counts.

    Avoids: ``ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (30, 64),
    got (32, 64))`` when megatron's alltoall token dispatcher gathers tokens over expert tensor
    parallelism (etp > 1) and the etp ranks hold different numbers of tokens (data-parallel ranks
    with micro-batches of different lengths). NCCL gathers uneven tensors; gloo needs equal ones,
    so each is padded to the longest and trimmed after.
    """
    original_all_gather = dist.all_gather

    @functools.wraps(original_all_gather)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or len({tuple(t.shape) for t in tensor_list}) <= 1:
            return original_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        staged = [t.new_empty((rows, *t.shape[1:])) for t in tensor_list]
        original_all_gather(staged, padded, group=group)
        for out, got in zip(tensor_list, staged):
            out.copy_(got[: out.shape[0]])
        return None

    dist.all_gather = all_gather


# --------------------------------------------------------------------------------------------
# megatron-core 0.16.1: TE names referenced without TE
# --------------------------------------------------------------------------------------------


def _patch_moe_utils_te_names() -> None:
    """Define the TransformerEngine hooks that megatron-core 0.16.1's moe_utils leaves undefined.

    Avoids: ``NameError: name 'te_general_gemm' is not defined`` in the router's fp32 GEMM when
    TransformerEngine is absent (0.16.1 only; later releases define them as None).
    """
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_topk_with_score_function",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_mla_without_te() -> None:
    """Tell megatron-core 0.16.1's MLA module that TransformerEngine is absent.

    Avoids: ``TypeError: isinstance() arg 2 must be a type`` in ``MLASelfAttention.__init__``:
    its TE import guard succeeds without TE installed (megatron's TE extension module then
    builds its classes on a ``MagicMock``), leaving ``HAVE_TE = True`` with a mock ``TELinear``.
    """
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False


# --------------------------------------------------------------------------------------------
# DistributedOptimizer over plain torch.optim.Adam
# --------------------------------------------------------------------------------------------


def _patch_distrib_optimizer_step_state() -> None:
    """Keep torch Adam's per-parameter ``step`` private when loading distributed optimizer state.

    Avoids: ``KeyError: 'step'`` when a checkpoint is loaded before the first step, and every
    parameter sharing one ``step`` tensor after loading (one resumed step then advanced the
    shared counter once per parameter), with torch Adam standing in for apex/TE FusedAdam.
    """
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = getattr(cls, "_set_main_param_and_optimizer_states", None)
    if original is None:
        logger.warning("cpu_compat: DistributedOptimizer has no _set_main_param_and_optimizer_states")
        return

    def set_states(self, model_param, tensors):  # type: ignore[no-untyped-def]
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        for key, tensor in tensors.items():
            if key == "param":
                main_param.detach().copy_(tensor)
            elif key in state:
                state[key].copy_(tensor)
            else:
                state[key] = tensor.detach().clone()
        if "step" in state and isinstance(state["step"], torch.Tensor):
            state["step"] = state["step"].clone()

    cls._set_main_param_and_optimizer_states = set_states
