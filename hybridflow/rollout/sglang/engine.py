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
    │     padding.to_engine_layout ─► one payload/rank ─► shapes (param_shapes) BEFORE sending
    │     LocalSerializedTensor(values=[p_r0, p_r1..]),
    │     load_format="direct": rank r opens values[r] only
    │
    └─ push_weights(hf_named, route="full")                the baseline: HF checkpoint names,
          every rank opens every tensor, its loader slices  checked against the checkpoint
    both pushes run inside begin_weight_update() ... end_weight_update()
```

Log-probs are those of the unscaled distribution (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; SGLang's
default divides the logits by the temperature first).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from hybridflow.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    WeightPushReport,
    register_engine,
)
from hybridflow.rollout.sglang import cpu, param_report, rank_seed
from hybridflow.rollout.sglang.padding import to_engine_layout

__all__ = ["ROUTES", "SGLangEngine", "SGLangStartError"]

logger = logging.getLogger(__name__)

ROUTES = ("sliced", "full")
"""Weight-push routes: each rank its own shard, or every rank the full HF tensors."""
PAUSE_MODES = ("retract", "in_place", "abort")
"""SGLang's pause modes (``PauseGenerationReqInput.mode``)."""
DEFAULT_BUCKET_BYTES = 512 << 20
"""Largest payload (per rank) of one ``update_weights_from_tensor`` call."""
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
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
    **engine_kwargs: Any,
) -> SGLangEngine:
    """Start an offline SGLang engine on ``model_path`` (a local HF model directory).

    ``return_routed_experts``: None = on for MoE models on a GPU (SGLang cannot on CPU).
    ``deterministic``: SGLang's deterministic inference, which also makes the per-request
    ``SamplingParams.seed`` take effect (GPU only). ``engine_kwargs`` go to ``sglang.Engine``
    unchanged and override the settings chosen here.
    """
    on_cpu = not cpu.has_cuda_gpu()
    _check_start(tp=tp, ep=ep, on_cpu=on_cpu, deterministic=deterministic, pause_mode=pause_mode,
                 return_routed_experts=return_routed_experts)
    if on_cpu:
        cpu.apply_cpu_environment(tp)
    routed = _is_moe(model_path) and not on_cpu if return_routed_experts is None else return_routed_experts
    os.environ.update(_ENGINE_ENV)
    args = _engine_args(model_path, tp=tp, ep=ep, dtype=dtype, max_total_tokens=max_total_tokens, seed=seed,
                        on_cpu=on_cpu, routed=routed, deterministic=deterministic)
    if mem_fraction_static is not None:
        args["mem_fraction_static"] = mem_fraction_static
    args.update(engine_kwargs)
    import sglang

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    contexts_before = _zmq_context_ids()
    started = time.perf_counter()
    try:
        engine = sglang.Engine(**args)
    except BaseException:
        _close_new_zmq_contexts(contexts_before)
        _reap_children(frozenset(children_before))
        raise
    logger.info("SGLang engine up in %.1f s (tp=%d, ep=%d, %s)", time.perf_counter() - started, tp, ep,
                "CPU" if on_cpu else "GPU")
    return SGLangEngine(engine, tp=tp, on_cpu=on_cpu, model_path=model_path, routed_experts=routed,
                        deterministic=deterministic, pause_mode=pause_mode, children_before=children_before)


def _engine_args(model_path: str, *, tp: int, ep: int, dtype: str, max_total_tokens: int, seed: int,
                 on_cpu: bool, routed: bool, deterministic: bool) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments; on CPU, the settings seen working in CPU_NOTES."""
    args = dict(
        model_path=model_path, tp_size=tp, ep_size=ep, dtype=dtype, max_total_tokens=max_total_tokens,
        random_seed=seed, skip_server_warmup=True, custom_weight_loader=[param_report.LOADER, rank_seed.LOADER],
        enable_return_routed_experts=routed, enable_deterministic_inference=deterministic, log_level="warning",
        custom_sigquit_handler=_child_failed_at_start,
    )
    if on_cpu:
        # max_total_tokens caps the KV pool; the fraction only has to leave SGLang's free-memory check
        # room (it compares system-wide free memory before and after loading, which other jobs move)
        args.update(device="cpu", disable_cuda_graph=True, mem_fraction_static=0.2)
    else:  # release_memory / resume_memory free nothing without torch_memory_saver
        args.update(enable_memory_saver=True)
    return args


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


def _close_new_zmq_contexts(before: set[int]) -> None:
    """Close the contexts a failed start left behind: garbage-collecting one with open sockets
    (default linger: forever) blocks this process for good in ``Context.term``."""
    import zmq

    for context in [o for o in gc.get_objects() if isinstance(o, zmq.Context) and not o.closed]:
        if id(context) not in before:
            context.destroy(linger=0)


def _check_start(*, tp: int, ep: int, on_cpu: bool, deterministic: bool, pause_mode: str,
                 return_routed_experts: bool | None) -> None:
    if tp < 1 or ep < 1 or tp % ep:
        raise ValueError(f"sglang tp={tp}, ep={ep}: both must be >= 1 and ep must divide tp")
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"sglang pause_mode={pause_mode!r}: choose one of {', '.join(PAUSE_MODES)}")
    if not on_cpu:
        return
    if ep > 1:
        # seen: the scheduler dies in the first forward ("index -1 is out of bounds for dimension 1")
        raise ValueError(f"sglang ep={ep}: SGLang's CPU engine only runs ep=1 (its torch-native MoE does "
                         "not handle non-local experts); use ep=1 on CPU or run on a GPU")
    if deterministic:
        raise ValueError("sglang deterministic=true needs a GPU: SGLang's deterministic inference refuses the "
                         "CPU attention backend (intel_amx); set deterministic=false on CPU")
    if return_routed_experts:
        raise ValueError("sglang return_routed_experts=true needs a GPU: SGLang 0.5.23 allocates the routed-"
                         "experts buffer with cudaHostRegister ('Found no NVIDIA driver' on CPU)")


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

    def __init__(self, engine: Any, *, tp: int, on_cpu: bool, model_path: str, routed_experts: bool,
                 deterministic: bool, pause_mode: str, children_before: set[int]):
        self._engine = engine
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
        self._top_k = getattr(text_config, "num_experts_per_tok", 0) or 0
        self._checkpoint_shapes = _checkpoint_shapes(model_path)
        self._params: list[dict[str, dict[str, Any]]] | None = None
        self._seed_warned = False
        # at interpreter exit (or if dropped unclosed) SGLang's processes still go
        self._finalizer = weakref.finalize(self, _shutdown, engine, frozenset(children_before))

    @property
    def sglang_engine(self) -> Any:
        """The underlying ``sglang.Engine``, for SGLang features this adapter does not wrap."""
        return self._engine

    # generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt; samples come prompt-major, then sample index."""
        self._check_open()
        prompts = [[int(t) for t in p] for p in prompts]
        self._check_prompts(prompts, params)
        input_ids = [p for p in prompts for _ in range(params.n)]
        if not input_ids:
            return RolloutBatch(samples=(), seconds=0.0)
        started = time.perf_counter()
        outputs = self._engine.generate(
            input_ids=input_ids, sampling_params=[self._sampling(params, i) for i in range(len(input_ids))],
            return_logprob=True, return_routed_experts=self._routed_experts,
        )
        seconds = time.perf_counter() - started
        samples = tuple(self._sample(out, i // params.n, i % params.n, input_ids[i]) for i, out in enumerate(outputs))
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
            "max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "stop_token_ids": list(params.stop_token_ids),
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
        routed = _routed_experts(meta, len(prompt), len(response), self._num_layers, self._top_k)
        return RolloutSample(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=tuple(prompt),
                             response_ids=response, logprobs=logprobs, finish_reason=_FINISH[reason],
                             routed_experts=routed)

    # weights

    def push_weights(self, weights: Any, *, route: str = "sliced") -> WeightPushReport:
        """``sliced``: ``weights`` is ``push_rank_tensors``'s per-rank list; ``full``: HF-named tensors."""
        if route == "sliced":
            return self.push_rank_tensors(weights)
        if route == "full":
            return self.push_full(weights)
        raise ValueError(f"weight push route={route!r}: choose one of {', '.join(ROUTES)}")

    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Each TP rank's parameter names and shapes, read from the running engine (padding included)."""
        return [{name: tuple(info["shape"]) for name, info in rank.items()} for rank in self._rank_params()]

    def push_rank_tensors(self, per_rank: Sequence[Mapping[str, torch.Tensor]], *,
                          bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightPushReport:
        """Give each TP rank only its own tensors, under SGLang's parameter names.

        ``per_rank[r]`` maps names to rank r's local tensors, unpadded as the reshard planner lays
        them out or already in the engine's shape (``padding.to_engine_layout`` bridges the two).
        Every rank must name the same parameters (a subset of the model's is fine). Names and
        shapes are checked before anything is sent: ValueError names the tensor and the rank,
        and the engine keeps serving its previous weights.
        """
        self._check_open()
        plan = self._plan_rank_push(per_rank)
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer

        started = time.perf_counter()
        sizes = {name: _nbytes(shape, dtype) for name, (_t, shape, dtype) in plan[0].items()}
        buckets = _buckets(list(sizes), list(sizes.values()), bucket_bytes)
        with self._update_session():
            for last, names in _mark_last(buckets):
                payloads = [[_engine_tensor(name, *plan[r][name]) for name in names] for r in range(self.tp)]
                named = [(name, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(payloads[r][i])
                                                             for r in range(self.tp)]))
                         for i, name in enumerate(names)]
                self._update(named, load_format="direct", flush_cache=last)
        seconds = time.perf_counter() - started
        nbytes = tuple(sum(_nbytes(shape, dtype) for _t, shape, dtype in rank.values()) for rank in plan)
        return WeightPushReport(seconds=seconds, bytes_per_rank=nbytes, route="sliced")

    def push_full(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightPushReport:
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
        buckets = _buckets([n for n, _ in items], [t.nbytes for _, t in items], bucket_bytes)
        tensors = dict(items)
        with self._update_session():
            for last, names in _mark_last(buckets):
                named = [(name, tensors[name].detach().to(dtype=dtype).clone()) for name in names]
                self._update(named, load_format=None, flush_cache=last)
        seconds = time.perf_counter() - started
        nbytes = sum(_nbytes(tuple(t.shape), dtype) for _, t in items)
        return WeightPushReport(seconds=seconds, bytes_per_rank=(nbytes,) * self.tp, route="full")

    def _plan_rank_push(self, per_rank: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, tuple]]:
        """Per rank ``{name: (tensor, engine shape, engine dtype)}``; ValueError on any mismatch."""
        if len(per_rank) != self.tp:
            raise ValueError(f"sliced push got tensors for {len(per_rank)} ranks; the engine has tp={self.tp}")
        params = self._rank_params()
        names = list(per_rank[0])
        if not names:
            raise ValueError("sliced push got no tensors")
        plan = []
        for rank, tensors in enumerate(per_rank):
            if set(tensors) != set(names):
                missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
                raise ValueError(f"sliced push: rank {rank} names other parameters than rank 0 "
                                 f"(missing {missing[:5]}, extra {extra[:5]}); every rank must get the same names")
            plan.append({name: self._plan_tensor(rank, name, tensors[name], params[rank]) for name in names})
        return plan

    def _plan_tensor(self, rank: int, name: str, tensor: torch.Tensor, params: dict[str, dict]) -> tuple:
        if name not in params:
            raise ValueError(f"sliced push: {name!r} (rank {rank}) is not a parameter of the engine's model; "
                             f"its parameters are named like {sorted(params)[:3]}")
        shape = tuple(params[name]["shape"])
        try:  # on the meta device: checks the padding rule without allocating
            to_engine_layout(name, torch.empty(tensor.shape, device="meta"), shape)
        except ValueError as error:
            raise ValueError(f"sliced push, rank {rank}: {error}") from None
        return tensor, shape, getattr(torch, params[name]["dtype"])

    def _check_full_push(self, items: list[tuple[str, torch.Tensor]]) -> None:
        if not items:
            raise ValueError("full push got no tensors")
        expected = self._checkpoint_shapes
        if expected is None:  # not a local safetensors checkpoint: nothing to check against
            return
        for name, tensor in items:
            if name not in expected:
                raise ValueError(f"full push: {name!r} is not a tensor of the model's checkpoint; use HF checkpoint "
                                 "names (per-expert mlp.experts.{e}.gate_proj.weight, not fused in-memory names)")
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"full push: {name!r} has shape {tuple(tensor.shape)}, the checkpoint "
                                 f"{expected[name]}")

    def _rank_params(self) -> list[dict[str, dict[str, Any]]]:
        """Read (once) every rank's parameter names, shapes and dtypes through ``param_report``."""
        if self._params is None:
            self._check_open()
            with tempfile.TemporaryDirectory(prefix="hybridflow-sglang-params-") as out:
                with self._update_session():
                    self._update([(out, torch.zeros(1))], load_format=param_report.LOADER, flush_cache=False)
                self._params = [_read_rank_report(Path(out), rank) for rank in range(self.tp)]
        return self._params

    @contextlib.contextmanager
    def _update_session(self) -> Iterator[None]:
        _check_result(self._engine.begin_weight_update(), "begin_weight_update")
        try:
            yield
        finally:
            _check_result(self._engine.end_weight_update(), "end_weight_update")

    def _update(self, named: list, *, load_format: str | None, flush_cache: bool) -> None:
        result = self._engine.update_weights_from_tensor(named_tensors=named, load_format=load_format,
                                                         flush_cache=flush_cache)
        _check_result(result, f"update_weights_from_tensor(load_format={load_format!r})")

    def reseed(self, seed: int) -> None:
        """Seed every rank's sampling generator (``rank_seed``); the next generate call's samples
        then depend only on the weights, the prompts and ``seed``."""
        self._check_open()
        with self._update_session():
            self._update([(str(int(seed)), torch.zeros(1))], load_format=rank_seed.LOADER, flush_cache=False)

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
        result = self._engine.flush_cache()
        if not getattr(result, "success", True):
            raise RuntimeError(f"SGLang flush_cache failed: {getattr(result, 'message', result)}")

    def release_memory(self) -> None:
        """Free GPU weights and KV cache while training runs; no-op on CPU (SGLang needs a GPU for it)."""
        if self.on_cpu:
            logger.debug("release_memory: no-op on SGLang's CPU engine")
            return
        _check_result(self._engine.release_memory_occupation(), "release_memory_occupation")

    def resume_memory(self) -> None:
        """Take back what ``release_memory`` freed; no-op on CPU."""
        if self.on_cpu:
            return
        _check_result(self._engine.resume_memory_occupation(), "resume_memory_occupation")

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
        return self._engine.loop.run_until_complete(coroutine)


def _shutdown(engine: Any, children_before: frozenset[int]) -> None:
    try:
        engine.shutdown()
    finally:
        _reap_children(children_before)


def _reap_children(children_before: frozenset[int], timeout_s: float = 10.0) -> None:
    """Kill what the engine left running among this process's descendants, and reap them all.

    SGLang's shutdown SIGKILLs its processes but does not wait for them: they linger as zombies
    (a leader whose threads are still exiting, ``waitpid(WNOHANG)`` not yet ready) until waited on.
    """
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    alive = [p for p in leftovers if _is_running(p)]
    if alive:
        logger.warning("SGLang left %d process(es) running after shutdown (%s); killing them",
                       len(alive), ", ".join(str(p.pid) for p in alive))
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    _gone, stuck = psutil.wait_procs(leftovers, timeout=timeout_s)  # reaps our direct children
    if stuck:
        logger.warning("SGLang processes still present %.0f s after shutdown: %s", timeout_s,
                       ", ".join(f"{p.pid}" for p in stuck))


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


def _engine_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The payload for one rank: padded to the engine's shape, its dtype, in storage of its own."""
    return to_engine_layout(name, tensor.detach().to(dtype=dtype), shape).contiguous().clone()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _buckets(names: list[str], sizes: list[int], bucket_bytes: int) -> list[list[str]]:
    """Consecutive groups of names of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    buckets: list[list[str]] = [[]]
    filled = 0
    for name, size in zip(names, sizes):
        if buckets[-1] and filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += size
    return buckets


def _mark_last(buckets: list[list[str]]) -> Iterator[tuple[bool, list[str]]]:
    for index, bucket in enumerate(buckets):
        yield index == len(buckets) - 1, bucket


def _routed_experts(meta: dict[str, Any], prompt_len: int, response_len: int, num_layers: int,
                    top_k: int) -> np.ndarray | None:
    """``[T, L, k]`` experts chosen at the position that produced each response token, or None.

    SGLang returns base64 int32 rows for positions ``0 .. seq_len - 2`` (the last token is
    never fed back); response token j was sampled from position ``prompt_len - 1 + j``.
    """
    raw = meta.get("routed_experts")
    if raw is None or not top_k:
        return None
    rows = np.frombuffer(base64.b64decode(raw), dtype=np.int32).reshape(-1, num_layers, top_k)
    return rows[prompt_len - 1 : prompt_len - 1 + response_len].copy()
