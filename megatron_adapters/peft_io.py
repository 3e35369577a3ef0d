"""LoRA adapters to and from Hugging Face PEFT files (``adapter_config.json`` +
``adapter_model.safetensors``), named for the family's transformers model.

```
megatron module (whole, as one process holds it)      PEFT modules of the HF model
  linear_qkv  A [r, H], B [q+k+v rows, r]   ──►  q_proj / k_proj / v_proj: lora_A = A,
                                                  lora_B = B's rows of that projection
  linear_fc1  A, B [gate; up]               ──►  gate_proj / up_proj (the same split)
  linear_proj, linear_fc2  A, B             ──►  o_proj, down_proj as they are
```

Which rows of a megatron weight are which HF tensor's is the reshard planner's TP=1 Megatron
layout (``reshard.megatron``), the one mapping the converters use; B's rows follow the weight's
rows. A fused module shares one A, so its HF projections get equal lora_A; importing needs that.
PEFT's scale ``lora_alpha / r`` is the trainer's ``alpha / rank``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hfschema.layout import ParallelLayout
from reshard.megatron import megatron_layout

from .lora import adapted_modules, adapter_state, local_slice

__all__ = ["export_peft", "import_peft"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _row_map(policy) -> dict[str, list[tuple[str, tuple[int, int], int, int]]]:
    """{megatron module: [(HF module, HF rows, first param row, HF tensor rows)]} of every weight."""
    model = policy.model_config
    layout = megatron_layout(model, ParallelLayout(), dtype="float32")
    rows: dict[str, list] = {}
    for shards in layout.shards.values():
        for shard in shards:
            if not shard.param.endswith(".weight") or not shard.tensor.endswith(".weight"):
                continue
            (a, b), (p, _) = shard.region[0], shard.param_region[0]
            total = layout.tensors[shard.tensor].shape[0]
            rows.setdefault(shard.param[: -len(".weight")], []).append((shard.tensor[: -len(".weight")], (a, b), p, total))
    return rows


def _check_exportable(state_keys, rows) -> None:
    for key in state_keys:
        module = key.rsplit(".", 1)[0]
        if ".mlp.experts." in module:
            raise ValueError("PEFT export of routed-expert adapters is not supported: transformers 5 holds a "
                             "layer's experts as one fused parameter, not as Linear modules; drop 'experts' from "
                             "lora.target_modules to export")
        if module not in rows:
            raise AssertionError(f"{module}: no HF tensor maps to it")


def peft_tensors(policy) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The PEFT state dict of ``policy``'s adapters and the target module leaf names (collective)."""
    state, rows = adapter_state(policy), _row_map(policy)
    _check_exportable(state, rows)
    out: dict[str, torch.Tensor] = {}
    leaves = set()
    for key in sorted(state):
        module, suffix = key.rsplit(".", 1)
        if suffix != "lora_b":
            continue
        a, b = state[f"{module}.lora_a"], state[key]
        for hf, (lo, hi), at, total in rows[module]:
            name_b = f"{_PREFIX}{hf}.lora_B.weight"
            out.setdefault(name_b, b.new_zeros(total, b.shape[1]))[lo:hi] = b[at: at + hi - lo]
            out[f"{_PREFIX}{hf}.lora_A.weight"] = a.clone()
            leaves.add(hf.rsplit(".", 1)[-1])
    return {k: v.contiguous() for k, v in out.items()}, sorted(leaves)


def export_peft(policy, directory: str | os.PathLike) -> Path:
    """Write ``policy``'s adapters as a PEFT LoRA directory (collective; rank 0 writes)."""
    tensors, targets = peft_tensors(policy)
    path = Path(directory)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        lora = policy.lora
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": None,
        }
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    dist.barrier()
    return path


def _whole_adapters(tensors: dict[str, torch.Tensor], rows) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{megatron module: (A, B)} from PEFT tensors; a fused module's projections must share A."""
    whole = {}
    for module, pieces in rows.items():
        names = [f"{_PREFIX}{hf}.lora_A.weight" for hf, *_ in pieces]
        if not any(n in tensors for n in names):
            continue
        a_list = [tensors[n] for n in names]
        if any(not torch.equal(a_list[0], a) for a in a_list[1:]):
            raise ValueError(f"the PEFT adapters of {[p[0] for p in pieces]} have different lora_A; megatron's "
                             f"fused {module} needs one A for them")
        size = max(at + hi - lo for _, (lo, hi), at, _ in pieces)
        b = a_list[0].new_zeros(size, a_list[0].shape[0])
        for hf, (lo, hi), at, _ in pieces:
            b[at: at + hi - lo] = tensors[f"{_PREFIX}{hf}.lora_B.weight"][lo:hi]
        whole[module] = (a_list[0], b)
    return whole


@torch.no_grad()
def import_peft(policy, directory: str | os.PathLike) -> None:
    """Load a PEFT LoRA directory into ``policy``'s adapters (same rank and targets)."""
    path = Path(directory)
    config = json.loads((path / CONFIG_FILE).read_text())
    if config["r"] != policy.lora.rank or float(config["lora_alpha"]) != policy.lora.alpha:
        raise ValueError(f"{path}: r={config['r']}, lora_alpha={config['lora_alpha']} differ from lora.rank="
                         f"{policy.lora.rank}, lora.alpha={policy.lora.alpha}")
    whole = _whole_adapters(load_file(str(path / WEIGHTS_FILE)), _row_map(policy))
    for chunk in policy.chunks:
        for _, module in adapted_modules(chunk):
            if module.lora_name not in whole:
                raise ValueError(f"{path} has no adapter for {module.lora_name}")
            a, b = whole[module.lora_name]
            module.lora_a.copy_(local_slice(module, "lora_a", a))
            module.lora_b.copy_(local_slice(module, "lora_b", b))
    if policy.optimizer is not None:
        policy.optimizer.reload_model_params()
