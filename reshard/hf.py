"""The Hugging Face side: every canonical tensor whole, under its checkpoint name, on one rank.

This is what a checkpoint writer needs, and what the full-tensor weight push hands to an engine
whose own loader slices each tensor (the measured baseline of the sliced push). A canonical
tensor is its own parameter here, so the executor's buffers are the HF tensors themselves.
"""

from __future__ import annotations

from hfschema.model import ModelConfig
from reshard.families import canonical_tensors
from reshard.layouts import LayoutBuilder, TensorLayout
from reshard.regions import full_region

__all__ = ["hf_layout"]


def hf_layout(model: ModelConfig, *, dtype: str = "bfloat16") -> TensorLayout:
    """One rank (rank 0) holding every canonical tensor of ``model`` whole."""
    tensors = canonical_tensors(model, dtype=dtype)
    builder = LayoutBuilder(tensors)
    for t in tensors:
        box = full_region(t.shape)
        builder.add(t.name, box, t.name, box, t.shape, (0,))
    return builder.build(side="hf", description="hf: whole tensors on rank 0", model=model, dtype=dtype, num_ranks=1)
