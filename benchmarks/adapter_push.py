"""LoRA weight sync on the SGLang engine: the adapters alone vs the merged weights, measured.

    base model dir ──► SGLang engine (lora_args: LoRA slots, rank r, the dense projections)
      merged push  : every weight of the model, W + s B A already merged by the trainer, through
                     update_weights_from_tensor under HF names (push_weights(route="full")): what
                     an RL framework sends its engine when it does not use the adapter API
      adapter push : the adapters alone in PEFT layout, load_adapter (SGLang's
                     load_lora_adapter_from_tensors); the engine keeps its base weights
      generation   : one batch of greedy requests served on the base weights, then with the
                     adapter (the price of serving unmerged adapters: the LoRA kernels run per token)

The engine is the CPU one here (tp=1, torch-native LoRA kernels; its processes are forked, which
LoRA on CPU needs: this script runs with one OpenMP thread). A dense Qwen2 model (``--hidden``,
``--layers``) with adapters on q/k/v/o and gate/up/down, as in practice for dense layers.

    .venv/bin/python benchmarks/adapter_push.py [--json out.json] [--rank 16] [--hidden 768] [--layers 6]
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: the engine's processes are then forked

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from hfschema.files import write_atomic  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model_and_adapter(root: Path, hidden: int, layers: int, rank: int) -> tuple[Path, dict, dict]:
    """A random dense Qwen2 directory and PEFT adapters for it (random B: they change the outputs)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout.tiny import make_tiny_model_dir

    heads = hidden // 64
    path = make_tiny_model_dir(
        root / "model",
        "qwen2",
        vocab_size=4096,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    net = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
    tensors = {
        f"base_model.model.{k}" if not k.startswith("base_model.") else k: v.contiguous()
        for k, v in get_peft_model_state_dict(net).items()
    }
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": TARGETS,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    return path, tensors, config


def _merged_weights(path: Path, tensors: dict, config: dict) -> dict[str, torch.Tensor]:
    """Every weight of the model with the adapters merged, under HF checkpoint names."""
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    for name in list(weights):
        a = tensors.get(f"base_model.model.{name[: -len('.weight')]}.lora_A.weight")
        if a is not None:
            b = tensors[f"base_model.model.{name[: -len('.weight')]}.lora_B.weight"]
            weights[name] = weights[name] + scale * b @ a
    return weights


def measure(*, hidden: int, layers: int, rank: int, repeats: int = 3) -> dict:
    from hybridflow.rollout import SamplingParams, make_engine
    from hybridflow.rollout.sglang.engine import lora_args

    with tempfile.TemporaryDirectory(prefix="hybridflow-adapter-push-") as tmp:
        path, tensors, config = _model_and_adapter(Path(tmp), hidden, layers, rank)
        merged = _merged_weights(path, tensors, config)
        engine = make_engine(
            "sglang",
            model_path=str(path),
            tp=1,
            max_total_tokens=8192,
            **lora_args(rank=rank, target_modules=TARGETS, on_cpu=True),
        )
        prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(8)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
        try:
            engine.generate(prompts[:1], greedy)  # first-call costs out of the timings
            started = time.perf_counter()
            engine.generate(prompts, greedy)
            generate_base = time.perf_counter() - started
            adapter = [engine.load_adapter(f"v{i}", tensors, config) for i in range(repeats)]
            started = time.perf_counter()
            engine.generate(prompts, greedy)
            generate_adapter = time.perf_counter() - started
            engine.unload_adapter(f"v{repeats - 1}")  # the base again for the merged pushes
            full = [engine.push_weights(merged, route="full") for _ in range(repeats)]
        finally:
            engine.shutdown()
    params = sum(t.numel() for t in merged.values())
    result = {
        "model": {"family": "qwen2", "hidden_size": hidden, "num_layers": layers, "params": params},
        "lora_rank": rank,
        "lora_targets": TARGETS,
        "engine": "sglang CPU tp=1",
        "repeats": repeats,
        "merged_push_bytes": full[0].bytes_per_rank[0],
        "adapter_push_bytes": adapter[0].bytes_per_rank[0],
        "merged_push_seconds": min(r.seconds for r in full),
        "adapter_push_seconds": min(r.seconds for r in adapter),
        "generate_seconds_base": generate_base,
        "generate_seconds_adapter": generate_adapter,
    }
    result["push_bytes_ratio"] = result["adapter_push_bytes"] / result["merged_push_bytes"]
    result["push_seconds_ratio"] = result["adapter_push_seconds"] / result["merged_push_seconds"]
    result["generate_slowdown_with_adapter"] = generate_adapter / generate_base
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args(argv)
    result = measure(hidden=args.hidden, layers=args.layers, rank=args.rank)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        write_atomic(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
