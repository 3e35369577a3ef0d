"""Trainer step overhead: ``MegatronPolicy.train_step`` against a plain megatron-core
``forward_backward_func`` loop (``megatron_adapters/plain_loop.py``: the same GPTModel, DDP,
optimizer and micro-batching, the loss from the model's own cross entropy), on the same batches
and model sizes, in one process on this machine's CPU (``scripts/gpu_check.py`` makes the same
comparison on a GPU).

    PYTHONPATH=. .venv/bin/python benchmarks/train_step.py [--json PATH] [--steps 6]

The two trainers step in turns, batch by batch, so a slower phase of the machine costs both
alike; each median leaves out the warm-up steps. The policy's extra work per step: the entropy
beside the per-token log-probs (``megatron_adapters/logprobs.py``: both from one softmax, where
the plain loop takes megatron-core's cross entropy alone), the metric reductions, the
finite-gradient check.

Prints ``{"policy_step_seconds", "plain_loop_step_seconds", "policy_over_plain", ...}``; ``--json``
also writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

from hfschema.model import ModelConfig  # noqa: E402
from hybridflow.config import load_config  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart_gpu.yaml"  # world size 1: one process here
MODEL = ModelConfig(  # a small Qwen3-style MoE a CPU steps in about a second
    family="qwen3_moe",
    hidden_size=256,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=4,
    head_dim=32,
    ffn_hidden_size=512,
    vocab_size=4096,
    num_experts=8,
    moe_top_k=2,
    moe_ffn_hidden_size=128,
    qk_layernorm=True,
    max_position_embeddings=512,
)


def _timed(step, batch) -> float:
    started = time.perf_counter()
    step(batch)
    return time.perf_counter() - started


def measure(steps: int, warmup: int, rows: int, seq: int, micro: int) -> dict:
    """Both trainers on the same ``warmup + steps`` batches, alternating; their median step times."""
    import torch

    from hybridflow.selftest import counting_batch, next_token_loss
    from megatron_adapters import parallel
    from megatron_adapters.plain_loop import PlainTrainer
    from megatron_adapters.policy import MegatronPolicy

    with tempfile.TemporaryDirectory(prefix="train_step-") as out:
        cfg = load_config(str(CONFIG), [f"run.output_dir={out}"])
    train = dataclasses.replace(cfg.train, micro_batch_size=micro, global_batch_size=rows)
    parallel.init_default_group()
    pg = parallel.initialize(cfg.actor.parallel, seed=1)
    plain = PlainTrainer(MODEL, cfg.actor.parallel, train, pg_collection=pg, params_dtype=torch.float32)
    policy = MegatronPolicy(MODEL, cfg.actor.parallel, train, pg_collection=pg, params_dtype=torch.float32)
    times: dict[str, list[float]] = {"plain": [], "policy": []}
    for i in range(warmup + steps):
        batch = counting_batch(rows, seq, MODEL.vocab_size, i)
        for name, step in (("plain", plain.step), ("policy", lambda b: policy.train_step(b, next_token_loss))):
            seconds = _timed(step, batch)
            if i >= warmup:
                times[name].append(seconds)
    plain_s, policy_s = statistics.median(times["plain"]), statistics.median(times["policy"])
    return {
        "policy_step_seconds": round(policy_s, 4),
        "plain_loop_step_seconds": round(plain_s, 4),
        "policy_over_plain": round(policy_s / plain_s, 4),
        "goal": "policy_over_plain <= 1.05",
        "tokens_per_step": rows * seq,
        "steps": steps,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "model": {"hidden_size": MODEL.hidden_size, "num_layers": MODEL.num_layers, "num_experts": MODEL.num_experts},
        "policy_seconds": [round(t, 4) for t in times["policy"]],
        "plain_loop_seconds": [round(t, 4) for t in times["plain"]],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each trainer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rows", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    args = parser.parse_args(argv)
    result = measure(args.steps, args.warmup, args.rows, args.seq, args.micro)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
