"""Trainer efficiency on this CPU: padded vs packed vs packed + token-budget micro-batches.

    launcher ── draws one long-tail batch (seeded: lengths 16-512, a few 8x longer) and runs each
                 mode below in a child process of its own (its own peak memory), one at a time:
                 <this file> --mode MODE --out FILE (one process, OMP_NUM_THREADS=2)
    mode            micro-batches of the same batch and the same dense model, one train_step each
    padded          train.micro_batch_size rows, every row padded to the batch's longest: what
                    MegatronPolicy does without packing (rollout batches are right-padded to
                    their longest row, micro-batches are row slices of them)
    padded_trimmed  the same rows, each micro-batch cut to its own longest row: the stronger
                    padded baseline (verl / OpenRLHF without remove-padding)
    packed          the same rows per micro-batch, packed into one row (packing.enabled)
    packed_budget   packed rows filled up to --budget tokens (packing.max_tokens_per_micro_batch)
    per mode: tokens the model processes (padding included), seconds of one train_step (median
    of --steps after a warm-up step), peak resident memory of the process and its growth over
    the model's set-up, and the step's loss (the same in every mode: a check, not a figure)
    then full fine-tuning vs LoRA r=16 on a 69M-parameter MoE (benchmarks/lora_cost.py, its own
    process): full_ft_trainer_bytes / lora_trainer_bytes (weights + grads + optimizer state),
    merged_push_bytes / adapter_push_bytes (what one weight push sends)
    -> one JSON object, printed; --json PATH also writes it (tmp file + rename)

The loss is a next-token loss over every real token but each row's first, token-averaged over the
batch. Attention on the CPU runs megatron's local spec, once per sample of a packed row
(``megatron_adapters.packing.SegmentedAttention``): a packed row's attention costs the sum of its
samples' length², as a THD kernel on TE does. The step seconds share this machine's two cores
with whatever else runs: compare modes of one run, not runs.

    .venv/bin/python benchmarks/efficiency.py [--rows 32] [--budget 4096] [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from hfschema.files import write_atomic  # noqa: E402

MODES = ("padded", "padded_trimmed", "packed", "packed_budget")
MICRO_BATCH_SIZE = 2
MODEL = dict(
    family="llama",
    hidden_size=128,
    num_layers=2,
    num_attention_heads=2,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden_size=256,
    vocab_size=512,
    max_position_embeddings=8192,
    num_experts=0,
)


def long_tail_lengths(rows: int, seed: int) -> list[int]:
    """Uniform 16-512 tokens, and about one row in 16 (at least two) 8x longer."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 512) for _ in range(rows)]
    for row in rng.sample(range(rows), max(2, rows // 16)):
        lengths[row] *= 8
    return lengths


def processed_tokens(mode: str, lengths: list[int], budget: int) -> int:
    """Tokens the model runs in ``mode``, padding included (tp = 1: no width rounding)."""
    from megatron_adapters.packing import plan_budget, plan_fixed

    micros = [lengths[i : i + MICRO_BATCH_SIZE] for i in range(0, len(lengths), MICRO_BATCH_SIZE)]
    if mode == "padded":
        return len(lengths) * max(lengths)
    if mode == "padded_trimmed":
        return sum(len(m) * max(m) for m in micros)
    plan = plan_fixed(lengths, MICRO_BATCH_SIZE) if mode == "packed" else plan_budget(lengths, budget)
    return plan.processed_tokens()


# ------------------------------------------------------------------------------ child: one mode


def _batch(lengths: list[int]):
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, MODEL["vocab_size"], (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).float()
    mask[:, 0] = 0
    return {"input_ids": ids, "loss_mask": mask}


def _trim_micro_batches(policy) -> None:
    """Cut each of ``policy``'s unpacked micro-batches to its longest marked row."""
    plain = policy._micro_batches

    def trimmed(batch, micro_batch_size):
        out = []
        for micro in plain(batch, micro_batch_size):
            width = int(micro["loss_mask"].nonzero()[:, 1].max()) + 1
            out.append({k: v[:, :width] for k, v in micro.items()})
        return out

    policy._micro_batches = trimmed


def run_mode(mode: str, lengths: list[int], budget: int, steps: int) -> dict:
    """One process: build the model, ``steps`` timed train steps after a warm-up step."""
    import torch

    from hfschema.layout import ParallelLayout
    from hfschema.model import ModelConfig
    from hfschema.packing import PackingConfig
    from hfschema.train import TrainConfig
    from hybridflow.selftest import next_token_loss
    from megatron_adapters import parallel
    from megatron_adapters.policy import MegatronPolicy

    packing = {
        "packed": PackingConfig(enabled=True),
        "packed_budget": PackingConfig(enabled=True, max_tokens_per_micro_batch=budget),
    }.get(mode)
    layout = ParallelLayout()
    pg = parallel.initialize(layout, seed=1)
    train = TrainConfig(lr=1e-4, micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=len(lengths))
    policy = MegatronPolicy(ModelConfig(**MODEL), layout, train, pg_collection=pg, packing_config=packing)
    if mode == "padded_trimmed":
        _trim_micro_batches(policy)
    batch = _batch(lengths)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses, seconds = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        result = policy.train_step(batch, next_token_loss)
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parallel.teardown()
    torch.distributed.destroy_process_group()
    return {
        "step_seconds": statistics.median(seconds[1:]),
        "first_loss": losses[0],
        "peak_rss_bytes": peak,
        "peak_rss_growth_bytes": peak - rss_before,
    }


# ------------------------------------------------------------------------------ launcher


def _child(mode: str, lengths: list[int], args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mode.json"
        cmd = [
            sys.executable,
            __file__,
            "--mode",
            mode,
            "--out",
            str(out),
            "--rows",
            str(args.rows),
            "--seed",
            str(args.seed),
            "--budget",
            str(args.budget),
            "--steps",
            str(args.steps),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


LORA_KEYS = ("full_ft_trainer_bytes", "lora_trainer_bytes", "merged_push_bytes", "adapter_push_bytes")


def _lora_keys(args) -> dict:
    """Full fine-tuning vs LoRA r=16 on the medium MoE: trainer bytes (weights + grads + optimizer
    state) and push bytes (``benchmarks/lora_cost.py``, in its own process: it builds policies
    under a one-process group of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lora.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "lora_cost.py"),
                "--models",
                "medium",
                "--rank",
                "16",
                "--json",
                str(out),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        medium = json.loads(out.read_text())["medium"]
    return {**{key: medium[key] for key in LORA_KEYS}, "lora": medium}


def measure(args) -> dict:
    lengths = long_tail_lengths(args.rows, args.seed)
    modes = {
        mode: {"tokens": processed_tokens(mode, lengths, args.budget), **_child(mode, lengths, args)} for mode in MODES
    }
    result = {
        "rows": args.rows,
        "real_tokens": sum(lengths),
        "longest": max(lengths),
        "budget": args.budget,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "model": MODEL,
        "modes": modes,
    }
    for mode, stats in modes.items():
        result[f"{mode}_tokens"] = stats["tokens"]
        result[f"{mode}_step_seconds"] = stats["step_seconds"]
        result[f"{mode}_peak_rss_bytes"] = stats["peak_rss_bytes"]
    for base in ("padded", "padded_trimmed"):
        result[f"tokens_ratio_vs_{base}"] = modes[base]["tokens"] / modes["packed_budget"]["tokens"]
        result[f"speedup_vs_{base}"] = modes[base]["step_seconds"] / modes["packed_budget"]["step_seconds"]
    losses = [stats["first_loss"] for stats in modes.values()]
    result["loss_spread"] = max(losses) - min(losses)
    result.update(_lora_keys(args))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    parser.add_argument("--rows", type=int, default=32, help="samples in the batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length draw")
    parser.add_argument("--budget", type=int, default=4096, help="packing.max_tokens_per_micro_batch")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode, after one warm-up step")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each mode's process")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child: run one mode
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        lengths = long_tail_lengths(args.rows, args.seed)
        write_atomic(Path(args.out), json.dumps(run_mode(args.mode, lengths, args.budget, args.steps)))
        return
    if args.budget < max(long_tail_lengths(args.rows, args.seed)):
        parser.error(f"--budget {args.budget} is below the longest sample")
    text = json.dumps(measure(args), indent=2)
    print(text)
    if args.json:
        write_atomic(Path(args.json), text + "\n")


if __name__ == "__main__":
    main()
