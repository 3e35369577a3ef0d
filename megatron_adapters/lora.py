"""LoRA adapters on megatron-core's parallel linear layers, split the way their base weights are.

```
ColumnParallelLinear (output rows split over TP)      y_r = W_r x + s * B_r (A x)
    A [rank, in] replicated, B_r [out/tp, rank]         x gathered over the sequence (SP) first;
                                                        d(Ax) all-reduced over TP in backward
RowParallelLinear (input columns split over TP)       y = sum_r W_r x_r + s * B (sum_r A_r x_r)
    A_r [rank, in/tp], B [out, rank] replicated         the rank-sized partial A_r x_r is
                                                        all-reduced (r values per token, not
                                                        out), then split over the sequence (SP)
routed experts, etp=1                                 each rank's local experts own their A, B
routed experts, etp>1 (fc1 column-, fc2 row-split)    no factor replicated: the rank dim r is
    fc1  A_i [r/etp, in], B_i [out/etp, r]              split too. The dispatcher hands every
         h = all-gather_i(A_i x); y_i += s B_i h        etp rank the same tokens and sums their
    fc2  A_i [r, in/etp], B_i [out, r/etp]              outputs, so an expert's own comm is
         h_i = reduce-scatter(A_i x_i); y_i += s B_i h_i  only these r-sized h exchanges
```
Replicating fc1's A (or fc2's B) over etp, as over TP, would give each etp rank a partial
gradient of it that megatron never sums (the expert optimizer's duplicate filter also looks at
the dense TP rank), hence the split rank. Its backward: fc1's all-gather of h reduce-scatters the
ranks' partial dh; fc2's reduce-scatter all-gathers dh. Both keep every gradient whole and unique.

``s = alpha / rank``; B starts at zero, so a fresh adapter leaves the model unchanged. A is
drawn from a generator seeded by the module's global name, then sliced: every layout starts
from the same adapters. The adapter is a forward hook on the base module, so base parameter
names (checkpoints, converters, the reshard plan) stay as they are; ``lora_a`` / ``lora_b``
are parameters of the base module and enter megatron's sharded state dict with the split above.
The base weights are frozen before megatron's DDP and optimizer exist, so neither allocates
gradients or state for them.

Dropout (``lora.dropout``) on an adapter's input draws its mask from a generator seeded by
(``lora.seed``, the optimizer step, the module's global name, its call in the step, the data
rank), not from a process's running RNG: every rank that sees the same input (TP ranks on a
column-parallel layer, etp ranks on an expert's fc1) draws the same mask, a row-parallel rank
takes its input columns of the whole mask, and the masks are the ones one process draws, so a
layout trains as one process does, dropout included. The step comes from the scheduler, which
checkpoints save: a resumed run draws the masks again.
"""

from __future__ import annotations

import logging
import math
import re
import zlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from hfschema.lora import LoRAConfig

__all__ = [
    "ADAPTER_SUFFIXES",
    "adapter_state",
    "apply_lora",
    "adapted_modules",
    "dropout_step",
    "is_adapter",
    "merged_weights",
]

logger = logging.getLogger(__name__)

ADAPTER_SUFFIXES = ("lora_a", "lora_b")
"""Parameter names the adapters add to their base module."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


def _target(name: str) -> str | None:
    """The ``lora.target_modules`` entry a module (by its name in the GPTModel) belongs to."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("linear_qkv", "linear_proj") and ".self_attention." in name:
        return leaf
    if leaf not in ("linear_fc1", "linear_fc2"):
        return None
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    return leaf if name.endswith(f".mlp.{leaf}") else None


def _tp_size(module) -> int:
    """Ranks the base weight is split over: TP, or etp for a routed expert."""
    return 1 if module.tp_group is None else module.tp_group.size()


def _splits(module, column: bool) -> dict[str, int | None]:
    """The dim each adapter factor is split along over the module's group (None: replicated)."""
    if module.is_expert and _tp_size(module) > 1:  # the rank dim too (see the module docstring)
        return {"lora_a": 0, "lora_b": 0} if column else {"lora_a": 1, "lora_b": 1}
    return {"lora_a": None, "lora_b": 0} if column else {"lora_a": 1, "lora_b": None}


