"""The Megatron side: which boxes of which canonical tensors each megatron-core rank holds.

    ModelConfig + ParallelLayout (+ uneven first / last pipeline stage)
        -> canonical tensors (reshard.families)
        -> per tensor: pipeline stage (layer -> pp rank, embedding first, head last)
                       rule(tensor) -> pieces (box, param box, position)
        -> position + stage -> ranks (the rank order below)
        -> TensorLayout(side="megatron")

Rank order (megatron-core ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``, tp fastest):

    dense grid   rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))
    expert grid  rank = etp_r + etp * (ep_r + ep * (edp_r + edp * pp_r))

over the same ranks (``RankGenerator`` with ep=1 for the dense grid and tp=etp, cp=1 for the
expert grid). A dense tensor box held at tp rank r of stage p is held by every cp x dp rank
there (all candidate sources); a routed expert's box by every expert-dp rank.

Pipeline: with ``vpp`` virtual stages, layer L sits in model chunk L // (num_layers / (pp*vpp))
and chunk c lives on pp rank c % pp (megatron's interleaved assignment). Uneven first / last
stages (megatron's ``num_layers_in_first_pipeline_stage`` / ``..._last_...``) are supported
without VPP. Parameter names use global layer numbers, as megatron's checkpoints do.

Slicing rules (each names the megatron-core code it mirrors):

    qkv          linear_qkv rows = per query group g: [q heads of g; k_g; v_g]
                 (SelfAttention.get_query_key_value_tensors); tp splits the groups
    gated_column linear_fc1 = [gate_r; up_r] per tp rank (MLP with gated_linear_unit)
    column       ColumnParallelLinear: rows split contiguously over tp (MLA up projections)
    row          RowParallelLinear: input columns split over tp (linear_proj, linear_fc2)
    vocab        VocabParallelEmbedding / output_layer: rows of the padded vocab over tp;
                 rows >= vocab_size are padding, not canonical
    replicated   norms, router, MLA down projections: whole on every rank of the stage
    expert_*     SequentialMLP local expert j of ep rank q is expert q * E/ep + j;
                 etp splits fc1 as [gate_r; up_r] and fc2 on its input columns
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from reshard.families import CanonicalTensor, Placement, canonical_tensors
from reshard.layouts import LayoutBuilder, TensorLayout
from reshard.regions import Region, full_region, gc_paused, split_even

__all__ = [
    "MEGATRON_RULES",
    "PipelineSplit",
    "dense_rank",
    "expert_rank",
    "layer_stages",
    "megatron_layout",
]

Piece = tuple[Region, Region, tuple[int, ...], tuple]
"""(canonical box, param box, param shape, position); position: ("tp", r), ("stage",) or
("expert", etp_r, ep_r)."""


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """Uneven pipeline stages, as megatron-core's TransformerConfig fields of the same name."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on pp rank 0; None = an even share."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pp rank; None = an even share."""


