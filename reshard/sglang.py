"""The SGLang side: which boxes of which canonical tensors each SGLang rank's parameters need.

    ModelConfig + SGLangSettings
        -> canonical tensors (reshard.families)
        -> per tensor: rule(tensor) -> pieces (box, param box, position)   [one engine]
        -> position -> local ranks of one engine -> global ranks of every replica
        -> TensorLayout(side="sglang")

Ranks are numbered engine-major: global rank = replica * tp + local rank. Inside one engine of
``tp`` ranks (sglang ``initialize_model_parallel``, attn_cp = 1):

    attention tp    attn_tp = tp / dp_size (dp_size = 1 without DP attention)
                    attn_tp_rank = local % attn_tp, attn_dp_rank = local // attn_tp
    MoE             moe_tp = tp / ep / moe_dp (runtime_context.derive_parallel_widths)
                    moe_tp_rank = local % moe_tp, moe_ep_rank = (local // moe_tp) % ep,
                    moe_dp_rank = local // (moe_tp * ep)

Each rule names the SGLang 0.5.23 loader it mirrors. The boxes are logical: backend padding of
parameters (the CPU FusedMoE pads the per-rank expert intermediate size; vocab padding rows)
is left to the executor, which zero-fills what no box covers. Parameter shapes are the
unpadded ones, except vocab rows, which SGLang itself pads.

Parameters SGLang's model class of a family holds beyond the registry's tensors are refused
by ``check_settings`` rather than left unwritten: a separate LM head of a tied model
(``FamilySpec.tied_head``), DeepSeek's gate bias on a model without one (``gate_bias``), EPLB
slots a family's MoE does not allocate (``redundant_experts``); flags a family's architecture
fixes (Llama's o_proj bias, Qwen3-MoE's q/k norms, dense layers ...) are refused by
``ModelConfig`` (``hfschema.model.FAMILY_FIXED``).

Not modelled (SGLang options that change layouts): pipeline parallelism, attention context
parallelism (and with it MoE DP, which SGLang 0.5.23 runs only alongside it: ``SGLangSettings``
refuses moe_dp > 1), ``moe_dense_tp_size=1``, quantised weights. GPU-only layout choices are pinned off
when the engine starts (``hybridflow.rollout.sglang.engine.GPU_LAYOUT_PINS``, refused if
overridden): shared-expert fusion into FusedMoE (DeepSeek-V3, sm80+, ep=1), MoE runner backends
that reorder, transpose or block-permute ``w13`` / ``w2`` (flashinfer_cutlass, triton_kernel,
flashinfer_trtllm), DeepEP-class all-to-all (replicated shared experts), EPLB redundant experts;
and the environment switches that re-lay parameters (``GPU_LAYOUT_ENV``: interleaved SwiGLU rows,
tp=1 shared experts, embedding replication) are refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from hfschema.layout import divisors
from hfschema.model import UNMAPPED_FAMILY, ModelConfig
from hfschema.sglang import SGLangSettings, pad_vocab
from reshard.families import CanonicalTensor, Placement, canonical_tensors, family_spec
from reshard.layouts import LayoutBuilder, TensorLayout
from reshard.regions import Region, full_region, gc_paused, split_even

__all__ = ["SGLANG_RULES", "build_layout", "check_settings", "sglang_layout"]

Piece = tuple[Region, Region, tuple[int, ...], tuple]
"""(canonical box, param box, param shape, position); position: (axis, index), ("all",) or
("moe", moe_tp_rank, moe_ep_rank)."""


# ---------------------------------------------------------------------- validation


def _valid_tps(model: ModelConfig, s: SGLangSettings) -> list[int]:
    ok = []
    for a in divisors(model.num_attention_heads):
        kv = model.num_kv_heads
        if model.is_mla or (a % kv == 0 if a >= kv else kv % a == 0):
            ok.append(a * s.dp_size)
    return ok


def _check_attention(model: ModelConfig, s: SGLangSettings) -> None:
    a, heads, kv = s.attn_tp, model.num_attention_heads, model.num_kv_heads
    bad = heads % a or (not model.is_mla and (a % kv if a >= kv else kv % a))
    if bad:
        kv_text = "" if model.is_mla else f" and model.num_kv_heads={kv}"
        raise ValueError(
            f"sglang.tp={s.tp} gives attention tp {a} (tp / dp_size={s.dp_size}), which does not "
            f"split model.num_attention_heads={heads}{kv_text} (QKVParallelLinear needs heads % "
            f"attn_tp == 0 and kv heads divisible by, or dividing, attn_tp); valid sglang.tp "
            f"values: {', '.join(str(v) for v in _valid_tps(model, s))}"
        )


def _check_ffn(model: ModelConfig, s: SGLangSettings) -> None:
    sizes = {}
    if not model.is_moe or model.first_k_dense_layers:
        sizes["model.ffn_hidden_size"] = (model.ffn_hidden_size, s.tp, "sglang.tp")
    if model.is_moe:
        sizes["model.moe_ffn_hidden_size"] = (model.moe_ffn_hidden_size, s.moe_tp, "moe_tp = sglang.tp/ep/moe_dp")
    if model.is_moe and model.num_shared_experts:
        sizes["model.moe_ffn_hidden_size*num_shared_experts"] = (
            model.moe_ffn_hidden_size * model.num_shared_experts,
            s.tp,
            "sglang.tp",
        )
    for key, (size, parts, what) in sizes.items():
        if size % parts:
            raise ValueError(f"{what}={parts} does not divide {key}={size}")


def _physical_rows(model: ModelConfig, s: SGLangSettings) -> list[tuple[int, ...]]:
    """One physical -> logical row per layer (identity when no EPLB map is given)."""
    rows = s.physical_to_logical or (tuple(range(model.num_experts)),)
    if len(rows) not in (1, model.num_layers):
        raise ValueError(
            f"sglang.physical_to_logical has {len(rows)} rows; give 1 (all layers) or "
            f"model.num_layers={model.num_layers}"
        )
    return list(rows) * model.num_layers if len(rows) == 1 else list(rows)


def _check_experts(model: ModelConfig, s: SGLangSettings) -> None:
    if not model.is_moe:
        if s.ep > 1 or s.physical_to_logical:
            raise ValueError("sglang.ep > 1 and sglang.physical_to_logical need an MoE model")
        return
    rows = _physical_rows(model, s)
    physical = len(rows[0])
    if physical > model.num_experts and not family_spec(model).redundant_experts:
        raise ValueError(
            f"sglang.physical_to_logical has {physical} physical experts for "
            f"model.num_experts={model.num_experts}: SGLang's {model.family} MoE allocates no "
            f"redundant expert slots; give rows of exactly {model.num_experts} entries"
        )
    if physical % s.ep:
        raise ValueError(
            f"sglang.ep={s.ep} does not divide the {physical} physical experts "
            f"(model.num_experts={model.num_experts} + redundant); valid ep values: "
            f"{', '.join(str(d) for d in divisors(physical) if s.tp % (d * s.moe_dp) == 0)}"
        )
    for layer, row in enumerate(rows):
        if (
            len(row) != physical
            or not set(range(model.num_experts)) <= set(row)
            or not all(0 <= e < model.num_experts for e in row)
        ):
            raise ValueError(
                f"sglang.physical_to_logical row {layer} must have {physical} entries in "
                f"0..{model.num_experts - 1} covering every logical expert"
            )


def _check_model_class(model: ModelConfig) -> None:
    """Refuse models for which SGLang's model class holds a parameter the plan would not write."""
    if model.family == UNMAPPED_FAMILY:
        return  # the full route hands SGLang's own loader the checkpoint's tensors, whatever it builds
    spec = family_spec(model)
    if model.tie_word_embeddings and not spec.tied_head:
        raise ValueError(
            f"model.tie_word_embeddings=true: SGLang's {model.family} model builds its own "
            f"lm_head.weight and never copies the embedding into it, so the engine would keep an "
            f"unwritten LM head; set model.tie_word_embeddings=false"
        )
    if spec.gate_bias and model.is_moe and not model.router_expert_bias:
        raise ValueError(
            f"model.router_expert_bias=false: SGLang's {model.family} gate always holds "
            f"e_score_correction_bias, which the plan would leave unwritten; set "
            f"model.router_expert_bias=true (with model.router_score_function=sigmoid)"
        )


