"""A role's transformers model for ``model.path``, sharded with FSDP2, each rank reading its shard.

```
config.json ──► AutoModelForCausalLM.from_config, parameters on the meta device (buffers real:
                the rotary tables are computed, not stored)
            ──► fully_shard each decoder layer (the class names of ``_no_split_modules``), then
                the root: parameters are DTensors sharded over the data-parallel mesh (dim 0)
            ──► to_empty on the rank's device, the buffers put back
*.safetensors ──► torch.distributed.checkpoint with Hugging Face's storage reader: each rank
                reads the rows of each tensor its shard holds, no rank the whole model
```

Where the checkpoint's tensor names are not the model's own (transformers converts some
families' weights as it loads them: fused MoE experts), rank 0 loads the model with
``from_pretrained`` and the shards are sent from it (``broadcast_from_rank0``): every family
transformers loads is served, the one-rank read costs one host copy of the model on rank 0.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

logger = logging.getLogger(__name__)

__all__ = ["INITS", "build_sharded", "checkpoint_names", "decoder_layers", "load_hf_weights"]

INITS = ("load", "random", "empty")
"""How ``build_sharded`` fills the parameters: the directory's weights, transformers' own random
init (seeded; rank 0 draws it and sends the shards), or left for a loader (``load_hf_weights``,
a checkpoint)."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules each sharded on their own: transformers names them in ``_no_split_modules``
    (the decoder layer classes), the unit of its own device maps."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules): it cannot be sharded per layer"
        )
    return found


def checkpoint_names(path: Path) -> set[str]:
    """The tensor names a Hugging Face directory's safetensors files hold (their headers only)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as opened:
            names.update(opened.keys())
    return names


def build_sharded(
    path: Path,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    compute_dtype: torch.dtype = torch.float32,
    offload: bool = False,
    activation_checkpointing: bool = False,
    wrap=None,
    init: str = "load",
    seed: int = 0,
) -> nn.Module:
    """The causal LM of ``path``'s config.json, sharded over ``mesh``, its parameters filled as
    ``init`` says (``INITS``); parameters are kept in fp32 (the optimizer's master copy) and
    computed in ``compute_dtype`` (reductions in fp32). ``wrap(model)``: the module to shard as the
    root (one whose forward calls the model's parts, so that FSDP gathers the root's own parameters
    for it); default the model itself."""
    if init not in INITS:
        raise ValueError(f"init={init!r}: one of {', '.join(INITS)}")
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # before sharding: one parameter for both embeddings (from_config leaves them apart)
    if activation_checkpointing:
        model.config.use_cache = False  # no KV cache in a training forward (transformers warns otherwise)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    buffers = {name: value.detach().clone() for name, value in model.named_buffers()}
    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    options = {"mesh": mesh, "mp_policy": mixed, **({"offload_policy": CPUOffloadPolicy()} if offload else {})}
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    root = wrap(model) if wrap is not None else model
    fully_shard(root, **options)
    root.to_empty(device="cpu" if offload else device)
    for name, value in buffers.items():
        model.get_buffer(name).copy_(value)
    if init == "load":
        load_hf_weights(model, path, mesh.get_group())
    elif init == "random":
        _random_init(model, seed)
    return root


def _random_init(model: nn.Module, seed: int) -> None:
    """transformers' own initialisation of the model's class, drawn once (rank 0, ``seed``) and
    sent as shards: the same weights under any data-parallel size (a tiny model trained from
    scratch; a real one starts from its checkpoint)."""
    from transformers import AutoModelForCausalLM

    full = {}
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        full = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).state_dict()
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )


def load_hf_weights(model: nn.Module, path: str | Path, group: dist.ProcessGroup) -> None:
    """A Hugging Face directory's weights into the sharded ``model`` (every rank of ``group``
    calls it): each rank reads the rows its shards hold."""
    path = Path(path)
    state = model.state_dict()
    stored = checkpoint_names(path)
    tied = {name for name in state if name not in stored and _is_tied(model, name)}
    missing = set(state) - stored - tied
    if not missing:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        dcp.load(
            {k: v for k, v in state.items() if k not in tied},
            storage_reader=HuggingFaceStorageReader(str(path)),
            process_group=group,  # the policy's ranks, which need not be the whole job
        )
        return
    logger.info(
        "%s: %d of the model's tensors are not in the checkpoint under their own names (%s, ...): rank 0 "
        "loads it with transformers and sends each rank its shards",
        path,
        len(missing),
        sorted(missing)[0],
    )
    full = {}
    if dist.get_rank() == 0:  # broadcast_from_rank0 sends from the job's rank 0: a policy over all ranks
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )


def _is_tied(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the output embedding tied to the input one (saved once, as the input's)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    output = model.get_output_embeddings()
    return output is not None and name == f"{_path_of(model, output)}.weight"


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)
