"""A policy's parameters under the names the reshard planner's Megatron layout uses.

The planner (``reshard/megatron.py``) names every parameter with its global layer number, as
megatron-core's checkpoints do. A pipeline stage's modules number their layers locally
(``decoder.layers.0`` is the stage's first layer); each ``TransformerLayer`` knows its global
1-based ``layer_number``, so the local index is swapped for it here.
"""

from __future__ import annotations

import re

import torch

from .policy import MegatronPolicy

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_named_parameters(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's chunks (detached), keyed by its global-layer name."""
    named: dict[str, torch.Tensor] = {}
    for chunk in policy.chunks:
        module = getattr(chunk, "module", chunk)
        layers = module.decoder.layers if hasattr(module, "decoder") else []
        for name, param in module.named_parameters():
            match = _LAYER.match(name)
            if match:
                number = layers[int(match.group(1))].layer_number - 1
                name = f"decoder.layers.{number}." + name[match.end():]
            if name in named:
                raise AssertionError(f"two chunks both hold {name}")
            named[name] = param.detach()
    return named