def check_settings(model: ModelConfig, s: SGLangSettings) -> None:
    """Raise ValueError (naming the key and the fix) if SGLang cannot shard ``model`` so."""
    _check_model_class(model)
    if s.enable_dp_attention and (model.family == UNMAPPED_FAMILY or not family_spec(model).dp_attention):
        raise ValueError(
            f"sglang.enable_dp_attention=true: SGLang builds {model.family} attention over the "
            f"full tp group; use a family with DP attention (qwen3_moe, deepseek_v3) or turn it off"
        )
    _check_attention(model, s)
    _check_ffn(model, s)
    _check_experts(model, s)


# ---------------------------------------------------------------------------- rules


@dataclass(frozen=True, kw_only=True)
class _Ctx:
    model: ModelConfig
    settings: SGLangSettings
    slots: dict[int, dict[int, tuple[int, ...]]]
    """layer -> logical expert -> physical slots."""
    num_physical: int

    def axis_size(self, axis: str) -> int:
        return _axis_size(self.settings, axis)


def _axis_size(s: SGLangSettings, axis: str) -> int:
    """Ranks splitting a tensor placed on ``axis``: the LM head follows --enable-dp-lm-head."""
    return {"tp": s.tp, "attn_tp": s.attn_tp, "lm_head": s.attn_tp if s.enable_dp_lm_head else s.tp}[axis]


