"""FSDP2 backend step overhead: ``FSDP2Policy.train_step`` against a plain FSDP2 loop as a user
writes it (transformers' model from the same directory, ``fully_shard`` per decoder layer and at
the root, AdamW, the mean next-token cross entropy of the batch, clipping), and against the
megatron backend (``MegatronPolicy.train_step``) on the same dense model and batches, in one
process on this machine's CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp2_step.py [--json PATH] [--steps 6]

The trainers step in turns, batch by batch, so a slower phase of the machine costs each alike;
each median leaves out the warm-up steps. The backend's extra work per step beside the plain
loop's: the entropy beside the log-probs, the logits made again in the backward pass (chunks
of ``--chunk`` tokens, so that no [tokens x vocab] tensor is held), the metric reductions.

Prints ``{"fsdp2_step_seconds", "plain_fsdp2_step_seconds", "megatron_step_seconds",
"fsdp2_over_plain", "fsdp2_over_megatron", ...}``; ``--json`` also writes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

SHAPE = dict(  # a small dense Qwen3 a CPU steps in about a second
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def qwen3_dir(root: Path, shape: dict) -> Path:
    """A dense Qwen3 of ``shape`` (transformers' config keys) saved as the hub saves one, seeded."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    path = root / "qwen3"
    Qwen3ForCausalLM(Qwen3Config(**shape)).save_pretrained(path)
    return path


def _model_dir(root: Path) -> Path:
    return qwen3_dir(root, SHAPE)


def _batch(rows: int, seq: int, index: int):
    import torch

    generator = torch.Generator().manual_seed(index)
    return {"input_ids": torch.randint(0, SHAPE["vocab_size"], (rows, seq), generator=generator)}


def _next_token_loss(logp, entropy, micro):
    return -logp[:, 1:].sum(), logp.new_tensor(logp[:, 1:].numel()), {}


class PlainFSDP2:
    """The loop a user writes from FSDP2's and transformers' documentation."""

    def __init__(self, path: Path, train, micro: int) -> None:
        import torch
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
        self.clip, self.micro = train.clip_grad, micro

    def step(self, batch) -> None:
        import torch

        ids = batch["input_ids"]
        tokens = ids[:, 1:].numel()
        for start in range(0, ids.shape[0], self.micro):
            micro = ids[start : start + self.micro]
            logits = self.model(input_ids=micro).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), micro[:, 1:].flatten(), reduction="sum"
            )
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()


def measure(steps: int, warmup: int, rows: int, seq: int, micro: int, chunk: int) -> dict:
    """The three trainers on the same ``warmup + steps`` batches, in turns; their median times."""
    import torch
    import torch.distributed as dist

    from fsdp_adapters.policy import FSDP2Policy
    from hfschema.hf_config import read_model_config
    from hfschema.layout import ParallelLayout
    from hfschema.train import TrainConfig
    from megatron_adapters import parallel
    from megatron_adapters.policy import MegatronPolicy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    train = TrainConfig(lr=1e-5, micro_batch_size=micro, global_batch_size=rows)
    with tempfile.TemporaryDirectory(prefix="fsdp2_step-") as root:
        path = _model_dir(Path(root))
        policy = FSDP2Policy(path, train, chunk_tokens=chunk)
        trainers = {
            "fsdp2": lambda b: policy.train_step(b, _next_token_loss),
            "plain_fsdp2": PlainFSDP2(path, train, micro).step,
        }
        layout = ParallelLayout()
        pg = parallel.initialize(layout, seed=1)
        megatron = MegatronPolicy(read_model_config(path), layout, train, pg_collection=pg)
        trainers["megatron"] = lambda b: megatron.train_step(b, _next_token_loss)
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for i in range(warmup + steps):
            batch = _batch(rows, seq, i)
            for name, step in trainers.items():
                started = time.perf_counter()
                step(batch)
                if i >= warmup:
                    times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "fsdp2_step_seconds": round(median["fsdp2"], 4),
        "plain_fsdp2_step_seconds": round(median["plain_fsdp2"], 4),
        "megatron_step_seconds": round(median["megatron"], 4),
        "fsdp2_over_plain": round(median["fsdp2"] / median["plain_fsdp2"], 4),
        "fsdp2_over_megatron": round(median["fsdp2"] / median["megatron"], 4),
        "goal": "fsdp2_over_plain <= 1.05",
        "tokens_per_step": rows * seq,
        "chunk_tokens": chunk,
        "steps": steps,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "model": {k: SHAPE[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "seconds": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each trainer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rows", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per scoring chunk of the backend")
    args = parser.parse_args(argv)
    result = measure(args.steps, args.warmup, args.rows, args.seq, args.micro, args.chunk)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
