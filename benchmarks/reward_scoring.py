"""The reward-model node's scoring throughput against transformers' sequence classification.

The ``rm_score`` node scores a step's samples with ``MegatronRewardModel`` (megatron-core's
layers, micro-batched, the actor's layout); the baseline is what a reward loop built on
transformers does (verl's reward-model worker, OpenRLHF's reward server): the same directory
loaded with ``AutoModelForSequenceClassification``, the same rows right-padded in batches of the
same size, scored by its forward. One process on this machine's CPU, fp32; the two alternate
pass by pass, and the scores are compared too.

    PYTHONPATH=. .venv/bin/python benchmarks/reward_scoring.py [--json PATH] [--rows 256]

Prints ``{"node_samples_per_s", "transformers_samples_per_s", "node_over_transformers",
"max_abs_score_diff", ...}``; ``--json`` also writes it.
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

SIZES = dict(  # a small Qwen3-style MoE (benchmarks/train_step.py's)
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)


def _reward_dir(root: Path, family: str) -> Path:
    """A transformers reward model (the sizes above, ``family``'s, under a one-label score head)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hybridflow.rollout.tiny import make_tiny_model_dir

    sizes = SIZES if family == "qwen3_moe" else {k: v for k, v in SIZES.items() if "expert" not in k and "moe" not in k}
    causal = make_tiny_model_dir(root / "causal", family, vocab_size=4096, **sizes)
    net = AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1, dtype=torch.float32)
    net.save_pretrained(str(root / "rm"))
    for f in causal.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (root / "rm" / f.name).write_bytes(f.read_bytes())
    return root / "rm"


def _rows(count: int, longest: int, vocab: int, pad: int):
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(longest // 2, longest + 1, (count,), generator=g)
    ids = torch.randint(0, vocab - 1, (count, longest), generator=g)
    ids[ids >= pad] += 1
    for row, n in enumerate(lengths.tolist()):
        ids[row, n:] = pad
    return ids, lengths


def measure(rows: int, longest: int, micro: int, passes: int, family: str = "qwen3_moe") -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hfschema.layout import ParallelLayout
    from hfschema.model_source import reward_model_source
    from hfschema.train import TrainConfig
    from megatron_adapters import parallel
    from megatron_adapters.reward_model import MegatronRewardModel, load_reward_model

    with tempfile.TemporaryDirectory(prefix="reward_scoring-") as tmp:
        directory = _reward_dir(Path(tmp), family)
        source, model = reward_model_source(directory)
        layout = ParallelLayout()
        parallel.init_default_group()
        pg = parallel.initialize(layout, seed=1)
        train = TrainConfig(micro_batch_size=micro, global_batch_size=rows)
        node = MegatronRewardModel(model, layout, train, pg_collection=pg, trainable=False, initialize=False)
        load_reward_model(node, source)
        net = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32).eval()
    pad = net.config.pad_token_id
    ids, lengths = _rows(rows, longest, model.vocab_size, pad)

    def ours():
        return node.forward_scores({"input_ids": ids, "lengths": lengths}, pad)

    @torch.no_grad()
    def theirs():
        return torch.cat([net(ids[i : i + micro]).logits[:, 0] for i in range(0, rows, micro)])

    times: dict[str, list[float]] = {"node": [], "transformers": []}
    scores = {}
    for i in range(passes + 1):  # the first pass of each warms up
        for name, fn in (("node", ours), ("transformers", theirs)):
            started = time.perf_counter()
            scores[name] = fn()
            if i:
                times[name].append(time.perf_counter() - started)
    node_s, hf_s = statistics.median(times["node"]), statistics.median(times["transformers"])
    return {
        "node_samples_per_s": round(rows / node_s, 2),
        "transformers_samples_per_s": round(rows / hf_s, 2),
        "node_over_transformers": round(hf_s / node_s, 3),
        "max_abs_score_diff": float((scores["node"] - scores["transformers"]).abs().max()),
        "family": family,
        "rows": rows,
        "longest": longest,
        "micro_batch": micro,
        "passes": passes,
        "device": "cpu",
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--rows", type=int, default=128, help="samples scored per pass")
    parser.add_argument("--longest", type=int, default=256, help="tokens of the longest sample (the shortest: half)")
    parser.add_argument("--micro", type=int, default=16, help="samples per forward (both sides)")
    parser.add_argument("--passes", type=int, default=3, help="timed passes of each")
    parser.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "qwen3"), help="MoE or dense")
    args = parser.parse_args(argv)
    result = measure(args.rows, args.longest, args.micro, args.passes, args.family)
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
