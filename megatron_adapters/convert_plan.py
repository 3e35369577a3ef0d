"""A megatron-core dist checkpoint described as row ranges of Hugging Face tensors (pure).

```
ModelConfig ── reshard.megatron_layout(tp=1) ──► every megatron parameter (global layer names)
               and the HF row ranges it is made of: linear_qkv = per query group [q_g; k_g; v_g],
               linear_fc1 = [gate; up], experts by global index (reshard.families, one mapping)
param name ─── dist_key() ──► checkpoint key + leading stacked axes, as megatron-core's
               sharded_state_dict names it (layers stacked in dense models, experts stacked in
               MoE layers, the local layer spec's norm renames)
slab rows ──── split at chunk_bytes ──► Chunk(key, offsets, sizes, pieces)
```

A slab is one parameter of one (layer, expert): one box of its checkpoint key. A chunk is a row
range of a slab: the unit both converters move. ``hf_to_mcore`` fills each chunk from HF rows
and stores it as one tensor of the dist checkpoint; ``mcore_to_hf`` reads each chunk's box back
(torch.distributed.checkpoint reshards whatever chunks the checkpoint holds: a training run's
TP / EP shards read the same way) and scatters its rows to the HF tensors. At TP=1 every piece
is a full-width row range of its HF tensor and of its parameter, which is what makes row chunks
enough; ``plan_slabs`` checks it.

The key rules mirror megatron-core 0.16.1 for the models ``megatron_adapters.model`` builds with
megatron's local layer spec (``TransformerBlock.sharded_state_dict``: layers get their own keys
when ``moe_layer_freq`` is a list, which ``model._moe_fields`` sets for every MoE model, and are
stacked on a leading axis otherwise; ``SequentialMLP.sharded_state_dict``: experts stacked on a
leading axis under ``experts.experts``; ``ColumnParallelLinear`` / ``RowParallelLinear`` save an
``_extra_state`` object). The converter tests compare the keys and shapes with a checkpoint that
megatron-core itself saves.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from reshard.families import canonical_tensors
from reshard.layouts import Shard
from reshard.megatron import megatron_layout

__all__ = [
    "Chunk",
    "CheckpointPlan",
    "Piece",
    "Slab",
    "dist_key",
    "extra_state_key",
    "plan_checkpoint",
    "plan_slabs",
]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_EXTRA_STATE_MODULES = frozenset(
    {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
        "linear_q_proj",
        "linear_q_up_proj",
        "linear_kv_up_proj",
    }
)
"""Modules megatron builds as Column/RowParallelLinear (they save ``_extra_state``); MLA's down
projections are replicated ``Linear`` modules and save none."""

Rows = tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Rows ``rows`` of HF tensor ``tensor`` lie at rows ``at``.. of the enclosing slab / chunk."""

    tensor: str
    """Hugging Face tensor name."""
    rows: Rows
    """Half-open row range of the HF tensor (dim 0; a 1-D tensor's elements)."""
    at: int
    """First row inside the slab or chunk."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Slab:
    """One megatron parameter of one (layer, expert): one box of a checkpoint key."""

    param: str
    """megatron parameter name (global layer number, global expert index)."""
    key: str
    """Checkpoint key (``decoder.layers.mlp.linear_fc1.weight`` in a dense model)."""
    prefix: tuple[int, ...]
    """Index along the key's stacked leading axes (layer, or expert); () when none."""
    prefix_shape: tuple[int, ...]
    """Extent of those axes (num_layers, or num_experts)."""
    shape: tuple[int, ...]
    """The parameter's full shape (TP=1; vocab rows padded)."""
    pieces: tuple[Piece, ...]
    """Where its rows come from; rows not covered are vocabulary padding."""

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the checkpoint key."""
        return self.prefix_shape + self.shape


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """A row range of a slab: one stored tensor of the dist checkpoint."""

    key: str
    """Checkpoint key."""
    offsets: tuple[int, ...]
    """Offset of the box in the key's global tensor."""
    sizes: tuple[int, ...]
    """Extent of the box (leading stacked axes have extent 1)."""
    pieces: tuple[Piece, ...]
    """HF rows inside the chunk (``at`` relative to the chunk's first row)."""
    lead: int
    """Number of stacked leading axes (0 or 1)."""

    @property
    def rows(self) -> int:
        """Rows of the parameter the chunk covers."""
        return self.sizes[self.lead]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (() for 1-D parameters)."""
        return self.sizes[self.lead + 1 :]

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The chunk as a tensor without its stacked axes."""
        return self.sizes[self.lead :]


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """Everything a dist checkpoint of ``model`` holds, as chunks of HF rows."""

    model: ModelConfig
    """The model."""
    padded_vocab: int
    """Rows of the embedding / output layer (megatron pads the vocabulary for TP)."""
    tensors: Mapping[str, tuple[int, ...]]
    """Every HF tensor of the model and its shape, in checkpoint order."""
    keys: Mapping[str, tuple[int, ...]]
    """Every checkpoint tensor key and its global shape."""
    key_tensors: Mapping[str, tuple[str, ...]]
    """The HF tensors stored under each key."""
    extra_states: tuple[str, ...]
    """Keys of the ``_extra_state`` objects megatron saves beside the tensors."""
    chunks: tuple[Chunk, ...]
    """Stored boxes, in HF checkpoint order (layer by layer)."""


