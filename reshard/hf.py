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


def hf_layout(model: ModelConfig, *, dtype: str = "bfloat16", copies: int = 1) -> TensorLayout:
    """``copies`` ranks (0 .. copies-1: one driver per unsharded engine replica) each holding every
    canonical tensor of ``model`` whole."""
    tensors = canonical_tensors(model, dtype=dtype)
    builder = LayoutBuilder(tensors)
    ranks = tuple(range(copies))
    for t in tensors:
        box = full_region(t.shape)
        builder.add(t.name, box, t.name, box, t.shape, ranks)
    where = "rank 0" if copies == 1 else f"each of ranks 0-{copies - 1}"
    return builder.build(
        side="hf", description=f"hf: whole tensors on {where}", model=model, dtype=dtype, num_ranks=copies
    )
