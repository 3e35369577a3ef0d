"""The FSDP2 side: transformers' own parameters, each sharded on its first dimension over the
data-parallel ranks (``fully_shard``'s ``Shard(0)``).

FSDP2 splits a parameter of n rows as ``torch.chunk`` does: ceil(n / dp) rows per rank, the last
ranks fewer, some none. For a dense family transformers' parameters are the checkpoint's tensors
under the checkpoint's names (a tied output embedding is the input one, saved once), so each rank
holds one box of each canonical tensor in a parameter of the same name: the planner sends each
engine rank what it lacks from whichever FSDP2 rank holds those rows. MoE families are refused:
transformers fuses their experts into one parameter per layer (``experts.gate_up_proj``), a
layout of its own not described yet.
"""

from __future__ import annotations

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from reshard.families import canonical_tensors
from reshard.layouts import LayoutBuilder, TensorLayout
from reshard.regions import full_region

__all__ = ["fsdp_layout", "row_chunks"]


def row_chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """Each rank's ``(start, stop)`` rows of a dimension of ``rows`` under ``torch.chunk``'s split
    into ``ranks`` pieces (an empty piece is ``(rows, rows)``)."""
    size = -(-rows // ranks)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(ranks)]


def fsdp_layout(model: ModelConfig, layout: ParallelLayout, *, dtype: str = "bfloat16") -> TensorLayout:
    """Every canonical tensor of ``model`` split on dim 0 over the ``layout.dp * layout.cp`` FSDP2
    ranks (``cp``: Ulysses sequence parallel, whose ranks shard the parameters too)."""
    if model.is_moe:
        raise ValueError(
            f"model.family={model.family}: the FSDP2 weight layout of fused MoE experts is not described; "
            "train MoE families with actor.backend=megatron"
        )
    ranks = layout.dp * layout.cp
    if layout.world_size != ranks:
        raise ValueError(f"FSDP2 shards over data and sequence parallel alone: {layout.describe()} splits it otherwise")
    tensors = canonical_tensors(model, dtype=dtype)
    builder = LayoutBuilder(tensors)
    for t in tensors:
        for rank, (start, stop) in enumerate(row_chunks(t.shape[0], ranks)):
            local = (stop - start, *t.shape[1:])
            if stop == start:  # a rank past the last row: the parameter, empty
                builder.add(t.name, None, t.name, None, local, (rank,))
                continue
            region = ((start, stop), *full_region(t.shape)[1:])
            builder.add(t.name, region, t.name, full_region(local), local, (rank,))
    return builder.build(
        side="fsdp2", description=f"fsdp2 dp={layout.dp} cp={layout.cp}", model=model, dtype=dtype, num_ranks=ranks
    )
