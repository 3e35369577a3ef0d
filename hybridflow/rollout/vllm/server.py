"""vLLM's side of the vLLM engine: one process under the vLLM environment's own interpreter.

```
hybridflow (the trainer's venv)                    this script (.venv-vllm: vLLM, its own torch)
VLLMEngine ── Listener(unix socket, authkey) ◄──── Client: {"ready": {...}} once vLLM has started
           ── {"op": "generate", ...}        ────► LLM.generate(TokensPrompt, SamplingParams(logprobs=0))
           ◄─ {"ok": [[tokens, logprobs, finish] per sample] per prompt}
           ── {"op": "load", "path": ...}    ────► safetensors mapped from shared memory ─► reload_weights
           ── {"op": "params"}               ────► each tp rank's parameters, as its loader fills them
           ── {"op": "load_ranks", "paths"}  ────► tp rank r copies paths[r] into its parameters
           ── {"op": "digests"}              ────► each rank's digests of what it was last given
           ── {"op": "sleep" | "wake", ...}  ────► LLM.sleep / wake_up (GPU; no-op on a CPU)
           ── {"op": "shutdown"}             ────► exit
```

Messages are dicts of plain Python values (pickled by ``multiprocessing.connection``), so the two
sides need not share a torch or a Python minor version; tensors never travel on the socket. It
imports nothing of hybridflow: the trainer's packages are not installed in this environment.
A failed request answers ``{"error": "<Type>: <message>"}`` with the traceback on stderr; the
engine stays up.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0]).resolve() == _HERE:
    sys.path.pop(0)  # this script's siblings (env.py, engine.py) are not top-level modules here


def _sibling(name: str, file: str):
    """A module beside this script, loaded by path under ``name`` (once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / file)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _cpu():
    """``cpu.py`` beside this script (vLLM's CPU settings and workarounds)."""
    return _sibling("hybridflow_vllm_cpu", "cpu.py")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the trainer side's unix socket")
    parser.add_argument("--model", required=True, help="the model directory (config and tokenizer)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-bytes", type=int, required=True)
    parser.add_argument("--load-format", default="dummy")
    return parser.parse_args(argv)


