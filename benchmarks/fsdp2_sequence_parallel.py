"""Ulysses sequence parallel: a long sequence's activation peak on one rank, FSDP2 at sp=2 (the
row's tokens split over two ranks) against sp=1 (one rank holds them all), the same model, row and
step, in this run.

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp2_sequence_parallel.py [--json PATH] [--seq 4096]

Each case is a torchrun job of its own (1 rank at sp=1, 2 at sp=2) that builds ``FSDP2Policy``
on a small dense Qwen3 (activation checkpointing off: the activations are what is measured), warms
up on a short row, then takes one ``train_step`` of one row of ``--seq`` tokens. A rank's peak is
its process's high-water resident memory (``ru_maxrss``) after the long step less the one before
it: on a CPU the allocator hands freed large blocks back, so the rise is the step's own peak, the
activations and attention's scores, mostly. Prints ``{"sp1_peak_bytes", "sp2_peak_bytes",
"sp2_over_sp1", ...}`` (sp=2: the larger of its two ranks); ``--json`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.fsdp2_step import qwen3_dir  # noqa: E402
from benchmarks.output import emit  # noqa: E402

SHAPE = dict(  # small weights, so that a long row's activations dominate a rank's memory
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
)


def _rank(model_dir: Path, seq: int, sp: int, out: Path) -> None:
    """One rank of a case: the rise of its peak resident memory over one long step."""
    import torch.distributed as dist

    from fsdp_adapters.policy import FSDP2Policy
    from hfschema.train import TrainConfig
    from hybridflow.selftest import counting_batch, next_token_loss

    dist.init_process_group("gloo")
    train = TrainConfig(lr=1e-4, micro_batch_size=1, global_batch_size=1)
    policy = FSDP2Policy(model_dir, train, sp=sp, activation_checkpointing=False)
    policy.train_step(counting_batch(1, 64, SHAPE["vocab_size"], 0), next_token_loss)  # warm-up: state, pools
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = policy.train_step(counting_batch(1, seq, SHAPE["vocab_size"], 1), next_token_loss)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB on Linux
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"peak_rise_bytes": rise, "loss": result.loss})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(every))
    dist.destroy_process_group()


def _case(model_dir: Path, seq: int, sp: int, root: Path) -> list[dict]:
    out = root / f"sp{sp}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(sp), __file__]
    done = subprocess.run(
        [*command, "--rank-of", str(model_dir), str(seq), str(sp), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the sp={sp} case failed: {done.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(seq: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fsdp2_sp_") as tmp:
        root = Path(tmp)
        model_dir = qwen3_dir(root, SHAPE)
        one, two = _case(model_dir, seq, 1, root), _case(model_dir, seq, 2, root)
    sp1, sp2 = one[0]["peak_rise_bytes"], max(rank["peak_rise_bytes"] for rank in two)
    return {
        "sp1_peak_bytes": sp1,
        "sp2_peak_bytes": sp2,
        "sp2_over_sp1": round(sp2 / sp1, 3),
        "sp2_rank_peaks_bytes": [rank["peak_rise_bytes"] for rank in two],
        "loss": {"sp1": one[0]["loss"], "sp2": two[0]["loss"]},
        "goal": "sp2_over_sp1 < 1",
        "seq": seq,
        "device": "cpu",
        "model": {k: SHAPE[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")},
    }


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--rank-of":
        model_dir, seq, sp, out = argv[1:]
        _rank(Path(model_dir), int(seq), int(sp), Path(out))
        return None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--seq", type=int, default=4096, help="tokens of the long row")
    args = parser.parse_args(argv)
    result = measure(args.seq)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
