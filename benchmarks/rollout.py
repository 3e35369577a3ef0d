"""Rollout benchmark: SGLang vs the transformers engine, and sliced vs full weight pushes.

    .venv/bin/python benchmarks/rollout.py [--json PATH] [--prompts 16] [--new-tokens 32]

On one tiny Qwen3-MoE (the same prompts for both engines) it measures generated tokens per
second of SGLang (tp=2) and of the transformers reference engine, then pushes a second model's
weights into the running SGLang engine twice: sliced (a megatron-core EP=2 actor's parameters,
resharded by the plan so each SGLang rank receives only its tensors; produced by
``tests/rollout/sglang/actor_worker.py`` under torchrun) and full (every rank receives every
HF-named tensor, the route verl / slime use); push seconds are the median of ``--repeats``
pushes after a warm-up push. Prints one JSON object; ``--json`` also writes it
(temporary file, then rename).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hybridflow.rollout import SamplingParams, make_engine  # noqa: E402
from hybridflow.rollout.tiny import make_tiny_model_dir  # noqa: E402

WORKER = ROOT / "tests" / "rollout" / "sglang" / "actor_worker.py"


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 300, (12,), generator=g).tolist() for _ in range(count)]


def _tokens_per_s(engine, prompts, new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:2], params)  # warm-up
    batch = engine.generate(prompts, params)
    return batch.num_response_tokens / batch.seconds


def _push(engine, weights, route: str, repeats: int):
    """Median seconds of ``repeats`` pushes after one warm-up push (the first sliced push on CPU
    also starts torch's shared-memory manager), and the last push's report."""
    engine.push_weights(weights, route=route)
    reports = [engine.push_weights(weights, route=route) for _ in range(repeats)]
    return statistics.median(r.seconds for r in reports), reports[-1]


def _export(actor_dir: Path, out: Path) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        "export",
        str(actor_dir),
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [torch.load(out / f"rank{r}.pt")["tensors"] for r in range(2)]


def run(num_prompts: int, new_tokens: int, repeats: int = 5) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start_dir = make_tiny_model_dir(root / "start", "qwen3_moe", seed=0, initializer_range=0.2)
        actor_dir = make_tiny_model_dir(root / "actor", "qwen3_moe", seed=1, initializer_range=0.2)
        per_rank = _export(actor_dir, root)
        prompts = _prompts(num_prompts)
        engine = make_engine("sglang", model_path=str(start_dir), tp=2, max_total_tokens=4096)
        try:
            sglang_tps = _tokens_per_s(engine, prompts, new_tokens)
            sliced_seconds, sliced = _push(engine, per_rank, "sliced", repeats)
            full_seconds, full = _push(engine, load_file(str(actor_dir / "model.safetensors")), "full", repeats)
        finally:
            engine.shutdown()
        hf = make_engine("hf", model_path=str(start_dir))
        hf_tps = _tokens_per_s(hf, prompts, new_tokens)
        hf.shutdown()
    return {
        "model": "tiny qwen3_moe (hidden 64, 2 layers, 4 experts top-2), fp32, CPU",
        "prompts": num_prompts,
        "max_new_tokens": new_tokens,
        "sglang_tp": 2,
        "sglang_tokens_per_s": sglang_tps,
        "hf_tokens_per_s": hf_tps,
        "sglang_vs_hf": sglang_tps / hf_tps,
        "push_repeats": repeats,
        "sliced_push_seconds": sliced_seconds,
        "full_push_seconds": full_seconds,
        "sliced_vs_full_seconds": sliced_seconds / full_seconds,
        "sliced_bytes_per_rank": list(sliced.bytes_per_rank),
        "full_bytes_per_rank": list(full.bytes_per_rank),
        "sliced_vs_full_bytes": sum(sliced.bytes_per_rank) / sum(full.bytes_per_rank),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per route (median reported)")
    args = parser.parse_args()
    result = run(args.prompts, args.new_tokens, args.repeats)
    emit(result, args.json)


if __name__ == "__main__":
    main()
