"""The vLLM engine, trainer side: a ``RolloutEngine`` driving vLLM in an environment of its own.

```
VLLMEngine (this process, the trainer's torch)         server.py (vLLM's venv, vLLM's torch)
  start: Popen(.venv-vllm/bin/python server.py ...) ──► LLM(model_dir, load_format="dummy")
         Listener(unix socket, random authkey)      ◄── connects, says ready
  generate(prompts, params) ─ token ids, n, seeds ──► LLM.generate ─► tokens, log-probs, finish
  push_weights(HF-named tensors, route="full")
         safetensors files in /dev/shm, a bucket each ──► every worker: reload_weights(mapped file)
  push_rank_payloads(one file per tp rank)          ──► worker r: its share into place (placement.py)
  release_memory / resume_memory                   ──► sleep / wake_up (GPU; no-op on a CPU)
  shutdown                                         ──► exits (killed after a grace period)
```

Nothing of vLLM is imported here: the two sides share no Python objects, only plain messages
and a file in shared memory (``server.py`` has the protocol). A process that died, or a call past
``generate_timeout_s``, raises ``EngineLost`` naming the last lines vLLM wrote to its log, which
``runtime/recovery.py`` answers by starting a new engine as it does for SGLang's.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from hfschema.buckets import fill_buckets
from hybridflow.rollout.base import (
    EngineLost,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    WeightPushReport,
    memory_tags,
    register_engine,
)
from hybridflow.rollout.vllm import env

__all__ = ["VLLMEngine"]

logger = logging.getLogger(__name__)

_SERVER = Path(__file__).with_name("server.py")
_FINISH = {"stop": "stop", "length": "length", "abort": "length"}
_SEED_STRIDE = 1 << 16  # per-prompt seeds of one call sit this far apart; vLLM adds the sample index


def _shared_dir() -> str:
    """Where pushed weights are written: shared memory where the machine has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _tail(path: Path, lines: int = 3) -> str:
    """The last non-empty lines of ``path`` joined with ' | ' (vLLM's own words on why it stopped)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    kept = [line.strip() for line in text if line.strip()][-lines:]
    return " | ".join(kept) or "(empty log)"


class VLLMEngine:
    """A ``RolloutEngine`` over one vLLM server process (its tp workers, if any, are its children)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        tp: int = 1,
        max_context: int = 4096,
        kv_cache_bytes: int = 1 << 30,
        log_dir: str | None = None,
        start_timeout_s: float = 600.0,
        generate_timeout_s: float = 1800.0,
        device: str | None = None,
        bucket_bytes: int = 512 << 20,
    ) -> None:
        env.check_environment(None, on_gpu=True)  # not installed: the command that installs it
        self.generate_timeout_s = generate_timeout_s
        self._seed = int(seed)
        self._calls = 0
        self._released = False
        self.bucket_bytes = bucket_bytes
        """Bytes of tensors per file of a full push (``rollout.push_bucket_mb``)."""
        self.tp = tp
        """Tensor-parallel workers of the engine (one payload each in a sliced push)."""
        self._params: list[dict[str, dict[str, Any]]] | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix="hybridflow-vllm-", dir=_shared_dir()))
        log_root = Path(log_dir) if log_dir else self._workdir
        log_root.mkdir(parents=True, exist_ok=True)
        self.log_path = log_root / f"vllm_{os.getpid()}.log"
        authkey = secrets.token_bytes(16)
        address = str(Path(tempfile.mkdtemp(prefix="hfv-")) / "s")  # short: unix socket paths are capped
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        command = [
            str(env.python()),
            str(_SERVER),
            f"--socket={address}",
            f"--model={model_path}",
            f"--dtype={dtype}",
            f"--seed={seed}",
            f"--tp={tp}",
            f"--max-model-len={max_context}",
            f"--kv-cache-bytes={kv_cache_bytes}",
        ]
        child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        child_env["HYBRIDFLOW_VLLM_AUTHKEY"] = authkey.hex()
        if device and device.startswith("cuda:"):  # engine rank i on the GPU of the actor's rank i
            first = int(device.split(":")[1])
            child_env["CUDA_VISIBLE_DEVICES"] = ",".join(_physical_gpu(first + i) for i in range(tp))
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=child_env, start_new_session=True
            )
        self.info = self._accept(start_timeout_s)
        logger.info(
            "vLLM engine: %s (%s, tp=%d) ready in %.1f s, log %s",
            self.info.get("vllm"), dtype, tp, self.info.get("seconds", 0.0), self.log_path,
        )  # fmt: skip

    # ---- the process and its socket

    @property
    def server_pid(self) -> int | None:
        """The vLLM server's process id (its tp workers are its children), None once shut down."""
        return self._process.pid if self._process is not None else None

    def _accept(self, timeout_s: float) -> dict:
        """Wait for the server's hello; EngineLost if it exits or stays silent past ``timeout_s``."""
        import socket

        self._listener._listener._socket.settimeout(1.0)  # accept() in slices, to watch the process
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._conn = self._listener.accept()
                break
            except (socket.timeout, TimeoutError):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    message = self._lost("did not start")
                    self._stop_process()
                    raise EngineLost(message) from None
        hello = self._conn.recv()
        return hello["ready"]

    def _lost(self, what: str) -> str:
        code = self._process.poll()
        state = f"exited with code {code}" if code is not None else "is still running"
        where = f"its log {self.log_path} ends: {_tail(self.log_path)}"
        return f"vLLM engine process {self._process.pid} {what} ({state}); {where}"

    def _call(self, request: dict, timeout_s: float = 600.0) -> Any:
        if self._process is None:
            raise RuntimeError("the engine is shut down")
        try:
            self._conn.send(request)
            deadline = time.monotonic() + timeout_s
            while not self._conn.poll(1.0):
                if self._process.poll() is not None:
                    raise EngineLost(self._lost(f"died during {request['op']}"))
                if time.monotonic() > deadline:
                    message = self._lost(f"ran past {timeout_s:.0f} s on {request['op']}")
                    self._stop_process()
                    raise EngineLost(message)
            reply = self._conn.recv()
        except (EOFError, OSError) as error:
            raise EngineLost(self._lost(f"closed its connection during {request['op']} ({error})")) from None
        if "error" in reply:
            raise RuntimeError(f"vLLM {request['op']} failed: {reply['error']} (traceback in {self.log_path})")
        return reply["ok"]

    def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, 15)  # its tp workers are in its session
                process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(process.pid, 9)
                except ProcessLookupError:
                    pass
                process.wait()
        self._listener.close()

    # ---- RolloutEngine

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples of each prompt with the log-prob of every sampled token; per-prompt
        seeds from ``params.seed`` (else the engine's seed and a call counter): the same weights,
        prompts and seed give the same samples."""
        if self._released:
            raise RuntimeError("the engine's memory is released; call resume_memory() first")
        started = time.perf_counter()
        prompts = [tuple(int(t) for t in p) for p in prompts]
        if not prompts or not all(prompts):
            raise ValueError("generate needs at least one prompt, none empty")
        base = params.seed if params.seed is not None else self._seed * 7919 + self._calls
        self._calls += 1
        seeds = [(base * _SEED_STRIDE + i * params.n) % (1 << 62) for i in range(len(prompts))]
        request = {
            "op": "generate",
            "prompts": [list(p) for p in prompts],
            "seeds": seeds,
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
        }
        outputs = self._call(request, timeout_s=self.generate_timeout_s)
        samples = tuple(
            RolloutSample(
                prompt_index=p,
                sample_index=s,
                prompt_ids=prompts[p],
                response_ids=tuple(tokens),
                logprobs=tuple(logprobs),
                finish_reason=_FINISH.get(finish, "length"),
            )
            for p, per_prompt in enumerate(outputs)
            for s, (tokens, logprobs, finish) in enumerate(per_prompt)
        )
        return RolloutBatch(samples=samples, seconds=time.perf_counter() - started)

    def push_weights(self, weights: Mapping[str, Any], *, route: str = "full") -> WeightPushReport:
        """Load Hugging Face checkpoint-named tensors (all or some) in buckets of at most
        ``bucket_bytes`` (``rollout.push_bucket_mb``): each written once into shared memory, mapped
        and loaded by vLLM's workers, whose own loaders slice, fuse and repack, then removed. A
        bucket holds whole fusion groups (``fusion_groups``): vLLM processes a module once all of
        its tensors have come, so one split over two buckets would be processed half empty."""
        from safetensors.torch import save_file

        if route != "full":
            raise ValueError(f"push route {route!r}: push_weights takes full pushes (sliced: push_rank_payloads)")
        if not weights:
            raise ValueError("push_weights got no tensors")
        started = time.perf_counter()
        groups = fusion_groups(list(weights))
        sizes = [sum(weights[n].numel() * weights[n].element_size() for n in group) for group in groups]
        pushed = 0
        for bucket in fill_buckets(groups, sizes, self.bucket_bytes):
            tensors = {name: weights[name].detach().to("cpu").contiguous() for group in bucket for name in group}
            path = self._workdir / f"push_{self._calls}_{time.monotonic_ns()}.safetensors"
            try:
                save_file(tensors, str(path))
                self._call({"op": "load", "path": str(path)})
            finally:
                path.unlink(missing_ok=True)
            pushed += sum(t.numel() * t.element_size() for t in tensors.values())
        return WeightPushReport(seconds=time.perf_counter() - started, bytes_per_rank=(pushed,), route=route)

    # ---- SlicedWeightReceiver: each tp rank its own share (rollout.sync_route=sliced)

    def rank_params(self) -> list[dict[str, dict[str, Any]]]:
        """Each tp rank's parameters, ``{name: {"shape", "dtype"}}``, as vLLM's loaders fill them
        (before its kernels repack them): what the reshard plan's layout must produce. Read once."""
        if self._params is None:
            self._params = self._call({"op": "params"})
        return self._params

    def push_rank_payloads(self, payloads: Sequence[Any]) -> WeightPushReport:
        """Each tp rank copies its own payload's file into place (``handles.prepare_rank_payload``);
        the files are removed after, whatever happened."""
        if len(payloads) != self.tp:
            raise ValueError(f"push_rank_payloads: {len(payloads)} payloads for an engine of tp={self.tp}")
        started = time.perf_counter()
        try:
            self._call({"op": "load_ranks", "paths": [p.path for p in sorted(payloads, key=lambda p: p.rank)]})
        finally:
            for payload in payloads:
                Path(payload.path).unlink(missing_ok=True)
        return WeightPushReport(
            seconds=time.perf_counter() - started,
            bytes_per_rank=tuple(p.nbytes for p in sorted(payloads, key=lambda p: p.rank)),
            route="sliced",
        )

    def weight_digests(self) -> list[dict[str, list[float]]]:
        """Each rank's ``{name: [sum, sum of squares]}`` of the tensors it copied into place at the
        last sliced push, read in the worker: vLLM's CPU kernels empty the parameters they repack,
        so the file's arrival, not the kernels' copy, is what this checks."""
        return self._call({"op": "digests"})

    def reseed(self, seed: int) -> None:
        """The next calls' seeds derive from ``seed`` (and the call count from here)."""
        self._seed, self._calls = int(seed), 0

    def pause(self) -> None:
        """Calls are synchronous: nothing is in flight to hold."""

    def resume(self) -> None:
        """See ``pause``."""

    def flush_cache(self) -> None:
        """Drop vLLM's cached prefixes (stale after a push; a push drops them too)."""
        self._call({"op": "flush"})

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's sleep mode on a GPU (level 2 with ``weights``: push again after waking); no-op on a CPU."""
        self._call({"op": "sleep", "tags": memory_tags(tags)})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's ``wake_up`` for ``tags`` (GPU); no-op on a CPU."""
        self._call({"op": "wake", "tags": memory_tags(tags)})

    def shutdown(self) -> None:
        """Stop the server and its workers; the engine refuses work afterwards."""
        if self._process is not None and self._process.poll() is None:
            try:
                self._conn.send({"op": "shutdown"})
                self._conn.poll(10)
            except (OSError, EOFError):
                pass
        self._stop_process()
        for leftover in self._workdir.glob("*"):
            leftover.unlink(missing_ok=True)
        self._workdir.rmdir()

    def __del__(self) -> None:  # a forgotten engine must not outlive its caller
        if getattr(self, "_process", None) is not None:
            self._stop_process()


def fusion_groups(names: Sequence[str]) -> list[list[str]]:
    """Checkpoint names grouped so that no vLLM module's tensors are split: a decoder layer's
    attention (``q``/``k``/``v`` fuse into ``qkv_proj``), its experts (one ``FusedMoE``), the rest of
    its MLP (``gate``/``up`` fuse); any other tensor alone. In first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        cut = next((i for i, part in enumerate(parts) if part in ("experts", "self_attn")), None)
        if cut is None:
            cut = next((i for i, part in enumerate(parts) if part in ("mlp", "block_sparse_moe")), None)
        key = ".".join(parts[: cut + 1]) if cut is not None else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _physical_gpu(index: int) -> str:
    """The physical id of this process's ``cuda:index`` (under a CUDA_VISIBLE_DEVICES of its own)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index] if visible else str(index)


@register_engine("vllm")
def _start(model_path: str, **kwargs: Any) -> VLLMEngine:
    """A ``VLLMEngine`` on ``model_path`` (config and tokenizer; the first push brings the weights)."""
    if sys.platform != "linux":
        raise RuntimeError("the vLLM engine runs on Linux")
    return VLLMEngine(model_path, **kwargs)
