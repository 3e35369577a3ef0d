"""The SGLang rollout engine: offline ``sglang.Engine`` (0.5.23) behind the ``RolloutEngine`` protocol.

```
make_engine("sglang", model_path=..., tp=2)
    │  cpu.apply_cpu_environment (only without a CUDA GPU), then the lazy ``import sglang``
    ▼
sglang.Engine: tokenizer manager in this process, one scheduler process per TP rank
    │
    ├─ generate: token ids in ─► output ids, log-probs, finish reasons (+ routed experts, GPU)
    │
    ├─ push_weights(per_rank, route="sliced")             every tensor checked against the
    │     rank r's tensors under SGLang's own names ─►    running engine's parameter names and
    │     handles.prepare_rank_payload: pad, cast, share   shapes (rank_params) BEFORE sending
    │     LocalSerializedTensor(values=[h_r0, h_r1..]),
    │     load_format="direct": rank r opens values[r] only
    ├─ push_rank_payloads([payload_r0, payload_r1, ..])   the same, prepared by the processes
    │                                                     that hold each rank's share (runtime)
    ├─ push_weights(hf_named, route="full")                the baseline: HF checkpoint names,
    │     every rank opens every tensor, its loader slices  checked against the checkpoint
    │  both pushes run inside begin_weight_update() ... end_weight_update()
    └─ load_adapter(name, peft_tensors, peft_config)       an engine started with lora_args():
          SGLang's load_lora_adapter_from_tensors; every    the adapters alone (PEFT names), the
          later generate serves that adapter                base weights stay as pushed
```

Log-probs are those of the unscaled distribution (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; SGLang's
default divides the logits by the temperature first).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from hfschema import gc_pause
from hfschema.buckets import fill_buckets
from hybridflow.config import RolloutConfig
from hybridflow.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Finished,
    PendingBatch,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    WeightPushReport,
    memory_tags,
    register_engine,
)
from hybridflow.rollout.sglang import cpu, handles, param_report, post_load, rank_seed
from hybridflow.rollout.sglang.watch import ProcessWatch

__all__ = ["ROUTES", "SGLangEngine", "SGLangStartError", "lora_args"]

logger = logging.getLogger(__name__)

ROUTES = ("sliced", "full")
"""Weight-push routes: each rank its own shard, or every rank the full HF tensors."""
PAUSE_MODES = ("retract", "in_place", "abort")
"""SGLang's pause modes (``PauseGenerationReqInput.mode``)."""
DEFAULT_BUCKET_BYTES = next(f.default for f in dataclasses.fields(RolloutConfig) if f.name == "push_bucket_mb") << 20
"""Largest payload (per rank) of one ``update_weights_from_tensor`` call: the schema's default."""
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
_NAME_ONLY = torch.empty(0)
"""The tensor of a custom-loader call whose name carries the message: empty, so torch pickles it
without a shared-memory handle, which schedulers on another node (children of another process,
or on another machine) could not open."""
# read by SGLang's sampler at import time in the scheduler processes, so set before start
_ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
_PARAM_REPORT_TIMEOUT_S = 60.0


@register_engine("sglang")
def _start(
    model_path: str,
    *,
    tp: int = 1,
    ep: int = 1,
    dtype: str = "float32",
    max_total_tokens: int = 4096,
    mem_fraction_static: float | None = None,
    seed: int = 0,
    return_routed_experts: bool | None = None,
    deterministic: bool = False,
    pause_mode: str = "retract",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    generate_timeout_s: float | None = None,
    **engine_kwargs: Any,
) -> SGLangEngine:
    """Start an offline SGLang engine on ``model_path`` (a local HF model directory).

    ``return_routed_experts``: None = on for MoE models on a GPU (SGLang cannot on CPU).
    ``deterministic``: SGLang's deterministic inference, which also makes the per-request
    ``SamplingParams.seed`` take effect (GPU only). ``engine_kwargs`` go to ``sglang.Engine``
    unchanged and override the settings chosen here; ``load_format="dummy"`` starts from a
    directory with configs and tokenizer only, and ``generate`` waits for the first push.
    ``generate_timeout_s``: a call that waits on the engine (generate, each weight-update
    call) running longer counts as a hung engine (``EngineLost``, as when one of its processes
    dies; ``watch``); None: no bound.
    """
    engine, own, args, on_cpu, routed = _launch(
        model_path,
        tp=tp,
        ep=ep,
        dtype=dtype,
        max_total_tokens=max_total_tokens,
        mem_fraction_static=mem_fraction_static,
        seed=seed,
        return_routed_experts=return_routed_experts,
        deterministic=deterministic,
        pause_mode=pause_mode,
        engine_kwargs=engine_kwargs,
    )
    return SGLangEngine(
        engine,
        tp=tp,
        on_cpu=on_cpu,
        model_path=model_path,
        routed_experts=routed,
        deterministic=deterministic,
        pause_mode=pause_mode,
        own_processes=own,
        weights_loaded=args.get("load_format") != "dummy",
        bucket_bytes=bucket_bytes,
        generate_timeout_s=generate_timeout_s,
    )