def _replicated(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # ReplicatedLinear / RMSNorm / MoEGate: every rank loads the whole tensor
    box = full_region(t.shape)
    return [(box, box, t.shape, ("all",))]


def _replicated_rows(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # DeepseekV2WeightLoaderMixin: fused_qkv_a_proj_with_mqa = cat([q_a_proj, kv_a_proj_with_mqa])
    m = ctx.model
    at = {"q_a": 0, "kv_a": m.q_lora_rank}[pl.part]
    rows = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
    box = full_region(t.shape)
    return [(box, ((at, at + t.shape[0]), (0, t.shape[1])), (rows, t.shape[1]), ("all",))]


def _qkv_rows(m: ModelConfig, a: int, i: int, part: str) -> tuple[int, int, int, int]:
    """(canonical start, rows, param offset, param rows) of rank i's part of q / k / v."""
    d, heads, kv = m.kv_channels, m.num_attention_heads, m.num_kv_heads
    local_q = heads // a
    local_kv = 1 if a >= kv else kv // a
    # QKVParallelLinear.weight_loader: q shard = tp_rank, kv shard = tp_rank // replicas
    kv_shard = i // (a // kv) if a >= kv else i
    start = {"q": i * local_q, "k": kv_shard * local_kv, "v": kv_shard * local_kv}[part]
    count = local_q if part == "q" else local_kv
    offset = {"q": 0, "k": local_q, "v": local_q + local_kv}[part]
    return start * d, count * d, offset * d, (local_q + 2 * local_kv) * d


def _qkv(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    a = ctx.axis_size(pl.axis)
    tail = tuple((0, n) for n in t.shape[1:])
    pieces = []
    for i in range(a):
        start, rows, at, total = _qkv_rows(ctx.model, a, i, pl.part)
        pieces.append(
            (((start, start + rows),) + tail, ((at, at + rows),) + tail, (total,) + t.shape[1:], (pl.axis, i))
        )
    return pieces


@functools.lru_cache(maxsize=4096)
def _split_dim(
    shape: tuple[int, ...], parts: int, dim: int, i: int, offset: int = 0, param_extent: int = 0
) -> tuple[Region, Region, tuple[int, ...]]:
    """(box, param box, param shape) of piece i of ``parts`` along ``dim`` (memoised: thousands
    of experts share one geometry)."""
    lo, hi = split_even(shape[dim], parts, i)
    box = tuple((lo, hi) if k == dim else (0, n) for k, n in enumerate(shape))
    param_box = tuple((offset, offset + hi - lo) if k == dim else (0, n) for k, n in enumerate(shape))
    param_shape = tuple((param_extent or hi - lo) if k == dim else n for k, n in enumerate(shape))
    return box, param_box, param_shape


def _column(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # ColumnParallelLinear.weight_loader: narrow(output_dim, tp_rank * shard_size, shard_size)
    a = ctx.axis_size(pl.axis)
    return [(*_split_dim(t.shape, a, 0, i), (pl.axis, i)) for i in range(a)]


def _row(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # RowParallelLinear.weight_loader: narrow(input_dim, tp_rank * shard_size, shard_size)
    a = ctx.axis_size(pl.axis)
    return [(*_split_dim(t.shape, a, 1, i), (pl.axis, i)) for i in range(a)]


def _gated_column(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # MergedColumnParallelLinear.weight_loader: shard_offset = sum(output_sizes[:id]) // tp
    a = ctx.axis_size(pl.axis)
    local = t.shape[0] // a
    at = {"gate": 0, "up": local}[pl.part]
    return [(*_split_dim(t.shape, a, 0, i, at, 2 * local), (pl.axis, i)) for i in range(a)]


def _vocab(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # VocabParallelEmbedding._get_indices / weight_loader: contiguous rows of the padded vocab;
    # rows past vocab_size are zero-filled by the loader, not loaded
    a = ctx.axis_size(pl.axis)
    vocab, hidden = t.shape
    per_rank = pad_vocab(vocab, a) // a
    pieces = []
    for i in range(a):
        lo, hi = i * per_rank, min((i + 1) * per_rank, vocab)
        box = (((lo, hi), (0, hidden)), ((0, hi - lo), (0, hidden))) if lo < hi else (None, None)
        pieces.append((*box, (per_rank, hidden), (pl.axis, i)))  # None: only padding rows
    return pieces


def _expert_pieces(ctx: _Ctx, t: CanonicalTensor, box_of: Callable[[int], tuple]) -> list[Piece]:
    """One piece per physical slot of the expert x moe_tp rank (FusedMoE.weight_loader)."""
    s = ctx.settings
    per_rank = ctx.num_physical // s.ep
    pieces = []
    for slot in ctx.slots[t.layer][t.expert]:
        q, j = divmod(slot, per_rank)  # _map_global_expert_id_to_local_expert_id
        for mt in range(s.moe_tp):
            box, param_box, shape = box_of(mt)
            pieces.append((box, ((j, j + 1),) + param_box, (per_rank,) + shape, ("moe", mt, q)))
    return pieces


def _expert_w13(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # FusedMoE._load_w13: w1 (gate) into the first half, w3 (up) into the second half of
    # w13_weight[local, 2 * I / moe_tp, H], rows narrowed at moe_tp_rank * shard_size
    mt_size = ctx.settings.moe_tp
    local = t.shape[0] // mt_size
    at = {"gate": 0, "up": local}[pl.part]
    return _expert_pieces(ctx, t, lambda mt: _split_dim(t.shape, mt_size, 0, mt, at, 2 * local))


def _expert_w2(ctx: _Ctx, t: CanonicalTensor, pl: Placement) -> list[Piece]:
    # FusedMoE._load_w2: w2_weight[local, H, I / moe_tp], input dim narrowed at moe_tp_rank
    mt_size = ctx.settings.moe_tp
    return _expert_pieces(ctx, t, lambda mt: _split_dim(t.shape, mt_size, 1, mt))


SGLANG_RULES: dict[str, Callable[[_Ctx, CanonicalTensor, Placement], list[Piece]]] = {
    "replicated": _replicated,
    "replicated_rows": _replicated_rows,
    "qkv": _qkv,
    "column": _column,
    "row": _row,
    "gated_column": _gated_column,
    "vocab": _vocab,
    "expert_w13": _expert_w13,
    "expert_w2": _expert_w2,
}
"""SGLang slicing rules by the name ``Placement.rule`` uses."""


# -------------------------------------------------------------------------- builder


class _Ranks:
    """Position -> sorted global ranks needing it, over all replicas (memoised)."""

    def __init__(self, s: SGLangSettings, builder: LayoutBuilder) -> None:
        self.s, self.builder = s, builder
        self._cache: dict[tuple, tuple[int, ...]] = {}

    def __call__(self, position: tuple) -> tuple[int, ...]:
        if position not in self._cache:
            local = self._local(position)
            self._cache[position] = self.builder.intern(
                rep * self.s.tp + r for rep in range(self.s.num_replicas) for r in local
            )
        return self._cache[position]

    def _local(self, position: tuple) -> list[int]:
        s = self.s
        if position[0] == "all":
            return list(range(s.tp))
        if position[0] == "moe":
            _, mt, q = position
            return [mt + s.moe_tp * (q + s.ep * k) for k in range(s.moe_dp)]
        axis, i = position
        size = _axis_size(s, axis)  # attention-TP rank = local % attn_tp
        return [r for r in range(s.tp) if r % size == i]


def _slot_maps(model: ModelConfig, s: SGLangSettings) -> tuple[dict, int]:
    if not model.is_moe:
        return {}, 0
    rows = _physical_rows(model, s)
    inverse: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {}
    for row in set(rows):
        slots: dict[int, list[int]] = {}
        for p, e in enumerate(row):
            slots.setdefault(e, []).append(p)
        inverse[row] = {e: tuple(p) for e, p in slots.items()}
    return {layer: inverse[row] for layer, row in enumerate(rows)}, len(rows[0])


def sglang_layout(model: ModelConfig, settings: SGLangSettings, *, dtype: str = "bfloat16") -> TensorLayout:
    """Which box of every canonical tensor each SGLang rank needs, and where it lands."""
    return build_layout(model, settings, dtype=dtype, engine="SGLang", side="sglang")


def build_layout(
    model: ModelConfig,
    settings: SGLangSettings,
    *,
    dtype: str,
    engine: str,
    side: str,
    rename: Callable[[str], str] = str,
) -> TensorLayout:
    """SGLang's rules for an engine that cuts and fuses as SGLang does (``reshard.vllm``): its
    parameters named by ``rename`` of SGLang's; ``engine`` names it in messages."""
    check_settings(model, settings)
    if model.family == UNMAPPED_FAMILY:
        raise ValueError(
            f"model.family={UNMAPPED_FAMILY} (a model_type no family maps): how {engine}'s model class fuses and "
            "splits its tensors is not described, so each engine rank's share cannot be planned; set "
            f"rollout.sync_route=full (whole tensors, which {engine}'s own loader splits)"
        )
    with gc_paused():
        return _build(model, settings, dtype, side=side, rename=rename)


def _build(
    model: ModelConfig, settings: SGLangSettings, dtype: str, *, side: str, rename: Callable[[str], str]
) -> TensorLayout:
    tensors = canonical_tensors(model, dtype=dtype)
    slots, num_physical = _slot_maps(model, settings)
    ctx = _Ctx(model=model, settings=settings, slots=slots, num_physical=num_physical)
    builder = LayoutBuilder(tensors)
    ranks = _Ranks(settings, builder)
    for t in tensors:
        pl = t.spec.sglang
        param = rename(pl.param.format(layer=t.layer))
        for box, param_box, shape, position in SGLANG_RULES[pl.rule](ctx, t, pl):
            builder.add(t.name, box, param, param_box, shape, ranks(position))
    return builder.build(
        side=side, description=settings.describe(side), model=model, dtype=dtype, num_ranks=settings.num_ranks
    )