def _global_name(name: str, chunk) -> str:
    """``name`` with the chunk's local expert index and layer index made global."""
    expert = _EXPERT.search(name)
    if expert:
        experts = chunk.get_submodule(name[: expert.start()] + ".mlp.experts")
        index = parallel_state.get_expert_model_parallel_rank() * experts.num_local_experts + int(expert.group(1))
        name = f"{name[: expert.start()]}.mlp.experts.local_experts.{index}.{name[expert.end() :]}"
    match = _LAYER.match(name)
    if match:
        number = chunk.decoder.layers[int(match.group(1))].layer_number - 1
        name = f"decoder.layers.{number}." + name[match.end() :]
    return name


def _init_a(global_name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """The whole (unsplit) A of a module: uniform(-1/sqrt(in), 1/sqrt(in)), as PEFT's default."""
    generator = torch.Generator().manual_seed(zlib.crc32(global_name.encode()) ^ seed)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound)


def _make_adapter(module, global_name: str, lora: LoRAConfig) -> None:
    """Add ``lora_a`` / ``lora_b`` to ``module``, split as its weight is, and its forward hook."""
    weight = module.weight
    tp = _tp_size(module)
    rank = 0 if tp == 1 else module.tp_group.rank()
    column = isinstance(module, ColumnParallelLinear)
    out_global, in_global = weight.shape[0] * (tp if column else 1), weight.shape[1] * (1 if column else tp)
    split = _splits(module, column)
    whole = {
        "lora_a": _init_a(global_name, (lora.rank, in_global), lora.seed),
        "lora_b": torch.zeros(out_global, lora.rank, dtype=torch.float64),
    }
    expert = module.is_expert
    for name, full in whole.items():
        dim = split[name] if tp > 1 else None
        local = full if dim is None else full.chunk(tp, dim=dim)[rank]
        param = torch.nn.Parameter(local.to(weight.dtype).to(weight.device).contiguous())
        # split like the base (megatron counts them once in the grad norm); experts: nothing duplicated
        set_tensor_model_parallel_attributes(
            param, expert or dim is not None, dim if dim is not None else (1 if name == "lora_a" else 0), 1
        )
        if expert:
            param.allreduce = False  # reduced over the expert data-parallel group, like the base
        module.register_parameter(name, param)
    module.lora_name = global_name
    module.lora_split = split
    module.lora_scale = lora.alpha / lora.rank
    module.lora_dropout = lora.dropout
    module.lora_seed = lora.seed
    module.lora_key = (0, 0)  # (optimizer step, data rank): dropout_step sets it before a step
    module.lora_calls = 0
    if expert and tp > 1:
        module.register_forward_hook(_expert_column_hook if column else _expert_row_hook)
    else:
        module.register_forward_hook(_column_hook if column else _row_hook)
    _shard_adapters_in_checkpoints(module, column)


def dropout_step(chunks: list, step: int) -> None:
    """Key the adapters' dropout masks by optimizer step ``step`` (call before a training step):
    each module then counts its forwards in the step. The data rank of an expert's module is its
    expert data-parallel rank (etp ranks share its tokens), of any other the data-parallel rank
    with context parallelism (TP ranks share its tokens; CP ranks hold other ones)."""
    dense = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    expert = parallel_state.get_expert_data_parallel_rank()
    for chunk in chunks:
        for _, module in adapted_modules(chunk):
            module.lora_key, module.lora_calls = (step, expert if module.is_expert else dense), 0


def _dropout(module, x: torch.Tensor, shard: tuple[int, int] | None = None) -> torch.Tensor:
    """``x`` under this call's dropout mask; ``shard`` (rank, ranks): ``x`` is that share of the
    input's last dim (a row-parallel layer) and takes the same share of the whole input's mask."""
    p = module.lora_dropout
    if not p or not module.training:
        return x
    step, rank = module.lora_key
    key = f"{module.lora_name}/{step}/{module.lora_calls}/{rank}".encode()
    module.lora_calls += 1
    generator = torch.Generator(device=x.device).manual_seed(zlib.crc32(key) ^ module.lora_seed)
    width = x.shape[-1] * (shard[1] if shard else 1)
    keep = torch.rand((*x.shape[:-1], width), generator=generator, device=x.device) >= p
    if shard:
        keep = keep.narrow(-1, shard[0] * x.shape[-1], x.shape[-1])
    return x * keep.to(x.dtype) / (1 - p)