def dist_key(
    param: str, model: ModelConfig, renames: Mapping[str, str]
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(checkpoint key, index on the stacked axes, their extents) of a megatron parameter.

    ``renames`` is the layer spec's ``sharded_state_dict_keys_map`` (local spec: the norms are
    saved under the names TransformerEngine's fused modules use).
    """
    match = _LAYER.match(param)
    if match is None:
        return param, (), ()
    layer, rest = int(match.group(1)), match.group(2)
    for old, new in renames.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    expert = _EXPERT.match(rest)
    if expert is not None:
        key = f"decoder.layers.{layer}.mlp.experts.experts.{expert.group(2)}"
        return key, (int(expert.group(1)),), (model.num_experts,)
    if not model.is_moe:
        return f"decoder.layers.{rest}", (layer,), (model.num_layers,)
    return f"decoder.layers.{layer}.{rest}", (), ()


def extra_state_key(key: str, prefix: tuple[int, ...], prefix_shape: tuple[int, ...]) -> str | None:
    """The ``_extra_state`` object key of the module owning checkpoint key ``key``, if it has one."""
    module, _, attribute = key.rpartition(".")
    if attribute not in ("weight", "bias") or module.rpartition(".")[2] not in _EXTRA_STATE_MODULES:
        return None
    offsets = ".".join(map(str, prefix or (0,)))
    extents = ".".join(map(str, prefix_shape or (1,)))
    return f"{module}._extra_state/shard_{offsets}_{extents}"


# ------------------------------------------------------------------------------- slabs


def _vocab_params(model: ModelConfig) -> set[str]:
    return {pl.param for t in canonical_tensors(model) for pl in t.spec.megatron if pl.rule == "vocab"}


def _row_piece(shard: Shard, param_shape: tuple[int, ...]) -> Piece:
    """The shard as a row range; its trailing dims must be whole (true at TP=1)."""
    (a, b), *tail = shard.region
    (p, _), *param_tail = shard.param_region
    if tail != [(0, n) for n in param_shape[1:]] or tail != param_tail:
        raise AssertionError(f"{shard.tensor} -> {shard.param}: not a full-width row range")
    return Piece(tensor=shard.tensor, rows=(a, b), at=p)


def plan_slabs(model: ModelConfig, renames: Mapping[str, str], padded_vocab: int) -> list[Slab]:
    """Every (parameter, layer / expert) slab of ``model``, layer by layer."""
    layout = megatron_layout(model, ParallelLayout(), dtype="float32")
    shapes = {p.name: p.shape for p in layout.params}
    for name in _vocab_params(model) & set(shapes):
        shapes[name] = (padded_vocab,) + shapes[name][1:]
    pieces: dict[str, list[Piece]] = {name: [] for name in shapes}
    for shards in layout.shards.values():
        for shard in shards:
            pieces[shard.param].append(_row_piece(shard, shapes[shard.param]))
    slabs = []
    for name, shape in shapes.items():
        key, prefix, prefix_shape = dist_key(name, model, renames)
        slabs.append(
            Slab(
                param=name,
                key=key,
                prefix=prefix,
                prefix_shape=prefix_shape,
                shape=shape,
                pieces=tuple(sorted(pieces[name], key=lambda p: p.at)),
            )
        )
    return sorted(slabs, key=_checkpoint_order)


def _checkpoint_order(slab: Slab) -> tuple[int, int]:
    """Embedding first, then layer by layer, then final norm and output layer."""
    match = _LAYER.match(slab.param)
    if match:
        return 1, int(match.group(1))
    return (0, 0) if slab.param.startswith("embedding.") else (2, 0)


# ------------------------------------------------------------------------------ chunks


def _chunk_rows(slab: Slab, itemsize: int, chunk_bytes: int) -> int:
    row_bytes = math.prod(slab.shape[1:]) * itemsize
    return max(1, min(slab.shape[0], chunk_bytes // max(row_bytes, 1)))


def _split(slab: Slab, rows_per_chunk: int) -> list[Chunk]:
    chunks = []
    lead = len(slab.prefix)
    for start in range(0, slab.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, slab.shape[0])
        inside = []
        for piece in slab.pieces:
            lo, hi = max(start, piece.at), min(stop, piece.at + piece.rows[1] - piece.rows[0])
            if lo < hi:
                first = piece.rows[0] + lo - piece.at
                inside.append(Piece(tensor=piece.tensor, rows=(first, first + hi - lo), at=lo - start))
        offsets = slab.prefix + (start,) + (0,) * (len(slab.shape) - 1)
        sizes = (1,) * lead + (stop - start,) + slab.shape[1:]
        chunks.append(Chunk(key=slab.key, offsets=offsets, sizes=sizes, pieces=tuple(inside), lead=lead))
    return chunks


def plan_checkpoint(
    model: ModelConfig,
    *,
    renames: Mapping[str, str],
    padded_vocab: int,
    itemsize: Callable[[Slab], int],
    chunk_bytes: int,
) -> CheckpointPlan:
    """The chunked checkpoint of ``model``; ``itemsize(slab)`` gives its bytes per element."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
    if padded_vocab < model.vocab_size:
        raise ValueError(f"padded_vocab={padded_vocab} is below model.vocab_size={model.vocab_size}")
    slabs = plan_slabs(model, renames, padded_vocab)
    keys: dict[str, tuple[int, ...]] = {}
    key_tensors: dict[str, dict[str, None]] = {}
    extra: dict[str, None] = {}
    chunks: list[Chunk] = []
    for slab in slabs:
        if keys.setdefault(slab.key, slab.global_shape) != slab.global_shape:
            raise AssertionError(f"{slab.key}: slabs disagree on the global shape")
        key_tensors.setdefault(slab.key, {}).update(dict.fromkeys(p.tensor for p in slab.pieces))
        state = extra_state_key(slab.key, slab.prefix, slab.prefix_shape)
        if state is not None:
            extra[state] = None
        chunks.extend(_split(slab, _chunk_rows(slab, itemsize(slab), chunk_bytes)))
    order = {p.tensor: None for c in chunks for p in c.pieces}
    shapes = {t.name: t.shape for t in canonical_tensors(model)}
    _check_coverage(chunks, shapes)
    return CheckpointPlan(
        model=model,
        padded_vocab=padded_vocab,
        tensors={n: shapes[n] for n in order},
        keys=keys,
        key_tensors={k: tuple(v) for k, v in key_tensors.items()},
        extra_states=tuple(extra),
        chunks=tuple(chunks),
    )


def _check_coverage(chunks: list[Chunk], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every row of every HF tensor lands in exactly one chunk (an invariant of the mapping)."""
    covered = dict.fromkeys(shapes, 0)
    for chunk in chunks:
        for piece in chunk.pieces:
            covered[piece.tensor] += piece.rows[1] - piece.rows[0]
    wrong = {n: (covered[n], s[0]) for n, s in shapes.items() if covered[n] != s[0]}
    if wrong:
        raise AssertionError(f"rows covered vs rows held: {dict(list(wrong.items())[:5])}")
