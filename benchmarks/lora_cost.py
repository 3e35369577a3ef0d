"""Full fine-tuning vs LoRA: trainer memory and weight-push bytes, measured on built policies.

    ModelConfig ──► MegatronPolicy (full FT)  ──► bytes of weights + DDP grad buffers + Adam state
                └─► MegatronPolicy (LoRA r)   ──► the same (grads and state: adapters only)
                                              ──► merged push: every weight the engine receives
                                                  (what the reshard plan sends; W + s B A merged)
                                              ──► adapter push: the adapters as SGLang's LoRA API
                                                  takes them (PEFT layout: q/k/v and gate/up each
                                                  get their own A)

One process (gloo), fp32 as on this CPU; ``--dtype bfloat16`` builds bf16 policies (then the
optimizer also keeps fp32 main params). Models: the CPU quickstart's and a wider one (``medium``)
where the adapters are a small fraction of the model, as in practice.

    .venv/bin/python benchmarks/lora_cost.py [--json out.json] [--rank 16] [--models quickstart,medium]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from hfschema.files import write_atomic  # noqa: E402

import torch  # noqa: E402

from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.lora import LoRAConfig  # noqa: E402
from hfschema.model import ModelConfig  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402

logger = logging.getLogger("lora_cost")

QUICKSTART = ModelConfig(
    family="qwen3_moe",
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=320,
    num_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=32,
    qk_layernorm=True,
    max_position_embeddings=128,
)
MEDIUM = dataclasses.replace(
    QUICKSTART,
    hidden_size=1024,
    num_layers=4,
    num_attention_heads=16,
    num_kv_heads=4,
    head_dim=64,
    num_experts=8,
    moe_ffn_hidden_size=512,
    vocab_size=4096,
)
MODELS = {"quickstart": QUICKSTART, "medium": MEDIUM}
TARGETS = ["linear_qkv", "linear_proj", "experts"]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _trainer_bytes(policy) -> dict[str, int]:
    """Weights, gradient buffers and optimizer state (moments and separate main params) of ``policy``."""
    from megatron_adapters.checkpoint import _ensure_optimizer_state
    from megatron_adapters.policy import _torch_optimizers

    _ensure_optimizer_state(policy)
    params = [p for c in policy.chunks for p in c.parameters()]
    model_ptrs = {p.data_ptr() for p in params}
    grads = [b.grad_data for c in policy.chunks for b in c.buffers + c.expert_parallel_buffers]
    state = []
    for inner in _torch_optimizers(policy.optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.data_ptr() not in model_ptrs:
                    state.append(p)  # fp32 main copy of a bf16 parameter
                state += [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    out = {"weights": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}
    out["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def _build(model: ModelConfig, lora: LoRAConfig | None, dtype: torch.dtype):
    from megatron_adapters import parallel
    from megatron_adapters.policy import MegatronPolicy

    layout = ParallelLayout()
    pg = parallel.initialize(layout, seed=0)
    return MegatronPolicy(
        model,
        layout,
        TrainConfig(micro_batch_size=1, global_batch_size=1),
        pg_collection=pg,
        params_dtype=dtype,
        lora=lora,
    )


def _adapter_push_bytes(policy) -> int:
    """Bytes of the adapters in PEFT's layout (per HF projection, own A), every target included."""
    from megatron_adapters.lora import adapted_modules
    from megatron_adapters.peft_io import _row_map

    rows = _row_map(policy.model_config)
    total = 0
    for chunk in policy.chunks:
        for _, module in adapted_modules(chunk):
            a = module.lora_a
            hf_rows: dict[str, int] = {}
            for hf, (lo, hi), _, _ in rows[module.lora_name]:
                hf_rows[hf] = hf_rows.get(hf, 0) + hi - lo
            total += sum(a.numel() + n * a.shape[0] for n in hf_rows.values()) * a.element_size()
    return total


def measure(
    model: ModelConfig = QUICKSTART,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets: list[str] | None = None,
    dtype: str = "float32",
) -> dict:
    """Trainer bytes of full fine-tuning and of LoRA ``rank`` on ``model``, and push bytes:
    ``merged_push_bytes`` (every weight, the reshard plan's push), ``merged_changed_push_bytes``
    (only the weights the adapters change), ``adapter_push_bytes`` (the adapters alone)."""
    from megatron_adapters import parallel
    from megatron_adapters.export import global_named_parameters
    from megatron_adapters.lora import adapted_modules

    torch_dtype = getattr(torch, dtype)
    full = _trainer_bytes(_build(model, None, torch_dtype))
    lora = LoRAConfig(enabled=True, rank=rank, alpha=alpha, target_modules=targets or TARGETS)
    policy = _build(model, lora, torch_dtype)
    lora_bytes = _trainer_bytes(policy)
    pushed = global_named_parameters(policy)
    changed = {f"{m.lora_name}.weight" for c in policy.chunks for _, m in adapted_modules(c)}
    result = {
        "model": {
            "family": model.family,
            "hidden_size": model.hidden_size,
            "num_layers": model.num_layers,
            "num_experts": model.num_experts,
            "vocab_size": model.vocab_size,
        },
        "dtype": dtype,
        "lora_rank": rank,
        "lora_targets": lora.target_modules,
        "full_ft_trainer_bytes": full["total"],
        "lora_trainer_bytes": lora_bytes["total"],
        "full_ft_breakdown": full,
        "lora_breakdown": lora_bytes,
        "merged_push_bytes": _nbytes(pushed.values()),
        "merged_changed_push_bytes": _nbytes(t for n, t in pushed.items() if n in changed),
        "adapter_push_bytes": _adapter_push_bytes(policy),
    }
    result["trainer_bytes_ratio"] = result["lora_trainer_bytes"] / result["full_ft_trainer_bytes"]
    result["push_bytes_ratio"] = result["adapter_push_bytes"] / result["merged_push_bytes"]
    parallel.teardown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--models", default="quickstart,medium", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = {name: measure(MODELS[name], rank=args.rank, dtype=args.dtype) for name in args.models.split(",")}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        write_atomic(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
