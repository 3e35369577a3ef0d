"""LoRA adapters to and from Hugging Face PEFT files (``adapter_config.json`` +
``adapter_model.safetensors``), named for the family's transformers model.

```
megatron module (whole, as one process holds it)      PEFT modules of the HF model
  linear_qkv  A [r, H], B [q+k+v rows, r]   ──►  q_proj / k_proj / v_proj: lora_A = A,
                                                  lora_B = B's rows of that projection
  linear_fc1  A, B [gate; up]               ──►  gate_proj / up_proj (the same split)
  linear_proj, linear_fc2  A, B             ──►  o_proj, down_proj as they are

routed expert e of E (layer L)                        PEFT target_parameters (ParamWrapper)
  linear_fc1  A_e [r, H], B_e [2I, r]       ──►  model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]
  linear_fc2  A_e [r, I], B_e [H, r]        ──►  model.layers.L.mlp.experts.down_proj    [E, H, I]
      lora_A [E*r, in]:  rows e*r .. e*r+r-1 are A_e
      lora_B [out, r*E]: column k*E + e is column k of B_e
```

Which rows of a megatron weight are which HF tensor's is the reshard planner's TP=1 Megatron
layout (``reshard.megatron``), the one mapping the converters use; B's rows follow the weight's
rows. A fused module shares one A, so its HF projections get equal lora_A; importing needs that.
PEFT's scale ``lora_alpha / r`` is the trainer's ``alpha / rank``.

Routed experts: transformers 5 loads a MoE layer's experts as two fused 3-D parameters (every
MoE family here, Mixtral's ``block_sparse_moe`` renamed to ``mlp``), [E, out, in] per expert
like a Linear weight, ``gate_up_proj`` being [gate; up] as megatron's fc1. PEFT's ParamWrapper
adds ``scale * B_e A_e`` to expert e's slice with the A / B layouts above, so B_e and A_e go
over unchanged; the E experts of a layer are gathered from every EP rank first.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hfschema.files import staged_directory
from hfschema.layout import ParallelLayout
from hfschema.lora import LoRAConfig
from hfschema.model import ModelConfig
from reshard.megatron import megatron_layout

from .convert_plan import dist_key
from .dist_io import DistReader
from .lora import adapted_modules, adapter_state, local_slice

__all__ = ["adapter_push", "checkpoint_adapters", "export_peft", "import_peft", "peft_config", "write_peft"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
_FUSED = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_FUSED_ORDER = ("gate_up_proj", "down_proj")
"""The order transformers' experts modules register their fused parameters in (PEFT nests by it)."""


_MLP = re.compile(r"^model\.layers\.\d+\.(mlp\.(shared_experts\.)?[a-z0-9_]+)$")


def _row_map(model: ModelConfig) -> dict[str, list[tuple[str, tuple[int, int], int, int]]]:
    """{megatron module: [(HF module, HF rows, first param row, HF tensor rows)]} of every weight."""
    layout = megatron_layout(model, ParallelLayout(), dtype="float32")
    rows: dict[str, list] = {}
    for shards in layout.shards.values():
        for shard in shards:
            if not shard.param.endswith(".weight") or not shard.tensor.endswith(".weight"):
                continue
            (a, b), (p, _) = shard.region[0], shard.param_region[0]
            total = layout.tensors[shard.tensor].shape[0]
            rows.setdefault(shard.param[: -len(".weight")], []).append(
                (shard.tensor[: -len(".weight")], (a, b), p, total)
            )
    return rows


def _check_exportable(state_keys, rows) -> None:
    for key in state_keys:
        module = key.rsplit(".", 1)[0]
        if module not in rows:
            raise AssertionError(f"{module}: no HF tensor maps to it")


def _fused_target(module: str) -> tuple[str, int] | None:
    """(HF fused parameter, expert index) of a routed expert's fc1 / fc2, None for other modules.
    Every MoE family's transformers model holds layer L's experts as ``model.layers.L.mlp.experts``."""
    match = _EXPERT.match(module)
    if match is None:
        return None
    layer, expert, fc = match.groups()
    return f"model.layers.{layer}.mlp.experts.{_FUSED[fc]}", int(expert)


def _param_prefix(param: str, targeted: set[str]) -> str:
    """PEFT's key prefix of a fused parameter's adapter. PEFT wraps the targeted parameters of
    one module each around the previous in registration order, so every targeted parameter
    registered after ``param`` puts its wrapper outside, and ``param``'s one ``.base_layer`` deeper."""
    module, name = param.rsplit(".", 1)
    outer = [n for n in _FUSED_ORDER[_FUSED_ORDER.index(name) + 1 :] if n in targeted]
    return f"{_PREFIX}{module}{'.base_layer' * len(outer)}"


