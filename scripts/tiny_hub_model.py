"""Write a tiny random model of any architecture transformers ships, as the hub ships a model.

    python scripts/tiny_hub_model.py olmo2 /tmp/olmo2
    hybridflow train configs/quickstart_cpu_day0.yaml model.path=/tmp/olmo2

The directory holds config.json, the weights in several safetensors shards with their index, the
generation config, and the run's byte-level tokenizer with its chat template (the quickstart's
task needs no other vocabulary). For trying an architecture no hybridflow family maps on a CPU:
``actor.backend=fsdp2`` trains transformers' own class of it.
"""

from __future__ import annotations

import argparse

from hybridflow.rollout.tiny import make_tiny_model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_type", help="transformers' model_type (config.json), e.g. olmo2, llama, qwen3")
    parser.add_argument("out", help="the directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (the same seed, the same files)")
    parser.add_argument("--max-shard-size", default="100KB", help="largest safetensors file (several files)")
    args = parser.parse_args(argv)
    path = make_tiny_model_dir(args.out, args.model_type, seed=args.seed, max_shard_size=args.max_shard_size)
    print(f"wrote a tiny {args.model_type} model to {path}")


if __name__ == "__main__":
    main()