def _row_shard(module) -> tuple[int, int] | None:
    """(rank, ranks) of a row-parallel module's input columns, None when it is whole."""
    tp = _tp_size(module)
    return (module.tp_group.rank(), tp) if tp > 1 else None


def _column_hook(module, args, output):
    x, group, tp = args[0], module.tp_group, _tp_size(module)
    if tp > 1 and module.sequence_parallel:
        # each rank's grad of the gathered x is already whole here: split it back, no reduction
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
    h = F.linear(_dropout(module, x), module.lora_a)
    if tp > 1:
        h = copy_to_tensor_model_parallel_region(h, group=group)  # backward: sum each rank's part
    delta = F.linear(h, module.lora_b) * module.lora_scale
    return (output[0] + delta, *output[1:])


def _row_hook(module, args, output):
    x, group, tp = args[0], module.tp_group, _tp_size(module)
    h = F.linear(_dropout(module, x, _row_shard(module)), module.lora_a)
    if tp > 1:
        h = reduce_from_tensor_model_parallel_region(h, group=group)
    delta = F.linear(h, module.lora_b) * module.lora_scale
    if tp > 1 and module.sequence_parallel:
        delta = scatter_to_sequence_parallel_region(delta, group=group)
    return (output[0] + delta, *output[1:])


def _rank_dim_collective(h: torch.Tensor, group, collective) -> torch.Tensor:
    """``collective`` (megatron's dim-0 sequence-parallel mappings) applied to h's last dim."""
    flat = h.reshape(-1, h.shape[-1]).t().contiguous()
    out = collective(flat, group=group).t()
    return out.reshape(*h.shape[:-1], out.shape[-1])


def _expert_column_hook(module, args, output):
    h = F.linear(_dropout(module, args[0]), module.lora_a)  # this rank's r/etp of A x
    # all of A x on every etp rank; backward: the ranks' partial dh summed, each keeping its part
    h = _rank_dim_collective(
        h,
        module.tp_group,
        lambda t, group: gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group),
    )
    delta = F.linear(h, module.lora_b) * module.lora_scale
    return (output[0] + delta, *output[1:])


def _expert_row_hook(module, args, output):
    h = F.linear(_dropout(module, args[0], _row_shard(module)), module.lora_a)  # partial over this rank's columns
    h = _rank_dim_collective(h, module.tp_group, reduce_scatter_to_sequence_parallel_region)
    delta = F.linear(h, module.lora_b) * module.lora_scale  # partial: the dispatcher sums the etp ranks
    return (output[0] + delta, *output[1:])


def _shard_adapters_in_checkpoints(module, column: bool) -> None:
    """Replace the adapters' entries of ``module.sharded_state_dict`` (megatron saves unknown
    parameters as replicated) with ones split over TP as the adapters are; fc1's B is
    [gate; up] per rank like its weight, so it takes megatron's swiglu factory too."""
    original = module.sharded_state_dict
    axis = {name: dim for name, dim in module.lora_split.items() if dim is not None}
    gated = column and module.config.gated_linear_unit and getattr(module, "_lora_fc1", False)

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        state = original(prefix, sharded_offsets, metadata)
        adapters = {k: getattr(module, k) for k in ADAPTER_SUFFIXES}
        sharded = make_sharded_tensors_for_checkpoint(
            adapters, prefix, axis, sharded_offsets, tp_group=module.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )
        if gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, singleton)
        state.update(sharded)
        return state

    module.sharded_state_dict = sharded_state_dict