def _expert_tensors(state: dict[str, torch.Tensor], num_experts: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The PEFT tensors of the routed experts' adapters and their ``target_parameters``."""
    groups: dict[str, dict[int, str]] = {}  # {fused parameter: {expert: megatron module}}
    for key in state:
        module, suffix = key.rsplit(".", 1)
        target = _fused_target(module)
        if target is not None and suffix == "lora_a":
            groups.setdefault(target[0], {})[target[1]] = module
    targeted = {param.rsplit(".", 1)[1] for param in groups}
    out = {}
    for param, experts in groups.items():
        if sorted(experts) != list(range(num_experts)):
            raise AssertionError(f"{param}: adapters of experts {sorted(experts)}, not all {num_experts}")
        modules = [experts[e] for e in range(num_experts)]
        prefix = _param_prefix(param, targeted)
        # ParamWrapper reads lora_A as [E, r, in] and lora_B as [out, r, E]
        out[f"{prefix}.lora_A.weight"] = torch.cat([state[f"{m}.lora_a"] for m in modules])
        out[f"{prefix}.lora_B.weight"] = torch.stack([state[f"{m}.lora_b"] for m in modules], dim=-1).flatten(1)
    return out, sorted(f"mlp.experts.{name}" for name in targeted)


def _target_name(model: ModelConfig, hf: str) -> tuple[str, bool]:
    """(PEFT target, whether it is a parameter) of the HF module ``hf``: its leaf name, or for a
    MoE family's MLP projection its weight below the layer (see the module docstring)."""
    match = _MLP.match(hf) if model.is_moe else None
    if match is not None:
        return f"{match.group(1)}.weight", True
    return hf.rsplit(".", 1)[-1], False


def peft_tensors(
    state: dict[str, torch.Tensor], model: ModelConfig
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """The PEFT state dict of whole adapters ``state`` (``adapter_state``'s keys), the target
    module names and the target parameters."""
    rows = _row_map(model)
    _check_exportable(state, rows)
    out, parameters = _expert_tensors(state, model.num_experts)
    leaves, weights = set(), set()
    for key in sorted(state):
        module, suffix = key.rsplit(".", 1)
        if suffix != "lora_b" or _fused_target(module) is not None:
            continue
        a, b = state[f"{module}.lora_a"], state[key]
        for hf, (lo, hi), at, total in rows[module]:
            name_b = f"{_PREFIX}{hf}.lora_B.weight"
            out.setdefault(name_b, b.new_zeros(total, b.shape[1]))[lo:hi] = b[at : at + hi - lo]
            out[f"{_PREFIX}{hf}.lora_A.weight"] = a.clone()
            name, is_parameter = _target_name(model, hf)
            (weights if is_parameter else leaves).add(name)
    return {k: v.contiguous() for k, v in out.items()}, sorted(leaves), sorted(parameters + sorted(weights))


def write_peft(
    state: dict[str, torch.Tensor],
    model: ModelConfig,
    lora: LoRAConfig,
    directory: str | os.PathLike,
    *,
    base_model: str | None = None,
) -> Path:
    """Write whole adapters ``state`` as PEFT files into ``directory`` (a staging directory:
    ``hfschema.files.staged_directory`` makes the result all or nothing)."""
    tensors, targets, parameters = peft_tensors(state, model)
    path = Path(directory)
    config = peft_config(lora, targets, parameters, base_model=base_model)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def peft_config(lora: LoRAConfig, targets: list[str], parameters: list[str], *, base_model: str | None = None) -> dict:
    """The ``adapter_config.json`` values of adapters on ``targets`` / ``parameters``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        # PEFT's ParamWrapper refuses any dropout; it is training-only, these files are for inference
        "lora_dropout": 0.0 if parameters else lora.dropout,
        "target_modules": targets or None,
        "target_parameters": parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def adapter_push(policy) -> tuple[dict[str, torch.Tensor], dict]:
    """``policy``'s adapters as an engine's adapter API takes them: PEFT tensors and config
    (collective: gathers every rank's adapters; every rank gets them)."""
    tensors, targets, parameters = peft_tensors(adapter_state(policy), policy.model_config)
    return tensors, peft_config(policy.lora, targets, parameters)


def export_peft(policy, directory: str | os.PathLike) -> Path:
    """Write ``policy``'s adapters as a PEFT LoRA directory (collective: gathers every TP / EP /
    PP rank's adapters; rank 0 writes)."""
    state = adapter_state(policy)
    if dist.get_rank() == 0:
        with staged_directory(directory, overwrite=True) as staging:
            write_peft(state, policy.model_config, policy.lora, staging)
    dist.barrier()
    return Path(directory)


def checkpoint_adapters(reader: DistReader, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole adapters (``adapter_state``'s keys, float32) of a LoRA run's dist checkpoint: each
    module's ``lora_a`` / ``lora_b`` keys sit beside its weight's, with the same stacked axes."""
    stored = reader.tensors()
    boxes, names = [], []
    for module in _row_map(model):
        for suffix in ("lora_a", "lora_b"):
            key, prefix, _ = dist_key(f"{module}.{suffix}", model, {})
            if key not in stored:
                continue
            shape = tuple(stored[key].size)[len(prefix) :]
            box = (key, prefix + (0,) * len(shape), (1,) * len(prefix) + shape)
            boxes.append((box, torch.empty(box[2], dtype=stored[key].properties.dtype)))
            names.append(f"{module}.{suffix}")
    if not boxes:
        raise ValueError(f"{reader.directory}: no LoRA adapter keys (*.lora_a / *.lora_b) in the checkpoint")
    reader.read(boxes)
    return {name: data.reshape(box[2][len(box[2]) - 2 :]).float() for name, (box, data) in zip(names, boxes)}


def _whole_adapters(tensors: dict[str, torch.Tensor], rows) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{megatron module: (A, B)} from PEFT tensors; a fused module's projections must share A."""
    whole = {}
    for module, pieces in rows.items():
        names = [f"{_PREFIX}{hf}.lora_A.weight" for hf, *_ in pieces]
        if not any(n in tensors for n in names):
            continue
        a_list = [tensors[n] for n in names]
        if any(not torch.equal(a_list[0], a) for a in a_list[1:]):
            raise ValueError(
                f"the PEFT adapters of {[p[0] for p in pieces]} have different lora_A; megatron's "
                f"fused {module} needs one A for them"
            )
        size = max(at + hi - lo for _, (lo, hi), at, _ in pieces)
        b = a_list[0].new_zeros(size, a_list[0].shape[0])
        for hf, (lo, hi), at, _ in pieces:
            b[at : at + hi - lo] = tensors[f"{_PREFIX}{hf}.lora_B.weight"][lo:hi]
        whole[module] = (a_list[0], b)
    return whole


def _whole_expert_adapters(tensors, rows, target_parameters: list[str], rank: int) -> dict:
    """{megatron expert module: (A_e, B_e)} from the fused parameters' PEFT tensors (inverse of
    ``_expert_tensors``)."""
    targeted = {param.rsplit(".", 1)[-1] for param in target_parameters if param.startswith("mlp.experts.")}
    whole = {}
    for module in rows:
        target = _fused_target(module)
        if target is None or target[0].rsplit(".", 1)[1] not in targeted:
            continue
        prefix = _param_prefix(target[0], targeted)
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        whole[module] = (a.unflatten(0, (-1, rank))[target[1]], b.unflatten(1, (rank, -1))[..., target[1]])
    return whole


@torch.no_grad()
def import_peft(policy, directory: str | os.PathLike) -> None:
    """Load a PEFT LoRA directory into ``policy``'s adapters (same rank and targets)."""
    path = Path(directory)
    config = json.loads((path / CONFIG_FILE).read_text())
    if config["r"] != policy.lora.rank or float(config["lora_alpha"]) != policy.lora.alpha:
        raise ValueError(
            f"{path}: r={config['r']}, lora_alpha={config['lora_alpha']} differ from lora.rank="
            f"{policy.lora.rank}, lora.alpha={policy.lora.alpha}"
        )
    tensors, rows = load_file(str(path / WEIGHTS_FILE)), _row_map(policy.model_config)
    whole = _whole_adapters(tensors, rows)
    whole.update(_whole_expert_adapters(tensors, rows, config.get("target_parameters") or [], policy.lora.rank))
    for chunk in policy.chunks:
        for _, module in adapted_modules(chunk):
            if module.lora_name not in whole:
                raise ValueError(f"{path} has no adapter for {module.lora_name}")
            a, b = whole[module.lora_name]
            module.lora_a.copy_(local_slice(module, "lora_a", a))
            module.lora_b.copy_(local_slice(module, "lora_b", b))
    if policy.optimizer is not None:
        policy.optimizer.reload_model_params()
