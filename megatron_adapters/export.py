"""A policy's parameters under the names the reshard planner's Megatron layout uses.

The planner (``reshard/megatron.py``) names every parameter with its global layer number, as
megatron-core's checkpoints do. A pipeline stage's modules number their layers locally
(``decoder.layers.0`` is the stage's first layer); each ``TransformerLayer`` knows its global
1-based ``layer_number``, so the local index is swapped for it here.

The aux-loss-free expert bias (DeepSeek-V3's ``e_score_correction_bias``) is a buffer in
megatron-core, not a parameter, yet it is part of the model: the planner moves it like a weight,
so it is exported with the parameters.
"""

from __future__ import annotations

import re

import torch

from .lora import is_adapter, merged_weights
from .policy import MegatronPolicy

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_WEIGHT_BUFFERS = ("mlp.router.expert_bias",)
"""Buffers that are model weights (name suffixes)."""


def global_named_parameters(policy: MegatronPolicy, *, merge_adapters: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's chunks and the expert-bias buffers (detached), keyed by
    global-layer name. Under LoRA the adapters themselves are left out and an adapted weight is
    the merged W + s * B A (a new tensor), or with ``merge_adapters=False`` the frozen base W (an
    engine that receives the adapters apart: ``lora.push=adapter``)."""
    named: dict[str, torch.Tensor] = {}
    for chunk in policy.chunks:
        module = getattr(chunk, "module", chunk)
        layers = module.decoder.layers if hasattr(module, "decoder") else []
        buffers = [(n, b) for n, b in module.named_buffers() if n.endswith(_WEIGHT_BUFFERS)]
        merged = merged_weights(module) if merge_adapters else {}
        for name, param in [*module.named_parameters(), *buffers]:
            if is_adapter(name):
                continue
            param = merged.get(name, param)
            match = _LAYER.match(name)
            if match:
                number = layers[int(match.group(1))].layer_number - 1
                name = f"decoder.layers.{number}." + name[match.end() :]
            if name in named:
                raise AssertionError(f"two chunks both hold {name}")
            named[name] = param.detach()
    return named