def _start(args: argparse.Namespace):
    """vLLM's offline engine, its core in this process (one process to watch and to stop)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        options = {"enable_sleep_mode": True, "kv_cache_memory_bytes": args.kv_cache_bytes}
    else:
        options = _cpu().engine_options(args.max_model_len, args.kv_cache_bytes)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        tensor_parallel_size=args.tp,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        **options,
    )
    return llm, on_gpu


def _generate(llm, request: dict) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["prompts"]]
    seeds = request["seeds"]  # one per prompt; vLLM gives sample i of a prompt seed + i
    params = [
        SamplingParams(
            n=request["n"],
            temperature=request["temperature"],
            top_p=request["top_p"],
            top_k=request["top_k"],
            max_tokens=request["max_tokens"],
            stop_token_ids=list(request["stop_token_ids"]),
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob (raw logits: vLLM's default logprobs_mode)
            ignore_eos=False,
            skip_special_tokens=False,
            detokenize=False,
        )
        for seed in seeds
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [
            (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], c.finish_reason)
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        for out in outputs
    ]


def _load(llm, request: dict) -> dict:
    """Every worker reloads the checkpoint-named tensors of the file (vLLM's own loaders slice
    and fuse them, and its CPU kernels repack), then cached prefixes are dropped."""
    path, capture = request["path"], request.get("capture")
    started = time.perf_counter()

    def reload(worker, path=path, capture=capture):
        import torch
        from safetensors import safe_open

        model = worker.model_runner.get_model()
        # mapped: no copy out of shared memory
        with safe_open(path, framework="pt") as tensors, _placement().capturing(model, capture, _tp_rank()):
            names = list(tensors.keys())
            worker.model_runner.reload_weights(weights_iterator=((name, tensors.get_tensor(name)) for name in names))
        if not torch.cuda.is_available():  # the layers this file filled (a bucket: some of them)
            _cpu().repack_moe_experts(model, _cpu().expert_layers(names))
        return True

    llm.collective_rpc(reload)
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - started}


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _per_rank(llm, call) -> list:
    """``call(worker)`` on every tp worker, its answers in tp-rank order."""

    def ranked(worker, call=call):
        return _tp_rank(), call(worker)

    return [answer for _, answer in sorted(llm.collective_rpc(ranked), key=lambda pair: pair[0])]


def _params(llm, request: dict) -> list:
    """Each rank's parameters as vLLM's loaders fill them, before its kernels repack them:
    ``{name: {"shape", "dtype"}}`` from the model-format metadata vLLM records for its reloads."""

    def report(worker):
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        table = {}
        for module_name, module in worker.model_runner.get_model().named_modules():
            info = LAYERWISE_INFO.get(module)
            for name, meta in (info.restore_metadata[0] if info is not None else {}).items():
                dtype = str(meta.dtype).removeprefix("torch.")
                table[f"{module_name}.{name}" if module_name else name] = {"shape": list(meta.shape), "dtype": dtype}
        return table

    return _per_rank(llm, report)


def _load_ranks(llm, request: dict) -> dict:
    """Each tp worker copies its own file's tensors (its share, in its parameters' layout) into
    place; cached prefixes are dropped."""
    paths, capture = request["paths"], request.get("capture")
    started = time.perf_counter()

    def place(worker, paths=paths, capture=capture):
        import torch
        from safetensors import safe_open

        rank, runner = _tp_rank(), worker.model_runner
        model = runner.get_model()
        with safe_open(paths[rank], framework="pt") as tensors, _placement().capturing(model, capture, rank):
            given = {name: tensors.get_tensor(name) for name in tensors.keys()}
            worker.hybridflow_digests = {name: _digest(t) for name, t in given.items()}
            _placement().place(model, runner.vllm_config.model_config, given)
        if not torch.cuda.is_available():
            _cpu().repack_moe_experts(model, _cpu().expert_layers(given))
        return True

    llm.collective_rpc(place)
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - started}


def _digests(llm, request: dict) -> list:
    return _per_rank(llm, lambda worker: getattr(worker, "hybridflow_digests", {}))


def _digest(tensor) -> list:
    """``hybridflow.rollout.base.weight_digest``, which this environment cannot import."""
    flat = tensor.reshape(-1).double()
    return [float(flat.sum()), float((flat * flat).sum())]


def _placement():
    """``placement.py`` beside this script, loaded by path (as ``cpu.py``)."""
    return _sibling("hybridflow_vllm_placement", "placement.py")


_OPS = {"load": _load, "params": _params, "load_ranks": _load_ranks, "digests": _digests}


def _serve(llm, on_gpu: bool, conn) -> None:
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the trainer side is gone
            return
        op = request.get("op")
        try:
            if op == "generate":
                reply = {"ok": _generate(llm, request)}
            elif op in _OPS:
                reply = {"ok": _OPS[op](llm, request)}
            elif op == "flush":
                reply = {"ok": bool(llm.reset_prefix_cache())}
            elif op == "sleep":
                if on_gpu:
                    llm.sleep(level=2 if "weights" in request["tags"] else 1)
                reply = {"ok": on_gpu}
            elif op == "wake":
                if on_gpu:
                    llm.wake_up(tags=[t for t in request["tags"] if t in ("weights", "kv_cache")])
                reply = {"ok": on_gpu}
            elif op == "shutdown":
                conn.send({"ok": True})
                return
            else:
                reply = {"error": f"ValueError: unknown request {op!r}"}
        except Exception as error:  # the engine stays up; the trainer side raises with this line
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(error).__name__}: {error}"}
        conn.send(reply)


def main(argv: list[str] | None = None) -> None:
    from multiprocessing.connection import Client

    args = _parse(sys.argv[1:] if argv is None else argv)
    authkey = bytes.fromhex(os.environ.pop("HYBRIDFLOW_VLLM_AUTHKEY"))
    started = time.perf_counter()
    llm, on_gpu = _start(args)
    import vllm

    conn = Client(args.socket, family="AF_UNIX", authkey=authkey)
    conn.send({"ready": {"vllm": vllm.__version__, "seconds": time.perf_counter() - started, "gpu": on_gpu}})
    _serve(llm, on_gpu, conn)
    conn.close()


if __name__ == "__main__":  # vLLM spawns its workers: the module must not start an engine on import
    main()