def adapted_modules(chunk) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every module of ``chunk`` (a GPTModel or its DDP wrapper) with adapters."""
    module = getattr(chunk, "module", chunk)
    for name, sub in module.named_modules():
        if hasattr(sub, "lora_a") and isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            yield name, sub


def apply_lora(chunks: list, lora: LoRAConfig) -> int:
    """Freeze every parameter of ``chunks`` and add adapters to the targets; returns how many
    modules got one. Call before megatron's DDP wraps the chunks. A base bias stays as it is:
    the adapter adds to the output either way (``skip_bias_add`` or not).

    The routers' expert bias (DeepSeek-V3's aux-loss-free balancing) is base state too, moved by
    megatron after each step rather than by the optimizer: its update rate is set to 0, so the
    base stays the one the PEFT files are for (they cannot carry a bias)."""
    targets = set(lora.target_modules)
    count = 0
    config = chunks[0].config  # the chunks share it; finalize_model_grads reads the rate at each step
    if config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate:
        logger.info(
            "LoRA: expert-bias update rate %g -> 0 (the routers' bias is part of the frozen base)",
            config.moe_router_bias_update_rate,
        )
    for chunk in chunks:
        chunk.config.moe_router_bias_update_rate = 0.0
        for param in chunk.parameters():
            param.requires_grad_(False)
        for name, module in list(chunk.named_modules()):
            if _target(name) not in targets or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            module._lora_fc1 = name.endswith("linear_fc1")
            _make_adapter(module, _global_name(name, chunk), lora)
            count += 1
    return count  # may be 0 on a pipeline stage without the targets (experts, dense layers)


@torch.no_grad()
def merged_weights(chunk) -> dict[str, torch.Tensor]:
    """``{local weight name: W + s * B A}`` for every adapted module of ``chunk``: the local
    shard of the merged weight, in the base weight's own layout. Collective over an expert's etp
    group where etp > 1 (its rank-split factor is gathered): every actor rank calls it."""
    merged = {}
    for name, module in adapted_modules(chunk):
        a, b = module.lora_a, module.lora_b
        if module.is_expert and _tp_size(module) > 1:  # the factor split along r, whole for the product
            if isinstance(module, ColumnParallelLinear):  # A [r/etp, in] -> [r, in]
                a = gather_from_sequence_parallel_region(a, tensor_parallel_output_grad=False, group=module.tp_group)
            else:  # B [out, r/etp] -> [out, r]
                b = gather_from_tensor_model_parallel_region(b, group=module.tp_group)
        delta = (b @ a) * module.lora_scale
        merged[f"{name}.weight"] = module.weight + delta.to(module.weight.dtype)
    return merged


def _gated(module, suffix: str) -> bool:
    """Whether ``suffix`` of ``module`` is fc1's B under a gated MLP: [gate_r; up_r] per TP rank."""
    return suffix == "lora_b" and module._lora_fc1 and module.config.gated_linear_unit


def _local_pieces(chunks, grads: bool) -> list[tuple[str, int | None, int, torch.Tensor]]:
    """(global key, split dim, TP rank, local tensor on the host) of this rank's adapters; the
    split dim is -1 for a gated fc1's B."""
    pieces = []
    for chunk in chunks:
        for _, module in adapted_modules(chunk):
            tp = _tp_size(module)
            rank = 0 if tp == 1 else module.tp_group.rank()
            for suffix in ADAPTER_SUFFIXES:
                param = getattr(module, suffix)
                value = param.main_grad if grads else param
                dim = module.lora_split[suffix] if tp > 1 else None
                dim = -1 if dim == 0 and _gated(module, suffix) else dim
                if dim is None and rank > 0:
                    continue  # a replica of TP rank 0's
                pieces.append((f"{module.lora_name}.{suffix}", dim, rank, value.detach().float().cpu().clone()))
    return pieces


def adapter_state(policy, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter of the model, whole (as one process holds it), on every rank, keyed
    ``<global module name>.lora_a`` / ``.lora_b``; ``grads``: their gradients (``main_grad``,
    whole only without the distributed optimizer). Collective over the world: adapters are small."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _local_pieces(policy.chunks, grads))
    parts: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    for pieces in gathered:
        for key, dim, rank, tensor in pieces:
            parts.setdefault(key, {})[rank] = (dim, tensor)  # data-parallel replicas are equal
    state = {}
    for key in sorted(parts):
        ranks = parts[key]
        dim, tensors = ranks[0][0], [ranks[r][1] for r in sorted(ranks)]
        if dim == -1:  # [gate_0; up_0; gate_1; up_1] -> [gate; up]
            halves = [t.chunk(2) for t in tensors]
            state[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            state[key] = tensors[0] if dim is None else torch.cat(tensors, dim=dim)
    return state


def local_slice(module, suffix: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of an adapter tensor given whole (the inverse of ``adapter_state``)."""
    tp = _tp_size(module)
    dim = module.lora_split[suffix] if tp > 1 else None
    if dim is None:
        return whole
    rank = module.tp_group.rank()
    if _gated(module, suffix):
        gate, up = whole.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return whole.chunk(tp, dim=dim)[rank]