def dense_rank(layout: ParallelLayout, *, tp: int, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """Global rank at these dense-grid coordinates (order tp-cp-ep-dp-pp, ep=1)."""
    return tp + layout.tp * (cp + layout.cp * (dp + layout.dp * pp))


def expert_rank(layout: ParallelLayout, *, etp: int, ep: int, edp: int = 0, pp: int = 0) -> int:
    """Global rank at these expert-grid coordinates (order tp-cp-ep-dp-pp with tp=etp, cp=1)."""
    return etp + layout.etp * (ep + layout.ep * (edp + layout.expert_dp * pp))


def _stage_sizes(model: ModelConfig, layout: ParallelLayout, split: PipelineSplit) -> list[int]:
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    fixed = {0: first, layout.pp - 1: last}
    fixed = {k: v for k, v in fixed.items() if v is not None}
    free = [p for p in range(layout.pp) if p not in fixed]
    rest = model.num_layers - sum(fixed.values())
    if rest < 0 or (free and rest % len(free)) or (not free and rest):
        raise ValueError(
            f"source pipeline split: num_layers_in_first_pipeline_stage={first} and "
            f"num_layers_in_last_pipeline_stage={last} leave {rest} of model.num_layers="
            f"{model.num_layers} layers for {len(free)} middle stages, which must divide evenly"
        )
    share = rest // len(free) if free else 0
    return [fixed.get(p, share) for p in range(layout.pp)]


def layer_stages(model: ModelConfig, layout: ParallelLayout, split: PipelineSplit = PipelineSplit()) -> tuple[int, ...]:
    """The pp rank holding each layer."""
    uneven = split.num_layers_in_first_pipeline_stage is not None or split.num_layers_in_last_pipeline_stage is not None
    if not uneven:
        per_chunk = model.num_layers // (layout.pp * layout.vpp)
        return tuple((layer // per_chunk) % layout.pp for layer in range(model.num_layers))
    if layout.vpp > 1:
        raise ValueError(
            f"source.vpp={layout.vpp} with an uneven pipeline split is not supported by the "
            f"reshard planner; set vpp=1 or drop num_layers_in_first/last_pipeline_stage"
        )
    sizes = _stage_sizes(model, layout, split)
    return tuple(p for p, n in enumerate(sizes) for _ in range(n))


# ---------------------------------------------------------------------------- rules


@dataclass(frozen=True, kw_only=True)
class _Ctx:
    model: ModelConfig
    layout: ParallelLayout
    padded_vocab: int


def _replicated(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    box = full_region(t.shape)
    return [(box, box, t.shape, ("stage",))]


def _qkv(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    m, tp = ctx.model, ctx.layout.tp
    d, groups = m.kv_channels, m.num_kv_heads
    q_per_group = m.num_attention_heads // groups
    rows = {"q": q_per_group * d, "k": d, "v": d}[pl.part]
    offset = {"q": 0, "k": q_per_group * d, "v": (q_per_group + 1) * d}[pl.part]
    stride = (q_per_group + 2) * d
    local_groups = groups // tp
    tail = tuple((0, n) for n in t.shape[1:])
    param_shape = (local_groups * stride,) + t.shape[1:]
    pieces = []
    for r in range(tp):
        for gl in range(local_groups):
            g = r * local_groups + gl
            box = ((g * rows, (g + 1) * rows),) + tail
            at = gl * stride + offset
            pieces.append((box, ((at, at + rows),) + tail, param_shape, ("tp", r)))
    return pieces


def _split_dim(
    t: CanonicalTensor,
    parts: int,
    dim: int,
    position: Callable[[int], tuple],
    param_offset: int = 0,
    param_rows: int = 0,
) -> list[Piece]:
    """Even contiguous split of ``dim`` into ``parts``; piece i goes to ``position(i)``."""
    return [(*_split_geometry(t.shape, parts, dim, i, param_offset, param_rows), position(i)) for i in range(parts)]


@functools.lru_cache(maxsize=4096)
def _split_geometry(
    shape: tuple[int, ...], parts: int, dim: int, i: int, offset: int, param_rows: int
) -> tuple[Region, Region, tuple[int, ...]]:
    """(box, param box, param shape) of piece i (memoised: thousands of experts share it)."""
    lo, hi = split_even(shape[dim], parts, i)
    box = tuple((lo, hi) if k == dim else (0, n) for k, n in enumerate(shape))
    param_box = tuple((offset, offset + hi - lo) if k == dim else (0, n) for k, n in enumerate(shape))
    param_shape = tuple((param_rows or hi - lo) if k == dim else n for k, n in enumerate(shape))
    return box, param_box, param_shape


def _column(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    return _split_dim(t, ctx.layout.tp, 0, lambda r: ("tp", r))


def _row(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    return _split_dim(t, ctx.layout.tp, 1, lambda r: ("tp", r))


def _gated(t: CanonicalTensor, pl: Placement, parts: int, position: Callable[[int], tuple]):
    local = t.shape[0] // parts
    offset = {"gate": 0, "up": local}[pl.part]
    return _split_dim(t, parts, 0, position, param_offset=offset, param_rows=2 * local)


def _gated_column(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    return _gated(t, pl, ctx.layout.tp, lambda r: ("tp", r))


def _vocab(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    tp, vocab = ctx.layout.tp, t.shape[0]
    per_rank = ctx.padded_vocab // tp
    pieces = []
    tail = tuple((0, n) for n in t.shape[1:])
    for r in range(tp):
        lo, hi = r * per_rank, min((r + 1) * per_rank, vocab)
        box = (((lo, hi),) + tail, ((0, hi - lo),) + tail) if lo < hi else (None, None)
        pieces.append((*box, (per_rank,) + t.shape[1:], ("tp", r)))  # None: only padding rows
    return pieces


def _expert_ep_rank(ctx: _Ctx, t: CanonicalTensor) -> int:
    return t.expert // (ctx.model.num_experts // ctx.layout.ep)


def _expert_gated_column(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    q = _expert_ep_rank(ctx, t)
    return _gated(t, pl, ctx.layout.etp, lambda r: ("expert", r, q))


def _expert_row(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    q = _expert_ep_rank(ctx, t)
    return _split_dim(t, ctx.layout.etp, 1, lambda r: ("expert", r, q))


MEGATRON_RULES: dict[str, Callable[[_Ctx, CanonicalTensor, Placement], list[Piece]]] = {
    "replicated": _replicated,
    "qkv": _qkv,
    "column": _column,
    "row": _row,
    "gated_column": _gated_column,
    "vocab": _vocab,
    "expert_gated_column": _expert_gated_column,
    "expert_row": _expert_row,
}
"""Megatron slicing rules by the name ``Placement.rule`` uses."""


# -------------------------------------------------------------------------- builder


class _Ranks:
    """Position + pipeline stage -> the sorted tuple of ranks holding it (memoised)."""

    def __init__(self, layout: ParallelLayout, builder: LayoutBuilder) -> None:
        self.layout, self.builder = layout, builder
        self._cache: dict[tuple, tuple[int, ...]] = {}

    def __call__(self, position: tuple, stage: int) -> tuple[int, ...]:
        key = (position, stage)
        if key not in self._cache:
            self._cache[key] = self.builder.intern(self._ranks(position, stage))
        return self._cache[key]

    def _ranks(self, position: tuple, stage: int) -> list[int]:
        lo = self.layout
        if position[0] == "stage":
            per_stage = lo.world_size // lo.pp
            return list(range(stage * per_stage, (stage + 1) * per_stage))
        if position[0] == "tp":
            return [dense_rank(lo, tp=position[1], cp=c, dp=d, pp=stage) for d in range(lo.dp) for c in range(lo.cp)]
        _, etp, ep = position
        return [expert_rank(lo, etp=etp, ep=ep, edp=e, pp=stage) for e in range(lo.expert_dp)]


def _stage_of(pl: Placement, t: CanonicalTensor, stages: tuple[int, ...], pp: int) -> Optional[int]:
    if pl.stage == "layer":
        return stages[t.layer]
    if pl.stage == "first":
        return 0
    if pl.stage == "last" or (pl.stage == "last_if_pipelined" and pp > 1):
        return pp - 1
    return None  # the tied output-layer copy does not exist without pipelining


def _param_name(pl: Placement, t: CanonicalTensor, ctx: _Ctx) -> str:
    if t.expert is None:
        return pl.param.format(layer=t.layer)
    local = t.expert % (ctx.model.num_experts // ctx.layout.ep)
    return pl.param.format(layer=t.layer, local=local)


def _check(model: ModelConfig, layout: ParallelLayout, split: PipelineSplit) -> None:
    uneven = split.num_layers_in_first_pipeline_stage is not None or split.num_layers_in_last_pipeline_stage is not None
    if uneven:
        # check_model's pp check assumes even stages; check the rest with a pp=1 twin
        ParallelLayout(tp=layout.tp, ep=layout.ep, etp=layout.etp, cp=layout.cp, dp=layout.dp * layout.pp).check_model(
            model, prefix="source"
        )
    else:
        layout.check_model(model, prefix="source")


def megatron_layout(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    dtype: str = "bfloat16",
    split: PipelineSplit = PipelineSplit(),
) -> TensorLayout:
    """Where every canonical tensor of ``model`` lives under megatron-core ``layout``."""
    _check(model, layout, split)
    with gc_paused():
        return _build(model, layout, dtype, split)


def _build(model: ModelConfig, layout: ParallelLayout, dtype: str, split: PipelineSplit) -> TensorLayout:
    tensors = canonical_tensors(model, dtype=dtype)
    ctx = _Ctx(model=model, layout=layout, padded_vocab=layout.padded_vocab_size(model))
    stages = layer_stages(model, layout, split)
    builder = LayoutBuilder(tensors)
    ranks = _Ranks(layout, builder)
    for t in tensors:
        for pl in t.spec.megatron:
            stage = _stage_of(pl, t, stages, layout.pp)
            if stage is None:
                continue
            param = _param_name(pl, t, ctx)
            for box, param_box, shape, position in MEGATRON_RULES[pl.rule](ctx, t, pl):
                builder.add(t.name, box, param, param_box, shape, ranks(position, stage))
    return builder.build(
        side="megatron", description=_describe(layout, split), model=model, dtype=dtype, num_ranks=layout.world_size
    )


def _describe(layout: ParallelLayout, split: PipelineSplit) -> str:
    text = (
        f"megatron tp={layout.tp} pp={layout.pp} vpp={layout.vpp} ep={layout.ep} "
        f"etp={layout.etp} cp={layout.cp} dp={layout.dp} ({layout.world_size} ranks)"
    )
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        text += f" stages first={first} last={last}"
    return text