def _launch(
    model_path: str,
    *,
    tp: int,
    ep: int,
    dtype: str,
    max_total_tokens: int,
    mem_fraction_static: float | None,
    seed: int,
    return_routed_experts: bool | None,
    deterministic: bool,
    pause_mode: str,
    engine_kwargs: dict[str, Any],
):
    """``sglang.Engine(...)`` with hybridflow's settings; returns it with the pids it started."""
    on_cpu = not cpu.has_cuda_gpu()
    _check_start(
        tp=tp,
        ep=ep,
        on_cpu=on_cpu,
        deterministic=deterministic,
        pause_mode=pause_mode,
        return_routed_experts=return_routed_experts,
    )
    if on_cpu and engine_kwargs.get("enable_lora") and not cpu.can_fork_engine_processes():
        raise ValueError(
            "a CPU SGLang engine serves LoRA adapters only from forked processes (they drop its "
            "pinned host memory, which needs a GPU driver); start it from a process with "
            "OMP_NUM_THREADS=1 and torch.set_num_threads(1), as hybridflow's CPU ranks are"
        )
    if on_cpu:
        cpu.apply_cpu_environment(tp, architectures=_architectures(model_path))
    routed = _is_moe(model_path) and not on_cpu if return_routed_experts is None else return_routed_experts
    os.environ.update(_ENGINE_ENV)
    args = _engine_args(
        model_path,
        tp=tp,
        ep=ep,
        dtype=dtype,
        max_total_tokens=max_total_tokens,
        seed=seed,
        on_cpu=on_cpu,
        routed=routed,
        deterministic=deterministic,
    )
    if mem_fraction_static is not None:
        args["mem_fraction_static"] = mem_fraction_static
    _check_layout_overrides(engine_kwargs, on_cpu=on_cpu)
    args.update(engine_kwargs)
    with cpu.gpu_kernels_absent() if on_cpu else contextlib.nullcontext(), gc_pause.paused():
        import sglang
        import sglang.srt.entrypoints.engine  # noqa: F401  (the heavy part, while they are absent)

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    contexts_before = _zmq_context_ids()
    started = time.perf_counter()
    try:
        with cpu.forked_engine_processes() if on_cpu else contextlib.nullcontext():
            engine = sglang.Engine(**args)
    except BaseException:
        _close_new_zmq_contexts(contexts_before)
        _reap_children(frozenset(children_before))
        raise
    # the processes SGLang started (schedulers, detokenizer): shutdown kills these, nothing else
    # kept as psutil.Process objects, whose identity includes the start time: a pid saved bare can
    # name another process by shutdown time (pids wrap at 32768), which the shutdown would kill
    own = tuple(p for p in psutil.Process().children() if p.pid not in children_before)
    engine._hybridflow_zmq_contexts = _new_zmq_contexts(contexts_before)  # closed at shutdown (watch: a lost engine)
    logger.info(
        "SGLang engine up in %.1f s (tp=%d, ep=%d, %s)",
        time.perf_counter() - started,
        tp,
        ep,
        "CPU" if on_cpu else "GPU",
    )
    return engine, own, args, on_cpu, routed


def lora_args(*, rank: int, target_modules: Sequence[str], on_cpu: bool) -> dict[str, Any]:
    """``sglang.Engine`` settings of an engine that serves LoRA adapters of ``rank`` on the HF
    modules ``target_modules`` (leaf names: ``q_proj``, ``gate_proj``...). One adapter slot: a
    push replaces the adapter between generations. On CPU SGLang's torch-native LoRA kernels (its
    others are triton); routed-expert adapters need its triton_v2 MoE LoRA, so a GPU."""
    args: dict[str, Any] = dict(
        enable_lora=True, max_lora_rank=rank, lora_target_modules=list(target_modules), max_loras_per_batch=1
    )
    if on_cpu:
        args["lora_backend"] = "torch_native"
    return args


class SGLangNode:
    """The part of a multi-node engine on a node other than its first: SGLang's scheduler
    processes for this node's TP ranks, which the engine's driver (node 0) commands. Nothing
    is called on it; it only keeps them and reaps them after the driver's shutdown."""

    def __init__(self, own_processes: tuple[psutil.Process, ...]) -> None:
        self._own = own_processes

    def shutdown(self) -> None:
        """Reap this node's scheduler processes (the driver's shutdown has stopped them)."""
        tree = _descendants(self._own)
        _kill_and_reap(tree)
        _unlink_shared_memory(None, [p.pid for p in tree])


