"""Rollout engines side by side: vLLM, SGLang and the transformers engine on one model and prompts.

    .venv/bin/python benchmarks/engines.py [--json PATH] [--prompts 16] [--n 8] [--new-tokens 32]

One tiny Qwen3-MoE (head_dim 64: vLLM's CPU attention refuses 16), fp32, each engine one replica
on one device (tp=1), started without weights and filled by a full push of the same Hugging Face
tensors, as a run fills it. Measured per engine, one after the other (nothing beside it):

    tokens_per_s        generated tokens per second of a sampled batch (``--prompts`` x ``--n``
                        samples, ``--new-tokens`` each, temperature 1), after a warm-up batch
    greedy_*_as_hf      how far its greedy responses follow the transformers engine's
    push_seconds        median of ``--repeats`` full pushes after a warm-up push, and the bytes
                        each moved (``push_gb_per_s``): vLLM's crosses its environment boundary
                        as one safetensors file in /dev/shm, mapped by its workers
    sliced_push_seconds engines that take sliced pushes (vLLM, SGLang): median of ``--repeats``
                        pushes of the rank's share as the reshard plan lays it out (the payload
                        made, then handed over: what one destination process and the driver do),
                        and the bytes (``sliced_push_gb_per_s``)

CPU figures on this machine's 2 cores, labelled so: they say how the engines compare on a CPU,
not on GPUs. Prints one JSON object; ``--json`` also writes it (temporary file, then rename).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hybridflow.rollout import SamplingParams, make_engine  # noqa: E402
from hybridflow.rollout.tiny import make_tiny_model_dir  # noqa: E402
from hfschema.engines import ENGINES, resolve  # noqa: E402
from hfschema.hf_config import read_model_config  # noqa: E402
from hfschema.sglang import SGLangSettings  # noqa: E402
from hybridflow.rollout.vllm import env  # noqa: E402
from reshard.executor import fill_rank  # noqa: E402
from reshard.sglang import sglang_layout  # noqa: E402
from reshard.vllm import vllm_layout  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    moe_intermediate_size=128,
    intermediate_size=512,
)
STARTS = {
    "vllm": lambda path: make_engine("vllm", model_path=path, max_context=256, kv_cache_bytes=1 << 30),
    "sglang": lambda path: make_engine("sglang", model_path=path, tp=1, max_total_tokens=8192, load_format="dummy"),
    "hf": lambda path: make_engine("hf", model_path=path, load_format="dummy"),
}


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 300, (12,), generator=g).tolist() for _ in range(count)]


LAYOUTS = {"vllm": vllm_layout, "sglang": sglang_layout}
"""The sliced route's destination layout of each engine that takes it (as ``weight_sync``'s, at tp=1)."""


def _sliced(name: str, engine, model: Path, weights, repeats: int) -> dict:
    """Sliced pushes of the tp=1 rank's share: the payload made (``sliced_payload``), then pushed."""
    if name not in LAYOUTS:
        return {}
    layout = LAYOUTS[name](read_model_config(model), SGLangSettings(tp=1), dtype="float32")
    share, params = fill_rank(layout, weights, 0), engine.rank_params()[0]
    prepare = resolve(ENGINES[name].sliced_payload)
    times, moved = [], 0
    for _ in range(repeats + 1):  # the first: a warm-up
        started = time.perf_counter()
        payload, kept = prepare(0, share, params)
        moved = sum(engine.push_rank_payloads([payload]).bytes_per_rank)
        times.append(time.perf_counter() - started)
        del kept
    seconds = statistics.median(times[1:])
    return {"sliced_push_seconds": seconds, "sliced_push_bytes": moved, "sliced_push_gb_per_s": moved / seconds / 1e9}


def _measure(engine, weights, prompts, args) -> dict:
    engine.push_weights(weights, route="full")
    reports = [engine.push_weights(weights, route="full") for _ in range(args.repeats)]
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens))
    sampled = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    engine.generate(prompts[:2], sampled)  # warm-up
    batch = engine.generate(prompts, sampled)
    seconds = statistics.median(r.seconds for r in reports)
    moved = sum(reports[-1].bytes_per_rank)
    return {
        "tokens_per_s": batch.num_response_tokens / batch.seconds,
        "generated_tokens": batch.num_response_tokens,
        "push_seconds": seconds,
        "push_bytes": moved,
        "push_gb_per_s": moved / seconds / 1e9,
        "greedy": [list(s.response_ids) for s in greedy.samples],
    }


def _agreement(greedy: list[list[int]], reference: list[list[int]] | None) -> dict:
    """How far each greedy response follows the transformers engine's: whole responses alike, and
    the mean share of tokens before the first that differs (a random MoE's near-tied routes can
    flip one expert on a rounding and the texts part there)."""
    if reference is None:
        return {}
    prefixes = []
    for ours, theirs in zip(greedy, reference):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        prefixes.append(same / max(len(ours), len(theirs)))
    return {
        "greedy_same_as_hf": sum(x == y for x, y in zip(greedy, reference)) / len(reference),
        "greedy_prefix_as_hf": sum(prefixes) / len(prefixes),
    }


def run(args) -> dict:
    engines = [name for name in args.engines if name != "vllm" or env.version() is not None]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model_dir(Path(tmp) / "model", "qwen3_moe", seed=0, initializer_range=0.2, **SHAPE)
        weights = load_file(str(model / "model.safetensors"))
        prompts, results = _prompts(args.prompts), {}
        for name in engines:
            engine = STARTS[name](str(model))
            try:
                results[name] = _measure(engine, weights, prompts, args)
                results[name].update(_sliced(name, engine, model, weights, args.repeats))
            finally:
                engine.shutdown()
    reference = results.get("hf", {}).get("greedy")
    for result in results.values():
        result.update(_agreement(result.pop("greedy"), reference))
    out = {
        "device": "CPU (2 cores), fp32; CPU figures, not GPU ones",
        "model": f"tiny qwen3_moe {SHAPE}",
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.new_tokens,
        "vllm": env.version(),
        "engines": results,
    }
    if "hf" in results:
        for name in results:
            out[f"{name}_vs_hf_tokens_per_s"] = results[name]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes (median reported)")
    parser.add_argument("--engines", nargs="+", default=list(STARTS), choices=list(STARTS))
    emit(run(parser.parse_args()), parser.parse_args().json)


if __name__ == "__main__":
    main()
