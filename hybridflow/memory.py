"""Per-GPU memory of a run, estimated from shapes: pure arithmetic, no torch, no CUDA.

    cfg.model ──► param_split()   parameters of each layer by how they are sharded
                      │
    role layout ──────┼──► training_components(cfg, role)   params, grads, optimizer,
                      │      (heaviest pipeline stage)        activations, logits
    cfg.rollout ──────┴──► engine_components(cfg)           weights, KV cache, margin
                                         │
    roles on one pool ──► pool_memory(cfg, roles) ──► MemoryEstimate
                                                       phase -> component -> bytes, peak

Phases. A pool holding only trained roles has one phase, ``training``; a pool holding only
rollout engines has ``generation``. A colocated pool (3D-HybridEngine) switches between
them as the plan's switches move memory (``hybridflow.lowering.switch``): in ``generation``
the engine's weights and KV cache are resident next to every model role's parameters (actor,
reference, critic), while the actor's and critic's grads and optimizer state are on the host;
in ``training`` the engine has released its weights and KV cache and every role is fully
resident (under ``lora.push=adapter`` the engine keeps its weights, the frozen base:
``engine_keeps_weights``). The reported peak is the larger phase.

Formulas (bytes per GPU; ``T = micro_batch_size * (max_prompt_length + max_response_length)
/ cp`` tokens per micro-batch; ``Vp`` megatron's padded vocab):

- parameters, bf16 (2 B): dense parameters (attention, embeddings, norms, router, dense MLP,
  shared experts) / tp, routed experts / (ep * etp), each of the rank's own layers (pp and vpp
  chunks; megatron splits layers evenly). Norms, the router and MLA's down-projections are
  replicated over tp. The embedding is on the first stage, the LM head and final norm on the
  last (a tied embedding keeps a copy there when pp > 1).
- gradients, fp32 (4 B/param): megatron's DDP main-grad buffer, whole on every rank (the
  distributed optimizer reduce-scatters into it, it does not shrink it).
- optimizer: Adam keeps an fp32 master copy and two fp32 moments, 12 B/param; SGD an fp32
  master and momentum, 8 B/param. With the distributed optimizer, dense state is sharded over
  dp * cp and expert state over expert_dp.
- activations (bf16, sequence parallel so most tensors / tp), stored per token and layer:
  attention ``2h + q + k + v + o_in`` / tp (flash attention keeps no scores) plus MLA's latents
  ``q_lora + kv_lora + rope`` (not split); dense MLP ``2h + 3 ffn`` / tp; MoE ``h + 2E`` / tp
  (norm input, fp32 router logits) plus ``top_k * (etp * h + 3 moe_ffn) / tp`` for routed token
  copies under balanced routing, plus ``h + 3 shared_ffn`` / tp for shared experts. With full
  recomputation (the default) a layer keeps only its input, ``h / tp``, and one layer's full
  set is live while it is recomputed. 1F1B keeps ``pp - stage`` micro-batches in flight
  (interleaved: ``2 (pp - stage - 1) + (vpp - 1) pp + 1`` chunks of ``L / (pp vpp)`` layers).
- logits (last stage): two fp32 copies of ``[T, Vp / tp]``, the shifted logits the log-probs
  and entropy are computed from (kept for the entropy's gradient) and the probabilities
  (``megatron_adapters/logprobs.py``). The critic's value head has one column instead of Vp.
- LoRA (``lora.enabled``, the actor): the adapters' parameters beside the frozen base; gradients
  and optimizer state for the adapters only (column layers: A whole, B / tp; row layers: A / tp,
  B whole; routed experts' adapters / (ep * etp)).
- reference: bf16 parameters only (its forward holds one layer at a time).
- frozen models (a reward model, a distillation teacher): bf16 parameters of their own
  architecture under their layout (their own or the actor's), a score head's one row or the padded vocabulary; with
  ``<section>.offload`` a frozen model's (reference, reward model, teacher) are on the host in
  generation.
- rollout engine rank, weights in ``rollout.dtype``: attention / attn_tp (attn_tp = tp /
  dp_size with DP attention; MLA down-projections replicated), embedding / attn_tp, LM head,
  dense MLP and shared experts / tp, routed experts / (ep * moe_tp), everything on every rank
  (no pp). KV cache: ``max_total_tokens * layers * per-token-per-layer`` with GQA
  ``2 * max(1, kv_heads / attn_tp) * head_dim`` elements (kv heads are replicated when
  attn_tp > kv_heads) and MLA ``kv_lora_rank + qk_rope_head_dim`` (one latent, not split).
  Plus a fixed ``ENGINE_MARGIN_BYTES`` for CUDA-graph pools and forward activations, which
  SGLang keeps outside its static pool (the room ``mem_fraction_static`` leaves).

Not counted: the CUDA context, NCCL buffers, allocator fragmentation, the bucketed buffers of
the weight sync, and host memory. Each role is accounted at its heaviest pipeline stage, and
colocated roles' activations are summed although they are live at different times: the
estimate errs high.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from hfschema.engines import ENGINES, resolve
from hfschema.layout import ParallelLayout
from hfschema.lora import adapter_params_per_rank
from hfschema.model import ModelConfig
from hfschema.trainer import SCORE_CHUNK_TOKENS
from hybridflow.config import (
    FROZEN_SECTIONS,
    HybridflowConfig,
    RoleConfig,
    enabled_roles,
    frozen_layout,
    frozen_layout_key,
    frozen_offload,
)
from hybridflow.model_size import count_parameters

__all__ = [
    "ENGINE_MARGIN_BYTES",
    "GIB",
    "LayerParams",
    "MemoryEstimate",
    "checkpoint_bytes",
    "engine_components",
    "engine_keeps_weights",
    "engine_params_per_rank",
    "kv_bytes_per_token",
    "param_split",
    "pool_memory",
    "stage_layers",
    "training_components",
]

GIB = 1 << 30
ENGINE_MARGIN_BYTES = 3 * GIB
"""CUDA-graph pools and forward activations of one SGLang rank, outside its static pool."""
TRAIN_PARAM_BYTES = 2  # bf16 parameters
FSDP2_PARAM_BYTES = 4  # FSDP2 keeps fp32 parameter shards (the optimizer's master), computes in bf16
MAIN_GRAD_BYTES = 4  # fp32 main grads of megatron's DDP
OPTIMIZER_BYTES = {"adam": 12, "sgd": 8}  # fp32 master + moments
ACTIVATION_BYTES = 2  # bf16
LOGIT_COPIES, LOGIT_BYTES = 2, 4  # two fp32 copies of the vocab-parallel logits
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GENERATION, TRAINING, SCORING = "generation", "training", "scoring"
TRAINED_ROLES = ("actor", "critic")


# ----------------------------------------------------------------------- parameters


@dataclass(frozen=True, kw_only=True)
class LayerParams:
    """Parameter counts of one transformer layer, grouped by how they are sharded."""

    attention: int
    """Attention projections split by (attention) tp: q, k, v (or MLA's up-projections), o."""
    replicated: int
    """Copied on every tp rank: norms, q/k norms, MLA down-projections, the router."""
    mlp: int
    """Dense MLP or shared experts, split by tp."""
    experts: int
    """Routed experts of the layer, all of them (split by ep * etp, or ep * moe_tp)."""

    @property
    def total(self) -> int:
        """All parameters of the layer."""
        return self.attention + self.replicated + self.mlp + self.experts


def _attention_split(m: ModelConfig) -> tuple[int, int]:
    """(tp-split, replicated) attention parameters of one layer."""
    h = m.hidden_size
    if not m.is_mla:
        q, kv = m.num_attention_heads * m.kv_channels, m.num_kv_heads * m.kv_channels
        split = 2 * h * q + 2 * h * kv + (q + 2 * kv if m.attention_bias else 0)
        return split, (2 * m.kv_channels if m.qk_layernorm else 0)
    heads, qk_head = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # with its norm
    kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    split = kv_up + heads * m.v_head_dim * h
    if m.q_lora_rank is None:
        return split + h * heads * qk_head, kv_down
    q_down = h * m.q_lora_rank + m.q_lora_rank
    return split + m.q_lora_rank * heads * qk_head, kv_down + q_down


def param_split(model: ModelConfig) -> list[LayerParams]:
    """Per layer, its parameters grouped by sharding (embeddings and final norm excluded)."""
    attention, attn_replicated = _attention_split(model)
    h = model.hidden_size
    norms = 2 * h
    dense = LayerParams(
        attention=attention, replicated=attn_replicated + norms, mlp=3 * h * model.ffn_hidden_size, experts=0
    )
    if not model.is_moe:
        return [dense] * model.num_layers
    moe = LayerParams(
        attention=attention,
        replicated=attn_replicated + norms + h * model.num_experts,
        mlp=3 * h * model.moe_ffn_hidden_size * model.num_shared_experts,
        experts=model.num_experts * 3 * h * model.moe_ffn_hidden_size,
    )
    k = model.first_k_dense_layers
    return [dense] * k + [moe] * (model.num_layers - k)


def stage_layers(num_layers: int, layout: ParallelLayout, stage: int) -> list[int]:
    """Layer indices on pipeline rank ``stage``: its vpp chunks of L / (pp * vpp) layers."""
    chunk = num_layers // (layout.pp * layout.vpp)
    return [c * chunk + i for c in range(stage, layout.pp * layout.vpp, layout.pp) for i in range(chunk)]


@dataclass(frozen=True)
class _RankParams:
    dense: int
    experts: int


def _stage_params(model: ModelConfig, layout: ParallelLayout, stage: int, *, head_rows: int) -> _RankParams:
    """Parameters one rank of pipeline stage ``stage`` holds; ``head_rows``: output rows."""
    layers = param_split(model)
    tp, h = layout.tp, model.hidden_size
    dense = experts = 0
    for i in stage_layers(model.num_layers, layout, stage):
        p = layers[i]
        dense += (p.attention + p.mlp) // tp + p.replicated
        experts += p.experts // (layout.ep * layout.etp)
    vocab = layout.padded_vocab_size(model)
    if stage == 0:
        dense += vocab * h // tp
    if stage == layout.pp - 1:
        tied_here = model.tie_word_embeddings and layout.pp == 1 and head_rows == vocab
        dense += h + (0 if tied_here else -(-head_rows // tp) * h)
    return _RankParams(dense, experts)


# ----------------------------------------------------------------------- activations


def _layer_activation_elems(m: ModelConfig, p: LayerParams, layout: ParallelLayout) -> float:
    """bf16 elements one layer stores per token (sequence parallel; see the module docstring)."""
    h, tp = m.hidden_size, layout.tp
    if m.is_mla:
        heads, qk_head = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        qkv_o = heads * (2 * qk_head + 2 * m.v_head_dim)
        latent = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
    else:
        q, kv = m.num_attention_heads * m.kv_channels, m.num_kv_heads * m.kv_channels
        qkv_o, latent = 2 * q + 2 * kv, 0
    attention = (2 * h + qkv_o) / tp + latent
    if p.experts == 0:
        return attention + (2 * h + 3 * m.ffn_hidden_size) / tp
    routed = m.moe_top_k * (layout.etp * h + 3 * m.moe_ffn_hidden_size) / tp
    shared = (h + 3 * m.moe_ffn_hidden_size * m.num_shared_experts) / tp if p.mlp else 0
    return attention + (h + 2 * m.num_experts) / tp + routed + shared


def _in_flight_chunks(layout: ParallelLayout, stage: int, num_microbatches: int) -> int:
    """Model chunks whose activations a 1F1B (or interleaved) schedule keeps on ``stage``."""
    if layout.vpp == 1:
        warmup = layout.pp - stage
    else:
        warmup = 2 * (layout.pp - stage - 1) + (layout.vpp - 1) * layout.pp + 1
    return min(warmup, num_microbatches * layout.vpp)


def _activation_bytes(cfg: HybridflowConfig, layout: ParallelLayout, stage: int, *, full_recompute: bool) -> int:
    m = cfg.model
    tokens = cfg.train.micro_batch_size * (cfg.data.max_prompt_length + cfg.data.max_response_length) / layout.cp
    layers = param_split(m)
    own = [_layer_activation_elems(m, layers[i], layout) for i in stage_layers(m.num_layers, layout, stage)]
    num_microbatches = max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.dp))
    chunks = _in_flight_chunks(layout, stage, num_microbatches)
    if full_recompute:
        stored = chunks * len(own) / layout.vpp * m.hidden_size / layout.tp
        elems = stored + max(own)  # plus the layer being recomputed
    else:
        elems = chunks * sum(own) / layout.vpp
    return int(elems * tokens * ACTIVATION_BYTES)


def _logit_bytes(cfg: HybridflowConfig, layout: ParallelLayout, head_rows: int) -> int:
    tokens = cfg.train.micro_batch_size * (cfg.data.max_prompt_length + cfg.data.max_response_length) // layout.cp
    return LOGIT_COPIES * LOGIT_BYTES * tokens * -(-head_rows // layout.tp)


# ----------------------------------------------------------------------- roles


def _head_rows(cfg: HybridflowConfig, role: str) -> int:
    """Output rows of the role's head: the padded vocab, or 1 for the critic's value head."""
    return 1 if role == "critic" else getattr(cfg, role).parallel.padded_vocab_size(cfg.model)


def frozen_param_bytes(model: ModelConfig, layout: ParallelLayout) -> int:
    """bf16 parameters of a frozen model (a reward model, a teacher) at its heaviest pipeline
    stage under ``layout``: it has no grads or optimizer state, and its forward holds one layer
    at a time (as the reference's)."""
    rows = 1 if model.head == "score" else layout.padded_vocab_size(model)
    stages = [_stage_params(model, layout, s, head_rows=rows) for s in range(layout.pp)]
    return max(p.dense + p.experts for p in stages) * TRAIN_PARAM_BYTES


def judge_components(cfg: HybridflowConfig, model: ModelConfig) -> dict[str, int]:
    """One GPU of the judge's engine: its weights over ``judge.tp`` in ``judge.dtype`` and its KV
    cache (``judge.max_total_tokens``), as a rollout engine rank counts them."""
    judge, dtype = cfg.judge, DTYPE_BYTES[cfg.judge.dtype]
    per_token = (
        (model.kv_lora_rank + model.qk_rope_head_dim) if model.is_mla else 2 * model.num_kv_heads * model.kv_channels
    )
    return {
        "judge weights": count_parameters(model)["total"] // judge.tp * dtype,
        "judge KV cache": judge.max_total_tokens * per_token * model.num_layers * dtype // judge.tp,
    }


def _adapter_params(cfg: HybridflowConfig, layout: ParallelLayout, stage: int) -> _RankParams:
    """LoRA adapter parameters one rank of pipeline stage ``stage`` holds."""
    dense = experts = 0
    for i in stage_layers(cfg.model.num_layers, layout, stage):
        moe_layer = cfg.model.is_moe and i >= cfg.model.first_k_dense_layers
        d, e = adapter_params_per_rank(cfg.lora, cfg.model, layout, moe_layer=moe_layer)
        dense, experts = dense + d, experts + e
    return _RankParams(dense, experts)


def _fsdp2_training(cfg: HybridflowConfig, role: str, stage: int, full_recompute: bool) -> dict[str, int]:
    """One rank of an FSDP2 role: fp32 shards (1/dp) of the parameters, their gradients and AdamW's
    two moments (the fp32 parameters are the master copy), plus the bf16 copy of the largest unit
    FSDP2 gathers at once (a decoder layer, or the root's embeddings and norm); activations with
    or without ``fsdp2.activation_checkpointing``; the log-probs' logits one chunk at a time."""
    layout, m = getattr(cfg, role).parallel, cfg.model
    layers = param_split(m)
    heads = 0 if role == "critic" else (0 if m.tie_word_embeddings else m.vocab_size)  # the critic's head: one row
    root = m.vocab_size * m.hidden_size + (heads + 1) * m.hidden_size + (m.hidden_size if role == "critic" else 0)
    total = sum(p.total for p in layers) + root
    shard = -(-total // layout.world_size)  # every rank a share (sequence-parallel ranks too)
    gathered = max(max(p.total for p in layers), root) * TRAIN_PARAM_BYTES
    resident = 0 if cfg.fsdp2.offload else shard * FSDP2_PARAM_BYTES
    out = {f"{role} params": resident + gathered}
    if role not in TRAINED_ROLES:
        return out
    out[f"{role} grads"] = 0 if cfg.fsdp2.offload else shard * FSDP2_PARAM_BYTES
    out[f"{role} optimizer"] = 0 if cfg.fsdp2.offload else shard * (OPTIMIZER_BYTES[cfg.train.optimizer] - 4)
    full = cfg.fsdp2.activation_checkpointing
    out[f"{role} activations"] = _activation_bytes(cfg, layout, 0, full_recompute=full)  # tp = pp = cp = 1
    tokens = cfg.train.micro_batch_size * (cfg.data.max_prompt_length + cfg.data.max_response_length) // layout.cp
    rows = 1 if role == "critic" else m.vocab_size
    out[f"{role} logits"] = LOGIT_COPIES * LOGIT_BYTES * min(tokens, SCORE_CHUNK_TOKENS) * rows
    return out


def _training_stage(cfg: HybridflowConfig, role: str, stage: int, *, full_recompute: bool) -> dict[str, int]:
    return TRAINER_MEMORY[cfg.actor.backend].stage(cfg, role, stage, full_recompute)


def _megatron_training(cfg: HybridflowConfig, role: str, stage: int, full_recompute: bool) -> dict[str, int]:
    """One GPU of megatron pipeline stage ``stage`` of ``role``: bf16 parameters, fp32 main grads,
    the (distributed) optimizer's state, activations and the last stage's logits."""
    layout = getattr(cfg, role).parallel
    rows = _head_rows(cfg, role)
    p = _stage_params(cfg.model, layout, stage, head_rows=rows)
    out = {f"{role} params": (p.dense + p.experts) * TRAIN_PARAM_BYTES}
    if role not in TRAINED_ROLES:
        return out
    if role == "actor" and cfg.lora.enabled:  # a frozen base: grads and state for the adapters only
        p = _adapter_params(cfg, layout, stage)
        out[f"{role} params"] += (p.dense + p.experts) * TRAIN_PARAM_BYTES
    train = cfg.train
    state = OPTIMIZER_BYTES[train.optimizer]
    if train.use_distributed_optimizer:
        optimizer = p.dense * state / (layout.dp * layout.cp) + p.experts * state / layout.expert_dp
    else:
        optimizer = (p.dense + p.experts) * state
    out[f"{role} grads"] = (p.dense + p.experts) * MAIN_GRAD_BYTES
    out[f"{role} optimizer"] = int(optimizer)
    out[f"{role} activations"] = _activation_bytes(cfg, layout, stage, full_recompute=full_recompute)
    out[f"{role} logits"] = _logit_bytes(cfg, layout, rows) if stage == layout.pp - 1 else 0
    return out


def training_components(cfg: HybridflowConfig, role: str, *, full_recompute: bool = True) -> tuple[int, dict[str, int]]:
    """(stage, component -> bytes) of one GPU of ``role``'s heaviest pipeline stage.

    ``role`` is actor, reference or critic; the reference holds parameters only.
    """
    role_cfg: RoleConfig = getattr(cfg, role)
    stages = [_training_stage(cfg, role, s, full_recompute=full_recompute) for s in range(role_cfg.parallel.pp)]
    heaviest = max(range(len(stages)), key=lambda s: sum(stages[s].values()))
    return heaviest, stages[heaviest]


def engine_params_per_rank(cfg: HybridflowConfig) -> int:
    """Parameters one engine rank loads: its share of the parallel split (a replica of an engine that
    does not shard: the whole model), its embedding padded as the engine pads it."""
    m, s = cfg.model, cfg.rollout.parallel_split()
    total = 0
    for p in param_split(m):
        total += p.attention // s.attn_tp + p.replicated + p.mlp // s.tp
        total += p.experts // (s.ep * s.moe_tp)
    h = m.hidden_size
    embedding = _padded_vocab(cfg, s.attn_tp) // s.attn_tp * h
    lm_head = 0 if m.tie_word_embeddings else _padded_vocab(cfg, s.tp) // s.tp * h
    return total + embedding + lm_head + h


def _padded_vocab(cfg: HybridflowConfig, parts: int) -> int:
    """Embedding rows the rollout engine allocates for the vocabulary split ``parts`` ways."""
    padding = ENGINES[cfg.rollout.engine].padded_vocab
    return cfg.model.vocab_size if padding is None else resolve(padding)(cfg.model.vocab_size, parts)


def kv_bytes_per_token(cfg: HybridflowConfig) -> int:
    """KV-cache bytes one token takes on one engine rank, over all layers."""
    m, s = cfg.model, cfg.rollout.parallel_split()
    if m.is_mla:  # one compressed latent plus the rope key, shared by all heads
        per_layer = m.kv_lora_rank + m.qk_rope_head_dim
    else:
        per_layer = 2 * max(1, m.num_kv_heads // s.attn_tp) * m.kv_channels
    return per_layer * m.num_layers * DTYPE_BYTES[cfg.rollout.dtype]


def engine_keeps_weights(cfg: HybridflowConfig) -> bool:
    """Whether a colocated engine keeps its weights resident while the actor trains: under
    ``lora.push=adapter`` they are the frozen base, which never changes, so releasing them would
    only mean pushing the whole base again every step (the training phase counts them instead)."""
    return cfg.lora.pushes_adapters


def engine_components(cfg: HybridflowConfig) -> dict[str, int]:
    """Component -> bytes of one rollout engine rank."""
    return {
        "engine weights": engine_params_per_rank(cfg) * DTYPE_BYTES[cfg.rollout.dtype],
        "engine KV cache": cfg.rollout.max_total_tokens * kv_bytes_per_token(cfg),
        "engine margin": ENGINE_MARGIN_BYTES,
    }


# ----------------------------------------------------------------------- pools


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-GPU memory of one resource pool, per phase and component, against the device."""

    pool: str
    """Name of the resource pool."""
    phases: dict[str, dict[str, int]]
    """Phase (generation, training) -> component (e.g. ``actor optimizer``) -> bytes."""
    device_bytes: int
    """Memory of one device."""
    notes: tuple[str, ...] = field(default=())
    """Which pipeline stage each role is accounted at, and other assumptions."""
    advice: Mapping[str, str | None] = field(default_factory=dict)
    """Component -> the setting that shrinks it, given what the config already sets (None: none)."""

    @cached_property
    def totals(self) -> dict[str, int]:
        """Phase -> bytes."""
        return {phase: sum(parts.values()) for phase, parts in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        """The phase with the most memory."""
        return max(self.totals, key=self.totals.__getitem__)

    @property
    def peak_bytes(self) -> int:
        """Bytes of the peak phase: what one GPU of the pool must hold."""
        return self.totals[self.peak_phase]

    @property
    def fits(self) -> bool:
        """Whether the peak fits in ``device_bytes``."""
        return self.peak_bytes <= self.device_bytes

    def warning(self) -> str | None:
        """None if the peak fits, else a line naming the knobs to turn, biggest first."""
        if self.fits:
            return None
        parts = self.phases[self.peak_phase]
        ranked = sorted(parts, key=parts.__getitem__, reverse=True)
        knobs = [k for k in dict.fromkeys(self.advice.get(name) for name in ranked if parts[name]) if k]
        return (
            f"WARNING pool {self.pool}: the {self.peak_phase} peak "
            f"{self.peak_bytes / GIB:.1f} GiB exceeds the device's "
            f"{self.device_bytes / GIB:.0f} GiB; {'; '.join(knobs[:3])}"
        )

    def describe(self) -> list[str]:
        """One table in GiB: components as rows, phases as columns, then the peak."""
        names = list(dict.fromkeys(n for parts in self.phases.values() for n in parts))
        width = max(len(n) for n in [*names, "total"])
        phases = list(self.phases)
        lines = [f"memory per GPU, pool {self.pool} (GiB):", "  " + " " * width + "".join(f"{p:>12}" for p in phases)]
        for name in names:
            cells = "".join(_gib_cell(self.phases[p].get(name)) for p in phases)
            lines.append(f"  {name:<{width}}{cells}")
        lines.append(f"  {'total':<{width}}" + "".join(_gib_cell(self.totals[p]) for p in phases))
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(
            f"  peak {self.peak_bytes / GIB:.2f} GiB ({self.peak_phase}) of "
            f"{self.device_bytes / GIB:.0f} GiB: {verdict}"
        )
        lines += [f"  {note}" for note in self.notes]
        warning = self.warning()
        return lines + ([f"  {warning}"] if warning else [])


def _gib_cell(n: int | None) -> str:
    return f"{'-':>12}" if n is None else f"{n / GIB:>12.2f}"


def _knob(cfg: HybridflowConfig, component: str) -> str | None:
    """The setting that shrinks ``component`` (None: a fixed margin), never one ``cfg`` already
    sets: advice to turn on what is on sends a user in circles."""
    role, _, kind = component.partition(" ")
    if role == "judge":
        return {"weights": "raise judge.tp (or judge a smaller model)", "KV cache": "lower judge.max_total_tokens"}.get(
            kind
        )
    if role in ("reward_model", "teacher"):
        return f"raise {frozen_layout_key(role)}.tp / pp / ep (its layout; the actor's when unset)"
    if role == "engine":
        return {
            "weights": "raise rollout.tp / rollout.ep (more ranks per engine)",
            "KV cache": "lower rollout.max_total_tokens",
        }.get(kind)
    return TRAINER_MEMORY[cfg.actor.backend].knob(cfg, role, kind)


def _megatron_knob(cfg: HybridflowConfig, role: str, kind: str) -> str:
    if kind in ("activations", "logits"):
        smaller = "lower train.micro_batch_size, or " if cfg.train.micro_batch_size > 1 else ""
        return f"{smaller}raise {role}.parallel.tp / cp, or shorten data.max_response_length"
    if kind == "optimizer":
        return _optimizer_knob(cfg, role)
    return f"raise {role}.parallel.tp / pp / ep"


def _fsdp2_knob(cfg: HybridflowConfig, role: str, kind: str) -> str:
    smaller = "lower train.micro_batch_size, or " if cfg.train.micro_batch_size > 1 else ""
    if kind == "activations" and not cfg.fsdp2.activation_checkpointing:
        return f"set fsdp2.activation_checkpointing=true, or {smaller}shorten data.max_response_length"
    if kind in ("activations", "logits"):
        return f"{smaller}shorten data.max_response_length"
    more = f"add GPUs (raise {role}.parallel.dp: FSDP2 shards it over dp)"
    return more if cfg.fsdp2.offload else f"{more}, or set fsdp2.offload=true"


def _optimizer_knob(cfg: HybridflowConfig, role: str) -> str:
    if not cfg.train.use_distributed_optimizer:
        return f"set train.use_distributed_optimizer=true (shards the state over {role}.parallel.dp)"
    layout = getattr(cfg, role).parallel
    return (
        f"add GPUs (raise {role}.parallel.dp): the distributed optimizer already shards the dense state "
        f"over dp*cp={layout.dp * layout.cp} and the experts' over expert_dp={layout.expert_dp}"
    )


def _fsdp2_params_per_rank(cfg: HybridflowConfig, role: str, parts: dict[str, int]) -> int:
    """Its rank's share of every parameter (the estimate's components count fp32 shards)."""
    return -(-count_parameters(cfg.model)["total"] // getattr(cfg, role).parallel.dp)


@dataclass(frozen=True, kw_only=True)
class TrainerMemory:
    """How a trainer backend (``actor.backend``) holds a role on one GPU: the estimate's
    registration of each backend, as ``weight_sync.SOURCE_LAYOUTS`` is the sync's."""

    stage: Callable[[HybridflowConfig, str, int, bool], dict[str, int]]
    """(cfg, role, pipeline stage, full recompute) -> component -> bytes of one GPU."""
    knob: Callable[[HybridflowConfig, str, str], str]
    """(cfg, role, component kind) -> the setting that shrinks it."""
    recomputes: Callable[[HybridflowConfig, bool], bool]
    """(cfg, the caller's assumption) -> whether the activations are recomputed."""
    params_per_rank: Callable[[HybridflowConfig, str, dict[str, int]], int]
    """(cfg, role, its components) -> parameters one rank holds (host memory on a CPU)."""


TRAINER_MEMORY = {
    "megatron": TrainerMemory(
        stage=_megatron_training,
        knob=_megatron_knob,
        recomputes=lambda cfg, assumed: assumed,
        params_per_rank=lambda cfg, role, parts: parts[f"{role} params"] // TRAIN_PARAM_BYTES,
    ),
    "fsdp2": TrainerMemory(
        stage=_fsdp2_training,
        knob=_fsdp2_knob,
        recomputes=lambda cfg, assumed: cfg.fsdp2.activation_checkpointing,
        params_per_rank=_fsdp2_params_per_rank,
    ),
}
"""Each trainer backend's memory model (``hybridflow.runtime.trainers.TRAINERS`` runs them)."""


def pool_memory(
    cfg: HybridflowConfig,
    roles: Sequence[str],
    *,
    pool: str,
    device_memory_gib: float = 80.0,
    full_recompute: bool = True,
    frozen: Mapping[str, ModelConfig] | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of a pool holding ``roles`` (actor, reference, critic, rollout, and the
    frozen models of ``frozen``: role -> its architecture, under its layout).

    Phases: ``generation`` if the rollout engines are on the pool, ``training`` if a model
    role is; a colocated pool has both (see the module docstring for what each holds).
    """
    models = [r for r in roles if r in ("actor", "reference", "critic")]
    components, notes = {}, []
    for role in models:
        stage, parts = training_components(cfg, role, full_recompute=full_recompute)
        components.update(parts)
        if getattr(cfg, role).parallel.pp > 1:
            notes.append(f"{role}: pipeline stage {stage} (the heaviest)")
    offloaded = set()
    for role, model in (frozen or {}).items():
        if role == "judge" and role in roles:  # an engine of its own, resident in every phase
            components.update(judge_components(cfg, model))
            models.append(role)
        elif role in roles:
            models.append(role)
            components[f"{role} params"] = frozen_param_bytes(model, frozen_layout(cfg, role))
    for role in [r for r in ("reference", "reward_model", "teacher") if r in models and frozen_offload(cfg, r)]:
        offloaded.add(f"{role} params")
        notes.append(f"{role}: on the host between uses ({FROZEN_SECTIONS[role]}.offload)")
    if models and "actor" in models:
        full_recompute = TRAINER_MEMORY[cfg.actor.backend].recomputes(cfg, full_recompute)
        notes.append("activations with full recomputation" if full_recompute else "activations without recomputation")
    phases: dict[str, dict[str, int]] = {}
    if "rollout" in roles:
        # what the switch to generation leaves (hybridflow.lowering.switch): every role's params
        resident = {
            k: v
            for k, v in components.items()
            if (k.endswith(" params") or k.startswith("judge ")) and k not in offloaded
        }
        phases[GENERATION] = {**engine_components(cfg), **resident}
    if models:
        kept = engine_components(cfg) if "rollout" in roles and engine_keeps_weights(cfg) else {}
        # a pool of frozen models alone (GPUs of their own) never trains: it scores
        phase = TRAINING if set(models) & {"actor", "reference", "critic"} or "rollout" in roles else SCORING
        phases[phase] = {**components, **{k: v for k, v in kept.items() if k == "engine weights"}}
    if not phases:
        raise ValueError(f"pool {pool} holds no role with GPU memory (roles: {list(roles)})")
    advice = {name: _knob(cfg, name) for parts in phases.values() for name in parts}
    return MemoryEstimate(
        pool=pool, phases=phases, device_bytes=int(device_memory_gib * GIB), notes=tuple(notes), advice=advice
    )


def checkpoint_bytes(cfg: HybridflowConfig) -> int:
    """About the bytes one RL checkpoint writes: each trained role's bf16 weights and its optimizer
    state (a LoRA actor's frozen base: the weights, and state for the adapters alone, counted as
    nothing here). Preflight wants this much free under ``run.output_dir``."""
    total = count_parameters(cfg.model)["total"]
    state = OPTIMIZER_BYTES[cfg.train.optimizer]
    roles = [role for role in enabled_roles(cfg) if role in TRAINED_ROLES]
    return sum(total * (TRAIN_PARAM_BYTES + (0 if role == "actor" and cfg.lora.enabled else state)) for role in roles)