def start_node(
    model_path: str,
    *,
    node_rank: int,
    nnodes: int,
    dist_init_addr: str,
    tp: int,
    ep: int = 1,
    dtype: str = "float32",
    max_total_tokens: int = 4096,
    seed: int = 0,
    deterministic: bool = False,
    **engine_kwargs: Any,
) -> SGLangNode:
    """Start node ``node_rank`` (>= 1) of an engine whose ``tp`` ranks span ``nnodes`` nodes; node 0 is
    the ``make_engine("sglang", ..., nnodes=, node_rank=0, dist_init_addr=)`` that drives it.

    SGLang's non-zero nodes run schedulers only; ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` makes
    ``sglang.Engine`` return instead of blocking. This process then ignores SIGQUIT: SGLang's
    default handler would kill it (an actor rank) when its schedulers stop with the engine."""
    if node_rank < 1:
        raise ValueError(f"start_node(node_rank={node_rank}): node 0 is the driving engine (make_engine)")
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
    kwargs = dict(engine_kwargs, nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    _, own, *_ = _launch(
        model_path,
        tp=tp,
        ep=ep,
        dtype=dtype,
        max_total_tokens=max_total_tokens,
        mem_fraction_static=None,
        seed=seed,
        return_routed_experts=None,
        deterministic=deterministic,
        pause_mode="retract",
        engine_kwargs=kwargs,
    )
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    logger.info("SGLang engine node %d of %d up (schedulers %s)", node_rank, nnodes, sorted(p.pid for p in own))
    return SGLangNode(own)


def _engine_args(
    model_path: str,
    *,
    tp: int,
    ep: int,
    dtype: str,
    max_total_tokens: int,
    seed: int,
    on_cpu: bool,
    routed: bool,
    deterministic: bool,
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments; on CPU, the settings seen working in CPU_NOTES."""
    args = dict(
        model_path=model_path,
        tp_size=tp,
        ep_size=ep,
        dtype=dtype,
        max_total_tokens=max_total_tokens,
        random_seed=seed,
        skip_server_warmup=True,
        custom_weight_loader=[param_report.LOADER, rank_seed.LOADER, post_load.LOADER, param_report.DIGEST_LOADER],
        enable_return_routed_experts=routed,
        enable_deterministic_inference=deterministic,
        log_level="warning",
        custom_sigquit_handler=_child_failed_at_start,
        # an idle scheduler otherwise polls its sockets in a busy loop, taken from the colocated
        # actor while it trains: an idle tp=2 CPU engine used 10.7 CPU s in 10 s, 0.3 s with this
        sleep_on_idle=True,
    )
    if on_cpu:
        # max_total_tokens caps the KV pool; the fraction only has to leave SGLang's free-memory check
        # room (it compares system-wide free memory before and after loading, which other jobs move)
        args.update(device="cpu", disable_cuda_graph=True, mem_fraction_static=0.2)
    else:  # release_memory / resume_memory free nothing without torch_memory_saver
        args.update(enable_memory_saver=True, **GPU_LAYOUT_PINS)
    return args


GPU_LAYOUT_PINS: dict[str, Any] = {
    # DeepSeek-V3 on sm80+ at ep=1 would fold the shared expert into FusedMoE as expert E (no
    # mlp.shared_experts.* parameters, one more w13/w2 slot), a layout reshard/sglang.py does not plan
    "disable_shared_experts_fusion": True,
    # flashinfer_cutlass loads w13 as [up; gate] (same shape: a push would swap them silently),
    # triton_kernel transposes w13/w2, flashinfer_trtllm (auto on sm100) pads and block-permutes them
    "moe_runner_backend": "triton",
    # DeepEP-class all-to-all forces ep=tp and replicates DeepSeek's shared experts
    "moe_a2a_backend": "none",
    # EPLB adds physical expert slots and moves experts while the engine runs
    "enable_eplb": False,
    "ep_num_redundant_experts": 0,
}
"""SGLang settings that make its GPU parameter layout the one ``reshard/sglang.py`` plans (CPU
layouts never take these paths); ``start`` refuses overrides of them."""

GPU_LAYOUT_ENV = ("SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED", "SGLANG_SHARED_EXPERT_TP1", "SGLANG_ENABLE_EMBED_REPLICATION")
"""Environment switches that re-lay parameters on GPUs (w13 rows interleaved on every load, shared
experts replicated, embeddings replicated): refused when set."""


def _check_layout_overrides(engine_kwargs: dict[str, Any], *, on_cpu: bool) -> None:
    """Refuse engine settings whose parameter layout the reshard plan would write wrongly."""
    for key, pinned in GPU_LAYOUT_PINS.items():
        if key in engine_kwargs and engine_kwargs[key] != pinned:
            raise ValueError(
                f"sglang {key}={engine_kwargs[key]!r} changes the engine's parameter layout, which the "
                f"reshard plan does not model; leave it at {pinned!r}"
            )
    if on_cpu:
        return
    for name in GPU_LAYOUT_ENV:
        if os.environ.get(name, "") not in ("", "0", "false", "False"):
            raise ValueError(
                f"environment {name}={os.environ[name]} re-lays SGLang's parameters on GPUs in a "
                f"way the reshard plan does not model; unset it"
            )


class SGLangStartError(RuntimeError):
    """An SGLang process died while the engine was starting (its log above says why)."""


def _child_failed_at_start(signum: int, frame: Any) -> None:
    """SIGQUIT from a dying SGLang child during start-up: raise here instead of SGLang's default,
    which SIGKILLs this whole process tree (the caller's too). Once running, SGLang installs its
    own handler again (a child dying mid-generation still ends this process)."""
    raise SGLangStartError("an SGLang process died while the engine was starting; see its log above")


def _zmq_context_ids() -> set[int]:
    """ids of this process's open pyzmq contexts (SGLang's tokenizer manager makes its own)."""
    import zmq

    return {id(o) for o in gc.get_objects() if isinstance(o, zmq.Context) and not o.closed}


def _new_zmq_contexts(before: set[int]) -> list:
    """The open pyzmq contexts of this process not in ``before``."""
    import zmq

    return [o for o in gc.get_objects() if isinstance(o, zmq.Context) and not o.closed and id(o) not in before]


def _close_new_zmq_contexts(before: set[int]) -> None:
    """Close the contexts a failed start left behind: garbage-collecting one with open sockets
    (default linger: forever) blocks this process for good in ``Context.term``."""
    for context in _new_zmq_contexts(before):
        context.destroy(linger=0)


def _check_start(
    *, tp: int, ep: int, on_cpu: bool, deterministic: bool, pause_mode: str, return_routed_experts: bool | None
) -> None:
    if tp < 1 or ep < 1 or tp % ep:
        raise ValueError(f"sglang tp={tp}, ep={ep}: both must be >= 1 and ep must divide tp")
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"sglang pause_mode={pause_mode!r}: choose one of {', '.join(PAUSE_MODES)}")
    if not on_cpu:
        return
    if ep > 1:
        # seen: the scheduler dies in the first forward ("index -1 is out of bounds for dimension 1")
        raise ValueError(
            f"sglang ep={ep}: SGLang's CPU engine only runs ep=1 (its torch-native MoE does "
            "not handle non-local experts); use ep=1 on CPU or run on a GPU"
        )
    if deterministic:
        raise ValueError(
            "sglang deterministic=true needs a GPU: SGLang's deterministic inference refuses the "
            "CPU attention backend (intel_amx); set deterministic=false on CPU"
        )
    if return_routed_experts:
        raise ValueError(
            "sglang return_routed_experts=true needs a GPU: SGLang 0.5.23 allocates the routed-"
            "experts buffer with cudaHostRegister ('Found no NVIDIA driver' on CPU)"
        )


def _architectures(model_path: str) -> list[str]:
    """``config.json``'s model classes (``Qwen3MoeForCausalLM``); empty if unknown."""
    config = Path(model_path) / "config.json"
    return list(json.loads(config.read_text()).get("architectures") or []) if config.is_file() else []


def _is_moe(model_path: str) -> bool:
    """Whether the model directory's config routes tokens to experts (False if unknown)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    text_config = json.loads(config.read_text())
    text_config = text_config.get("text_config", text_config)
    return int(text_config.get("num_experts_per_tok") or 0) > 0


class SGLangEngine:
    """A running SGLang engine; see the module docstring. Start it with ``make_engine("sglang", ...)``."""

    def __init__(
        self,
        engine: Any,
        *,
        tp: int,
        on_cpu: bool,
        model_path: str,
        routed_experts: bool,
        deterministic: bool,
        pause_mode: str,
        own_processes: tuple[psutil.Process, ...],
        weights_loaded: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        generate_timeout_s: float | None = None,
    ):
        self._engine = engine
        self.generate_timeout_s = generate_timeout_s
        """Bound of one call that waits on the engine (None: none); past it the engine counts as hung."""
        self.watch = ProcessWatch(_descendants(own_processes), engine.loop)
        """Liveness of the engine's own processes during calls (``watch``)."""
        self.watch.take_over(engine.tokenizer_manager)
        self.bucket_bytes = bucket_bytes
        """Bytes of tensors per update call when a push is bucketed (``rollout.push_bucket_mb``)."""
        self.tp = tp
        """TP ranks of the engine (one payload each in a sliced push)."""
        self.on_cpu = on_cpu
        """Whether this is SGLang's CPU engine."""
        self._routed_experts = routed_experts
        self._deterministic = deterministic
        self._pause_mode = pause_mode
        manager = engine.tokenizer_manager
        self._context_len = manager.context_len
        self._vocab_size = manager.model_config.vocab_size
        text_config = manager.model_config.hf_text_config
        self._num_layers = text_config.num_hidden_layers
        # SGLang captures a row for every layer; the protocol's L axis counts MoE layers only
        self._first_dense = int(getattr(text_config, "first_k_dense_replace", 0) or 0)
        self._top_k = getattr(text_config, "num_experts_per_tok", 0) or 0
        self._checkpoint_shapes = _checkpoint_shapes(model_path)
        self._params: list[dict[str, dict[str, Any]]] | None = None
        self._released: set[str] = set()
        self._weights_lost = not weights_loaded  # load_format="dummy": the first push brings them
        self._seed_warned = False
        self._adapter: str | None = None  # the LoRA adapter every generate serves (load_adapter)
        # at interpreter exit (or if dropped unclosed) SGLang's processes still go
        self._finalizer = weakref.finalize(self, _shutdown, engine, own_processes)

    @property
    def sglang_engine(self) -> Any:
        """The underlying ``sglang.Engine``, for SGLang features this adapter does not wrap."""
        return self._engine

    # generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt; samples come prompt-major, then sample index."""
        input_ids, requests = self._requests(prompts, params)
        if not input_ids:
            return RolloutBatch(samples=(), seconds=0.0)
        started = time.perf_counter()
        outputs = self._watched(lambda: self._engine.generate(input_ids=input_ids, **requests), "generate")
        return self._batch(outputs, input_ids, params.n, started)

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> PendingBatch:
        """``generate``'s batch, started: returns once every request is with the schedulers, which
        generate while the caller does other work; ``result()`` collects the batch.

        One thread drives the engine's asyncio loop: the requests go in as a task on it, the loop
        runs until each is dispatched (SGLang's ``ReqState.dispatched``), and the replies queue on
        the detokenizer's socket until ``result()`` runs the loop again. Other calls on the loop
        in between (a colocated engine's memory release) only move the task along."""
        input_ids, requests = self._requests(prompts, params)
        if not input_ids:
            return Finished(RolloutBatch(samples=(), seconds=0.0))
        started = time.perf_counter()
        rids = [uuid.uuid4().hex for _ in input_ids]
        loop = self._engine.loop
        task = loop.create_task(self._engine.async_generate(input_ids=input_ids, rid=rids, **requests))
        states = self._engine.tokenizer_manager.rid_to_state

        async def dispatched() -> None:
            while not task.done() and not all(r in states and states[r].dispatched for r in rids):
                # a pause, not a spin: on a shared CPU the schedulers dispatching them need the core
                await asyncio.sleep(0.001)

        self._watched(lambda: loop.run_until_complete(dispatched()), "submit")
        return _SGLangPending(self, task, input_ids, params.n, started)

    def _requests(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> tuple[list[list[int]], dict]:
        """The engine's input ids (each prompt ``params.n`` times) and the rest of its request."""
        self._check_open()
        self._check_servable()
        prompts = [[int(t) for t in p] for p in prompts]
        self._check_prompts(prompts, params)
        input_ids = [p for p in prompts for _ in range(params.n)]
        served = {"lora_path": [self._adapter] * len(input_ids)} if self._adapter is not None else {}
        requests = {
            "sampling_params": [self._sampling(params, i) for i in range(len(input_ids))],
            "return_logprob": True,
            "return_routed_experts": self._routed_experts,
            **served,
        }
        return input_ids, requests

    def _batch(self, outputs: list[dict], input_ids: list[list[int]], n: int, started: float) -> RolloutBatch:
        seconds = time.perf_counter() - started
        samples = tuple(self._sample(out, i // n, i % n, input_ids[i]) for i, out in enumerate(outputs))
        return RolloutBatch(samples=samples, seconds=seconds)

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
            if len(prompt) + params.max_new_tokens > self._context_len:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} it "
                    f"exceeds the engine's context length {self._context_len}: truncate the prompt or lower "
                    "max_new_tokens"
                )
            bad = [t for t in prompt if not 0 <= t < self._vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index} has token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})"
                )

    def _sampling(self, params: SamplingParams, index: int) -> dict[str, Any]:
        sampling = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None and params.temperature > 0:
            # SGLang honours a per-request seed only under deterministic inference
            if not self._deterministic and not self._seed_warned:
                logger.warning("SamplingParams.seed is ignored: start the engine with deterministic=True (GPU)")
                self._seed_warned = True
            sampling["sampling_seed"] = params.seed + index
        return sampling

    def _sample(self, out: dict[str, Any], prompt_index: int, sample_index: int, prompt: list[int]) -> RolloutSample:
        meta = out["meta_info"]
        reason = meta["finish_reason"]["type"]
        if reason not in _FINISH:
            raise RuntimeError(f"SGLang ended prompt {prompt_index} with {reason!r}: {meta['finish_reason']}")
        response = tuple(int(t) for t in out["output_ids"])
        logprobs = tuple(float(lp) for lp, _token, _text in meta["output_token_logprobs"])
        assert len(logprobs) == len(response), (len(logprobs), len(response))
        routed = _routed_experts(
            meta, len(prompt), len(response), self._num_layers, self._top_k, first_dense=self._first_dense
        )
        return RolloutSample(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=tuple(prompt),
            response_ids=response,
            logprobs=logprobs,
            finish_reason=_FINISH[reason],
            routed_experts=routed,
        )

    # weights

    def push_weights(self, weights: Any, *, route: str = "sliced") -> WeightPushReport:
        """``sliced``: ``weights`` is ``push_rank_tensors``'s per-rank list; ``full``: HF-named tensors."""
        if route == "sliced":
            return self.push_rank_tensors(weights)
        if route == "full":
            return self.push_full(weights)
        raise ValueError(f"weight push route={route!r}: choose one of {', '.join(ROUTES)}")

    def load_adapter(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
    ) -> WeightPushReport:
        """Load LoRA adapter ``name`` (PEFT tensor names and ``adapter_config.json`` values) through
        SGLang's adapter API and serve it from the next generate on, in place of the adapter
        served before (unloaded first: its slot is the one). The engine must be started with
        ``lora_args``."""
        self._check_open()
        started = time.perf_counter()
        if self._adapter is not None:
            self.unload_adapter(self._adapter)
        result = self._watched(
            lambda: self._engine.load_lora_adapter_from_tensors(
                lora_name=name, tensors=dict(tensors), config_dict=dict(config)
            ),
            "load_lora_adapter_from_tensors",
        )
        if not result.success:
            raise RuntimeError(f"SGLang did not load LoRA adapter {name!r}: {result.error_message}")
        self._adapter = name
        nbytes = sum(t.nbytes for t in tensors.values())
        return WeightPushReport(
            seconds=time.perf_counter() - started, bytes_per_rank=(nbytes,) * self.tp, route="adapter"
        )

    def unload_adapter(self, name: str) -> None:
        """Unload LoRA adapter ``name``; generate then serves the base weights if it was the served one."""
        self._check_open()
        result = self._watched(lambda: self._engine.unload_lora_adapter(lora_name=name), "unload_lora_adapter")
        if not result.success:
            raise RuntimeError(f"SGLang did not unload LoRA adapter {name!r}: {result.error_message}")
        if self._adapter == name:
            self._adapter = None

    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Each TP rank's parameter names and shapes, read from the running engine (padding included)."""
        return [{name: tuple(info["shape"]) for name, info in rank.items()} for rank in self.rank_params()]

    def push_rank_tensors(
        self, per_rank: Sequence[Mapping[str, torch.Tensor]], *, bucket_bytes: int | None = None
    ) -> WeightPushReport:
        """Give each TP rank only its own tensors, under SGLang's parameter names.

        ``per_rank[r]`` maps names to rank r's local tensors, unpadded as the reshard planner lays
        them out or already in the engine's shape (``padding.to_engine_layout`` bridges the two).
        Every rank must name the same parameters (a subset of the model's is fine). Names and
        shapes are checked before anything is sent: ValueError names the tensor and the rank,
        and the engine keeps serving its previous weights. The tensors are shared from this
        process (``handles``); a caller whose ranks' tensors live in several processes uses
        ``handles.prepare_rank_payload`` there and ``push_rank_payloads`` here instead.
        """
        self._check_open()
        if len(per_rank) != self.tp:
            raise ValueError(f"sliced push got tensors for {len(per_rank)} ranks; the engine has tp={self.tp}")
        names = _same_names([list(tensors) for tensors in per_rank])
        params = self.rank_params()
        for rank, tensors in enumerate(per_rank):  # every rank checked before the first bucket goes
            for name in names:
                handles.check_rank_tensor(rank, name, tensors[name], params[rank])
        shapes = params[0]
        sizes = [handles.nbytes(tuple(shapes[n]["shape"]), getattr(torch, shapes[n]["dtype"])) for n in names]
        started = time.perf_counter()
        received = [0] * self.tp
        with self._update_session(weights=True):
            for last, bucket in _mark_last(fill_buckets(names, sizes, bucket_bytes or self.bucket_bytes)):
                prepared = [
                    handles.prepare_rank_payload(r, {n: per_rank[r][n] for n in bucket}, params[r])
                    for r in range(self.tp)
                ]
                self._send_payloads([payload for payload, _kept in prepared], flush_cache=last)
                for r, (payload, _kept) in enumerate(prepared):
                    received[r] += payload.nbytes
        return WeightPushReport(seconds=time.perf_counter() - started, bytes_per_rank=tuple(received), route="sliced")

    def push_rank_payloads(self, payloads: Sequence[handles.RankPayload]) -> WeightPushReport:
        """Push one ``handles.RankPayload`` per TP rank, each prepared (checked, laid out, shared)
        by the process that holds that rank's tensors; those processes keep the tensors alive
        until this returns. Flushes the cache once every rank has its weights."""
        self._check_open()
        if len(payloads) != self.tp or [p.rank for p in payloads] != list(range(self.tp)):
            raise ValueError(
                f"sliced push got payloads for ranks {[p.rank for p in payloads]}; "
                f"the engine has tp={self.tp} (ranks 0..{self.tp - 1}, in order)"
            )
        _same_names([list(p.handles) for p in payloads])
        started = time.perf_counter()
        with self._update_session(weights=True):
            self._send_payloads(payloads, flush_cache=True)
        return WeightPushReport(
            seconds=time.perf_counter() - started, bytes_per_rank=tuple(p.nbytes for p in payloads), route="sliced"
        )

    def _send_payloads(self, payloads: Sequence[handles.RankPayload], *, flush_cache: bool) -> None:
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        named = [
            (name, LocalSerializedTensor(values=[p.handles[name] for p in payloads])) for name in payloads[0].handles
        ]
        self._update(named, load_format="direct", flush_cache=False)
        if flush_cache:  # the last bucket: "direct" skipped the model's post-load hook (DeepSeek's w_kc / w_vc)
            self._update([("post_load", _NAME_ONLY)], load_format=post_load.LOADER, flush_cache=True)

    def push_full(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int | None = None,
    ) -> WeightPushReport:
        """The baseline: every rank receives the full tensors under HF checkpoint names and slices them.

        MoE experts go by checkpoint names (``mlp.experts.{e}.gate_proj.weight``); transformers 5's
        in-memory fused names are not checkpoint names and are refused (SGLang would silently
        ignore them). Names and shapes are checked against the model directory's checkpoint.
        """
        self._check_open()
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self._check_full_push(items)
        dtype = self._engine.tokenizer_manager.model_config.dtype
        started = time.perf_counter()
        buckets = fill_buckets([n for n, _ in items], [t.nbytes for _, t in items], bucket_bytes or self.bucket_bytes)
        tensors = dict(items)
        with self._update_session(weights=True):
            for last, names in _mark_last(buckets):
                named = [(name, tensors[name].detach().to(dtype=dtype).clone()) for name in names]
                self._update(named, load_format=None, flush_cache=last)
        seconds = time.perf_counter() - started
        nbytes = sum(handles.nbytes(tuple(t.shape), dtype) for _, t in items)
        return WeightPushReport(seconds=seconds, bytes_per_rank=(nbytes,) * self.tp, route="full")

    def _check_full_push(self, items: list[tuple[str, torch.Tensor]]) -> None:
        if not items:
            raise ValueError("full push got no tensors")
        expected = self._checkpoint_shapes
        if expected is None:  # not a local safetensors checkpoint: nothing to check against
            return
        for name, tensor in items:
            if name not in expected:
                raise ValueError(
                    f"full push: {name!r} is not a tensor of the model's checkpoint; use HF checkpoint "
                    "names (per-expert mlp.experts.{e}.gate_proj.weight, not fused in-memory names)"
                )
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"full push: {name!r} has shape {tuple(tensor.shape)}, the checkpoint {expected[name]}"
                )

    def rank_params(self) -> list[dict[str, dict[str, Any]]]:
        """Every TP rank's parameters, ``{name: {"shape": [...], "dtype": "float32"}}``, read once from the
        running engine through ``param_report`` (plain data: it can be broadcast to other processes)."""
        if self._params is None:
            self._check_open()
            with tempfile.TemporaryDirectory(prefix="hybridflow-sglang-params-") as out:
                with self._update_session():
                    self._update([(out, _NAME_ONLY)], load_format=param_report.LOADER, flush_cache=False)
                self._params = [_read_rank_report(Path(out), rank) for rank in range(self.tp)]
        return self._params

    def weight_digests(self) -> list[dict[str, list[float]]]:
        """Every TP rank's ``{name: [sum, sum of squares]}`` of its parameters as they are now
        (``param_report.report_digests``): the refit verifier's read-back. The weights must be
        resident."""
        self._check_open()
        with tempfile.TemporaryDirectory(prefix="hybridflow-sglang-digests-") as out:
            with self._update_session():
                self._update([(out, _NAME_ONLY)], load_format=param_report.DIGEST_LOADER, flush_cache=False)
            return [_read_rank_report(Path(out), rank) for rank in range(self.tp)]

    @contextlib.contextmanager
    def _update_session(self, *, weights: bool = False) -> Iterator[None]:
        """SGLang's weight-update session; ``weights``: it pushes model weights (they must be
        resident, and a completed push makes released weights whole again: the caller pushes all)."""
        if weights:
            self._check_weights_writable()
        _check_result(self._watched(self._engine.begin_weight_update, "begin_weight_update"), "begin_weight_update")
        try:
            yield
        finally:
            _check_result(self._watched(self._engine.end_weight_update, "end_weight_update"), "end_weight_update")
        if weights:
            self._weights_lost = False

    def _update(self, named: list, *, load_format: str | None, flush_cache: bool) -> None:
        result = self._watched(
            lambda: self._engine.update_weights_from_tensor(
                named_tensors=named, load_format=load_format, flush_cache=flush_cache
            ),
            "update_weights_from_tensor",
        )
        _check_result(result, f"update_weights_from_tensor(load_format={load_format!r})")

    def reseed(self, seed: int) -> None:
        """Seed every rank's sampling generator (``rank_seed``); the next generate call's samples
        then depend only on the weights, the prompts and ``seed``."""
        self._check_open()
        with self._update_session():
            self._update([(str(int(seed)), _NAME_ONLY)], load_format=rank_seed.LOADER, flush_cache=False)

    def _watched(self, fn, what: str) -> Any:
        """``fn()``, a call that waits on the engine, as EngineLost if the engine is lost meanwhile."""
        return self.watch.call(fn, timeout_s=self.generate_timeout_s, what=what)

    # control

    def pause(self) -> None:
        """Hold new and running requests (``pause_mode``, default ``retract``: KV is recomputed on resume)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._run(self._engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=self._pause_mode)))

    def resume(self) -> None:
        """Continue after ``pause``."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        # torch_empty_cache calls torch.cuda.*: only on a GPU
        request = ContinueGenerationReqInput(torch_empty_cache=not self.on_cpu)
        self._run(self._engine.tokenizer_manager.continue_generation(request))

    def flush_cache(self) -> None:
        """Drop the prefix (radix) cache; RuntimeError if SGLang refuses (requests still running)."""
        self._check_open()
        result = self._watched(self._engine.flush_cache, "flush_cache")
        if not getattr(result, "success", True):
            raise RuntimeError(f"SGLang flush_cache failed: {getattr(result, 'message', result)}")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the GPU memory of ``tags`` (``base.MEMORY_TAGS``; default all) while training runs.

        Released weights lose their values (SGLang's memory saver keeps no copy): after
        ``resume_memory`` they must be pushed again, and ``generate`` refuses until then. Tags
        already released are skipped. No-op on CPU (SGLang needs a GPU for it).
        """
        todo = [t for t in memory_tags(tags) if t not in self._released]
        if self.on_cpu or not todo:
            return
        self._check_open()
        _check_result(self._engine.release_memory_occupation(tags=todo), "release_memory_occupation")
        self._released.update(todo)
        if "weights" in todo:
            self._weights_lost = True

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory of ``tags`` (default all) that ``release_memory`` freed; tags not
        released are skipped (SGLang refuses to resume them). No-op on CPU."""
        todo = [t for t in memory_tags(tags) if t in self._released]
        if self.on_cpu or not todo:
            return
        self._check_open()
        _check_result(self._engine.resume_memory_occupation(tags=todo), "resume_memory_occupation")
        self._released.difference_update(todo)

    def _check_weights_writable(self) -> None:
        if "weights" in self._released:
            raise RuntimeError(
                "weight push while the engine's weights are released: call resume_memory(('weights',)) first"
            )

    def _check_servable(self) -> None:
        if self._released:
            raise RuntimeError(
                f"generate while the engine's {', '.join(sorted(self._released))} memory is "
                "released: call resume_memory() first"
            )
        if self._weights_lost:
            raise RuntimeError(
                "the engine holds no valid weights (it started with load_format='dummy', or its "
                "weights were released and their values are gone): push weights, then generate"
            )

    def shutdown(self) -> None:
        """Stop the engine, then make sure no process it started is left (leftovers are killed, with a warning)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` ran."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the SGLang engine was shut down")

    def _run(self, coroutine: Any) -> Any:
        self._check_open()
        return self._watched(lambda: self._engine.loop.run_until_complete(coroutine), "pause / continue")


@dataclasses.dataclass
class _SGLangPending:
    """A batch ``SGLangEngine.submit`` started: its task on the engine's loop."""

    engine: SGLangEngine
    task: Any
    input_ids: list[list[int]]
    n: int
    started: float

    def result(self) -> RolloutBatch:
        """The batch, once generated (``seconds`` from the submit); EngineLost as ``generate``."""
        engine, loop = self.engine, self.engine._engine.loop
        engine._check_open()
        outputs = engine._watched(lambda: loop.run_until_complete(self.task), "generate")
        return engine._batch(outputs, self.input_ids, self.n, self.started)


def _shutdown(engine: Any, own: tuple[psutil.Process, ...]) -> None:
    """``engine.shutdown()``, except that only the engine's own processes are killed.

    SGLang 0.5.23's shutdown ends with ``kill_process_tree(os.getpid(), include_parent=False)``:
    every child of the calling process, its own or not (another engine's schedulers, a user's
    subprocesses). For the length of the call that function is swapped for one that kills the
    processes this engine started (``own``) and their descendants.
    """
    from sglang.srt.entrypoints import engine as sglang_engine_module

    tree = _descendants(own)
    original = sglang_engine_module.kill_process_tree
    sglang_engine_module.kill_process_tree = lambda *_args, **_kwargs: _kill_and_reap(tree, quiet=True)
    try:
        engine.shutdown()
    finally:
        sglang_engine_module.kill_process_tree = original
        _kill_and_reap(tree)
        _release_loop_and_sockets(engine)
        _unlink_shared_memory(engine, [p.pid for p in tree])


SHM_DIR = Path("/dev/shm")


def _unlink_shared_memory(engine: Any, pids: list[int]) -> None:
    """Remove the shared-memory files the engine's (killed) processes made, once they are gone.

    Why: SGLang makes them under /dev/shm (a 24 MB message queue per scheduler, named with its
    pid: ``sgl_shm_<kind>_<pid>_<random>``; a load-snapshot file named after the engine's instance
    id) and removes them only when its processes exit cleanly. Ours are killed, so each engine
    start left two or three behind: about 200 after one run of the test suite, and on a GPU node
    with engine restarts a /dev/shm that fills up. Only these names go: another engine's files
    stay, as does everything a live process holds."""
    names = [path for pid in pids for path in SHM_DIR.glob(f"sgl_shm_*_{pid}_*")]
    instance = getattr(getattr(engine, "port_args", None), "instance_id", None)
    if instance is not None:
        from sglang.srt.managers.load_snapshot import shm_path_for

        names.append(Path(shm_path_for(instance)))
    for path in names:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _release_loop_and_sockets(engine: Any) -> None:
    """Cancel what the engine left on the (process-wide) asyncio loop and close its zmq contexts.

    A lost engine leaves a generate request waiting forever and its tokenizer manager's loops
    reading dead sockets; left there, they would run again under the next engine on the same
    loop (and SGLang's wrapper kills this process when one of them fails), and garbage-collecting
    the contexts would block in ``Context.term``."""
    import asyncio

    loop = engine.loop
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks and not loop.is_running() and not loop.is_closed():
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for context in getattr(engine, "_hybridflow_zmq_contexts", ()):
        if not context.closed:
            context.destroy(linger=0)


def _descendants(processes: tuple[psutil.Process, ...]) -> list[psutil.Process]:
    """``processes`` and all their descendants, those still running: one that exited is left out
    even where its pid now names another process (``is_running`` compares start times)."""
    out = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running():
                out += [process, *process.children(recursive=True)]
    return out


def _reap_children(children_before: frozenset[int], timeout_s: float = 10.0) -> None:
    """Kill and reap every descendant of this process not in ``children_before`` (a failed start)."""
    _kill_and_reap(
        [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before], timeout_s=timeout_s
    )


def _kill_and_reap(processes: list[psutil.Process], *, timeout_s: float = 10.0, quiet: bool = False) -> None:
    """SIGKILL those of ``processes`` still running, then wait for all of them.

    A killed SGLang process lingers as a zombie (a leader whose threads are still exiting) until
    waited on, and ``psutil.wait_procs`` reaps this process's direct children. ``quiet``: the
    kill is the shutdown itself, not a leftover worth a warning.
    """
    alive = [p for p in processes if _is_running(p)]
    if alive and not quiet:
        logger.warning(
            "SGLang left %d process(es) running after shutdown (%s); killing them",
            len(alive),
            ", ".join(str(p.pid) for p in alive),
        )
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    _gone, stuck = psutil.wait_procs(processes, timeout=timeout_s)
    if stuck:
        logger.warning(
            "SGLang processes still present %.0f s after shutdown: %s", timeout_s, ", ".join(f"{p.pid}" for p in stuck)
        )


def _is_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _check_result(result: Any, what: str) -> None:
    """Raise RuntimeError if an SGLang control call reports failure (tuple, dict or object)."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, message = result[0], result[1] if len(result) > 1 else ""
    elif isinstance(result, dict):
        ok, message = result.get("success", True), result.get("message", "")
    else:
        ok, message = getattr(result, "success", True), getattr(result, "message", "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _read_rank_report(out: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Wait for ``rank<r>.json`` (ranks write after the call returns on rank 0)."""
    report, error = out / f"rank{rank}.json", out / f"rank{rank}.error"
    deadline = time.monotonic() + _PARAM_REPORT_TIMEOUT_S
    while not report.exists():
        if error.exists():
            raise RuntimeError(f"SGLang rank {rank} could not report its parameters:\n{error.read_text()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"SGLang rank {rank} did not report its parameters within {_PARAM_REPORT_TIMEOUT_S} s")
        time.sleep(0.05)
    return json.loads(report.read_text())


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of the model directory's safetensors files, read from their headers."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _same_names(per_rank: list[list[str]]) -> list[str]:
    """Rank 0's names; ValueError unless every rank names the same parameters."""
    names = per_rank[0]
    if not names:
        raise ValueError("sliced push got no tensors")
    for rank, other in enumerate(per_rank):
        if set(other) != set(names):
            missing, extra = sorted(set(names) - set(other)), sorted(set(other) - set(names))
            raise ValueError(
                f"sliced push: rank {rank} names other parameters than rank 0 "
                f"(missing {missing[:5]}, extra {extra[:5]}); every rank must get the same names"
            )
    return names


def _mark_last(buckets: list[list[str]]) -> Iterator[tuple[bool, list[str]]]:
    for index, bucket in enumerate(buckets):
        yield index == len(buckets) - 1, bucket


def _routed_experts(
    meta: dict[str, Any], prompt_len: int, response_len: int, num_layers: int, top_k: int, *, first_dense: int = 0
) -> np.ndarray | None:
    """``[P + R - 1, L, k]`` experts chosen for every token fed to the model, or None.

    SGLang returns base64 int32 rows ``[num_layers, k]`` for positions ``0 .. P + R - 2`` (the
    last response token is never fed back): ``RolloutSample.routed_experts``' layout once the
    ``first_dense`` dense layers (DeepSeek's ``first_k_dense_replace``), which route nothing, are
    dropped. Any other row count would misalign the replay, so it is an error.
    """
    raw = meta.get("routed_experts")
    if raw is None or not top_k:
        return None
    rows = np.frombuffer(base64.b64decode(raw), dtype=np.int32).reshape(-1, num_layers, top_k)
    if len(rows) != prompt_len + response_len - 1:
        raise RuntimeError(
            f"SGLang returned routed experts for {len(rows)} positions; a {prompt_len}-token prompt "
            f"with a {response_len}-token response feeds {prompt_len + response_len - 1}"
        )
    return rows[:, first_dense:].copy()
