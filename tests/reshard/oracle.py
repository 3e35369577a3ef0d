"""An independent oracle: full HF tensors sliced into per-rank parameters, as each framework does.

Written from megatron-core's and SGLang 0.5.23's own code (named per function), not from
``reshard``: the tests apply a plan's transfers to the Megatron-side parameters built here and
compare the result with the SGLang-side parameters built here, element for element.

Megatron padding rows of the vocabulary are filled with ``PAD_SENTINEL``, so a plan that reads
them shows up as a mismatch (SGLang's loader zero-fills its padding rows).
"""

from __future__ import annotations

import numpy as np

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hfschema.sglang import SGLangSettings

PAD_SENTINEL = 12345.0


# ------------------------------------------------------------------ HF checkpoint


def _attention_shapes(m: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    if m.is_mla:
        qh = m.qk_nope_head_dim + m.qk_rope_head_dim
        kv_b_rows = m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        out = {
            f"{p}.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size),
            f"{p}.kv_a_layernorm.weight": (m.kv_lora_rank,),
            f"{p}.kv_b_proj.weight": (kv_b_rows, m.kv_lora_rank),
            f"{p}.o_proj.weight": (m.hidden_size, m.num_attention_heads * m.v_head_dim),
        }
        if m.q_lora_rank is None:
            out[f"{p}.q_proj.weight"] = (m.num_attention_heads * qh, m.hidden_size)
        else:
            out[f"{p}.q_a_proj.weight"] = (m.q_lora_rank, m.hidden_size)
            out[f"{p}.q_a_layernorm.weight"] = (m.q_lora_rank,)
            out[f"{p}.q_b_proj.weight"] = (m.num_attention_heads * qh, m.q_lora_rank)
        return out
    d = m.kv_channels
    rows = {"q": m.num_attention_heads * d, "k": m.num_kv_heads * d, "v": m.num_kv_heads * d}
    out = {f"{p}.{x}_proj.weight": (n, m.hidden_size) for x, n in rows.items()}
    out[f"{p}.o_proj.weight"] = (m.hidden_size, rows["q"])
    if m.attention_bias:
        out.update({f"{p}.{x}_proj.bias": (n,) for x, n in rows.items()})
    if m.qk_layernorm:
        out.update({f"{p}.q_norm.weight": (d,), f"{p}.k_norm.weight": (d,)})
    return out


def _mlp_shapes(p: str, ffn: int, hidden: int, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return {f"{p}.{gate}.weight": (ffn, hidden), f"{p}.{up}.weight": (ffn, hidden), f"{p}.{down}.weight": (hidden, ffn)}


def _moe_block(m: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    if m.family == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``m`` and its shape."""
    h = m.hidden_size
    out = {"model.embed_tokens.weight": (m.vocab_size, h), "model.norm.weight": (h,)}
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = (m.vocab_size, h)
    block, names = _moe_block(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out.update(_attention_shapes(m, f"{p}.self_attn"))
        if not m.is_moe or i < m.first_k_dense_layers:
            out.update(_mlp_shapes(f"{p}.mlp", m.ffn_hidden_size, h))
            continue
        out[f"{p}.{block}.gate.weight"] = (m.num_experts, h)
        if m.router_expert_bias:
            out[f"{p}.{block}.gate.e_score_correction_bias"] = (m.num_experts,)
        if m.num_shared_experts:
            out.update(_mlp_shapes(f"{p}.mlp.shared_experts", m.moe_ffn_hidden_size * m.num_shared_experts, h))
        for e in range(m.num_experts):
            out.update(_mlp_shapes(f"{p}.{block}.experts.{e}", m.moe_ffn_hidden_size, h, names))
    return out


def hf_checkpoint(m: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random full HF tensors (float32, all values distinct with high probability)."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in hf_shapes(m).items()}


def _chunk(a: np.ndarray, parts: int, i: int, axis: int = 0) -> np.ndarray:
    return np.split(a, parts, axis=axis)[i]


# ---------------------------------------------------------------- megatron-core


def megatron_coords(lo: ParallelLayout, rank: int) -> dict[str, int]:
    """Dense and expert grid coordinates of ``rank`` (order tp-cp-ep-dp-pp, tp fastest)."""
    per_stage = lo.world_size // lo.pp
    pp, inner = divmod(rank, per_stage)
    edp = lo.world_size // (lo.etp * lo.ep * lo.pp)
    return {
        "tp": inner % lo.tp,
        "pp": pp,
        "etp": inner % lo.etp,
        "ep": (inner // lo.etp) % lo.ep,
        "edp": inner // (lo.etp * lo.ep) % edp,
    }


def megatron_layers(m: ModelConfig, lo: ParallelLayout, pp: int, first=None, last=None) -> list[int]:
    """Global layers on pp rank ``pp``: interleaved chunks, or megatron's uneven first/last."""
    if first is None and last is None:
        per_chunk = m.num_layers // (lo.pp * lo.vpp)
        return [L for L in range(m.num_layers) if (L // per_chunk) % lo.pp == pp]
    counts = [None] * lo.pp
    counts[0] = first
    counts[-1] = last if last is not None else counts[-1]
    fixed = sum(c for c in counts if c is not None)
    free = sum(c is None for c in counts)
    counts = [c if c is not None else (m.num_layers - fixed) // free for c in counts]
    start = sum(counts[:pp])
    return list(range(start, start + counts[pp]))


def _vocab_rows(full: np.ndarray, padded: int, parts: int, i: int) -> np.ndarray:
    pad = np.full((padded - full.shape[0],) + full.shape[1:], PAD_SENTINEL, np.float32)
    return _chunk(np.concatenate([full, pad]), parts, i)


def _megatron_qkv(m: ModelConfig, hf: dict, p: str, suffix: str, tp: int, r: int) -> np.ndarray:
    # SelfAttention.get_query_key_value_tensors: per query group [q heads of g; k_g; v_g]
    d, groups = m.kv_channels, m.num_kv_heads
    qpg = m.num_attention_heads // groups
    q, k, v = (hf[f"{p}.{x}_proj.{suffix}"] for x in "qkv")
    per_group = [
        np.concatenate([q[g * qpg * d : (g + 1) * qpg * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
        for g in range(groups)
    ]
    local = groups // tp
    return np.concatenate(per_group[r * local : (r + 1) * local])


def _megatron_fc1(gate: np.ndarray, up: np.ndarray, parts: int, r: int) -> np.ndarray:
    return np.concatenate([_chunk(gate, parts, r), _chunk(up, parts, r)])


def _megatron_attention(m, hf, i, tp, r) -> dict[str, np.ndarray]:
    p, mg = f"model.layers.{i}.self_attn", f"decoder.layers.{i}.self_attention"
    out = {f"{mg}.linear_proj.weight": _chunk(hf[f"{p}.o_proj.weight"], tp, r, 1)}
    if m.is_mla:
        out[f"{mg}.linear_kv_down_proj.weight"] = hf[f"{p}.kv_a_proj_with_mqa.weight"]
        out[f"{mg}.kv_layernorm.weight"] = hf[f"{p}.kv_a_layernorm.weight"]
        out[f"{mg}.linear_kv_up_proj.weight"] = _chunk(hf[f"{p}.kv_b_proj.weight"], tp, r)
        if m.q_lora_rank is None:
            out[f"{mg}.linear_q_proj.weight"] = _chunk(hf[f"{p}.q_proj.weight"], tp, r)
        else:
            out[f"{mg}.linear_q_down_proj.weight"] = hf[f"{p}.q_a_proj.weight"]
            out[f"{mg}.q_layernorm.weight"] = hf[f"{p}.q_a_layernorm.weight"]
            out[f"{mg}.linear_q_up_proj.weight"] = _chunk(hf[f"{p}.q_b_proj.weight"], tp, r)
        return out
    out[f"{mg}.linear_qkv.weight"] = _megatron_qkv(m, hf, p, "weight", tp, r)
    if m.attention_bias:
        out[f"{mg}.linear_qkv.bias"] = _megatron_qkv(m, hf, p, "bias", tp, r)
    if m.qk_layernorm:
        out[f"{mg}.q_layernorm.weight"] = hf[f"{p}.q_norm.weight"]
        out[f"{mg}.k_layernorm.weight"] = hf[f"{p}.k_norm.weight"]
    return out


def _megatron_mlp(m, hf, i, lo: ParallelLayout, c: dict) -> dict[str, np.ndarray]:
    p, mg = f"model.layers.{i}", f"decoder.layers.{i}.mlp"
    if not m.is_moe or i < m.first_k_dense_layers:
        gate, up = hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]
        return {
            f"{mg}.linear_fc1.weight": _megatron_fc1(gate, up, lo.tp, c["tp"]),
            f"{mg}.linear_fc2.weight": _chunk(hf[f"{p}.mlp.down_proj.weight"], lo.tp, c["tp"], 1),
        }
    block, (g, u, d) = _moe_block(m)
    out = {f"{mg}.router.weight": hf[f"{p}.{block}.gate.weight"]}
    if m.router_expert_bias:
        out[f"{mg}.router.expert_bias"] = hf[f"{p}.{block}.gate.e_score_correction_bias"]
    if m.num_shared_experts:
        s = f"{p}.mlp.shared_experts"
        out[f"{mg}.shared_experts.linear_fc1.weight"] = _megatron_fc1(
            hf[f"{s}.gate_proj.weight"], hf[f"{s}.up_proj.weight"], lo.tp, c["tp"]
        )
        out[f"{mg}.shared_experts.linear_fc2.weight"] = _chunk(hf[f"{s}.down_proj.weight"], lo.tp, c["tp"], 1)
    local = m.num_experts // lo.ep
    for j in range(local):
        e = f"{p}.{block}.experts.{c['ep'] * local + j}"
        out[f"{mg}.experts.local_experts.{j}.linear_fc1.weight"] = _megatron_fc1(
            hf[f"{e}.{g}.weight"], hf[f"{e}.{u}.weight"], lo.etp, c["etp"]
        )
        out[f"{mg}.experts.local_experts.{j}.linear_fc2.weight"] = _chunk(hf[f"{e}.{d}.weight"], lo.etp, c["etp"], 1)
    return out


def megatron_params(
    m: ModelConfig, lo: ParallelLayout, hf: dict, rank: int, first=None, last=None
) -> dict[str, np.ndarray]:
    """The parameters megatron-core rank ``rank`` holds (global layer numbers in names)."""
    c = megatron_coords(lo, rank)
    tp, r = lo.tp, c["tp"]
    padded = lo.padded_vocab_size(m)
    out: dict[str, np.ndarray] = {}
    if c["pp"] == 0:
        out["embedding.word_embeddings.weight"] = _vocab_rows(hf["model.embed_tokens.weight"], padded, tp, r)
    if c["pp"] == lo.pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not m.tie_word_embeddings:
            out["output_layer.weight"] = _vocab_rows(hf["lm_head.weight"], padded, tp, r)
        elif lo.pp > 1:  # tied: the last stage keeps a synchronised copy of the embedding
            out["output_layer.weight"] = _vocab_rows(hf["model.embed_tokens.weight"], padded, tp, r)
    for i in megatron_layers(m, lo, c["pp"], first, last):
        p = f"model.layers.{i}"
        out[f"decoder.layers.{i}.input_layernorm.weight"] = hf[f"{p}.input_layernorm.weight"]
        out[f"decoder.layers.{i}.pre_mlp_layernorm.weight"] = hf[f"{p}.post_attention_layernorm.weight"]
        out.update(_megatron_attention(m, hf, i, tp, r))
        out.update(_megatron_mlp(m, hf, i, lo, c))
    return out


# ------------------------------------------------------------------------ SGLang


def _sglang_vocab(full: np.ndarray, parts: int, i: int) -> np.ndarray:
    # VocabParallelEmbedding: pad_vocab_size(org, 64), padding_size *= tp when uneven; the
    # loader copies its rows and fill_(0) the rest
    vocab = full.shape[0]
    pad_to = 64
    if -(-vocab // 64) * 64 % parts:
        pad_to = 64 * parts
    padded = -(-vocab // pad_to) * pad_to
    rows = np.zeros((padded,) + full.shape[1:], np.float32)
    rows[:vocab] = full
    return _chunk(rows, parts, i)


def _sglang_qkv(m: ModelConfig, hf: dict, p: str, suffix: str, a: int, i: int) -> np.ndarray:
    # QKVParallelLinear.weight_loader: q shard = tp_rank; kv shard = tp_rank // num_kv_head_replicas
    d, heads, kv = m.kv_channels, m.num_attention_heads, m.num_kv_heads
    q = _chunk(hf[f"{p}.q_proj.{suffix}"], a, i)
    if a >= kv:
        head = i // (a // kv)
        k = hf[f"{p}.k_proj.{suffix}"][head * d : (head + 1) * d]
        v = hf[f"{p}.v_proj.{suffix}"][head * d : (head + 1) * d]
    else:
        k = _chunk(hf[f"{p}.k_proj.{suffix}"], a, i)
        v = _chunk(hf[f"{p}.v_proj.{suffix}"], a, i)
    assert q.shape[0] == heads // a * d
    return np.concatenate([q, k, v])


def _sglang_attention(m, hf, i, a: int, ar: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{i}.self_attn"
    out = {f"{p}.o_proj.weight": _chunk(hf[f"{p}.o_proj.weight"], a, ar, 1)}
    if m.is_mla:
        # DeepseekV2AttentionMLA: fused_qkv_a_proj_with_mqa replicated, *_b_proj column-parallel
        out[f"{p}.kv_a_layernorm.weight"] = hf[f"{p}.kv_a_layernorm.weight"]
        out[f"{p}.kv_b_proj.weight"] = _chunk(hf[f"{p}.kv_b_proj.weight"], a, ar)
        if m.q_lora_rank is None:
            out[f"{p}.q_proj.weight"] = _chunk(hf[f"{p}.q_proj.weight"], a, ar)
            out[f"{p}.kv_a_proj_with_mqa.weight"] = hf[f"{p}.kv_a_proj_with_mqa.weight"]
        else:
            out[f"{p}.fused_qkv_a_proj_with_mqa.weight"] = np.concatenate(
                [hf[f"{p}.q_a_proj.weight"], hf[f"{p}.kv_a_proj_with_mqa.weight"]]
            )
            out[f"{p}.q_a_layernorm.weight"] = hf[f"{p}.q_a_layernorm.weight"]
            out[f"{p}.q_b_proj.weight"] = _chunk(hf[f"{p}.q_b_proj.weight"], a, ar)
        return out
    out[f"{p}.qkv_proj.weight"] = _sglang_qkv(m, hf, p, "weight", a, ar)
    if m.attention_bias:
        out[f"{p}.qkv_proj.bias"] = _sglang_qkv(m, hf, p, "bias", a, ar)
    if m.qk_layernorm:
        out[f"{p}.q_norm.weight"] = hf[f"{p}.q_norm.weight"]
        out[f"{p}.k_norm.weight"] = hf[f"{p}.k_norm.weight"]
    return out


def _sglang_gate_up(hf: dict, p: str, parts: int, r: int) -> dict[str, np.ndarray]:
    # MergedColumnParallelLinear [gate_r; up_r]; RowParallelLinear on the input dim
    gate, up = hf[f"{p}.gate_proj.weight"], hf[f"{p}.up_proj.weight"]
    return {
        f"{p}.gate_up_proj.weight": np.concatenate([_chunk(gate, parts, r), _chunk(up, parts, r)]),
        f"{p}.down_proj.weight": _chunk(hf[f"{p}.down_proj.weight"], parts, r, 1),
    }


def _sglang_experts(m, hf, i, s: SGLangSettings, t: int) -> dict[str, np.ndarray]:
    # FusedMoE: physical slots split contiguously over moe_ep; w13 = [w1 (gate); w3 (up)]
    # narrowed at moe_tp_rank, w2 narrowed on its input dim
    block, (g, u, d) = _moe_block(m)
    mt = s.tp // s.ep // s.moe_dp
    mt_rank, ep_rank = t % mt, (t // mt) % s.ep
    rows = s.physical_to_logical
    row = (rows[0] if len(rows) == 1 else rows[i]) if rows else tuple(range(m.num_experts))
    local = len(row) // s.ep
    w13, w2 = [], []
    for j in range(local):
        e = f"model.layers.{i}.{block}.experts.{row[ep_rank * local + j]}"
        w13.append(
            np.concatenate([_chunk(hf[f"{e}.{g}.weight"], mt, mt_rank), _chunk(hf[f"{e}.{u}.weight"], mt, mt_rank)])
        )
        w2.append(_chunk(hf[f"{e}.{d}.weight"], mt, mt_rank, 1))
    p = f"model.layers.{i}.{block}.experts"
    return {f"{p}.w13_weight": np.stack(w13), f"{p}.w2_weight": np.stack(w2)}


def _sglang_mlp(m, hf, i, s: SGLangSettings, t: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{i}"
    if not m.is_moe or i < m.first_k_dense_layers:
        return _sglang_gate_up(hf, f"{p}.mlp", s.tp, t)
    block, _ = _moe_block(m)
    out = {f"{p}.{block}.gate.weight": hf[f"{p}.{block}.gate.weight"]}
    if m.router_expert_bias:
        bias = f"{p}.{block}.gate.e_score_correction_bias"
        out[bias] = hf[bias]
    if m.num_shared_experts:
        out.update(_sglang_gate_up(hf, f"{p}.mlp.shared_experts", s.tp, t))
    out.update(_sglang_experts(m, hf, i, s, t))
    return out


def sglang_params(m: ModelConfig, s: SGLangSettings, hf: dict, rank: int) -> dict[str, np.ndarray]:
    """The parameters SGLang rank ``rank`` (engine-major numbering) loads from ``hf``."""
    t = rank % s.tp
    a = s.tp // s.dp_size if s.enable_dp_attention else s.tp
    head = a if s.enable_dp_lm_head else s.tp
    out = {
        "model.embed_tokens.weight": _sglang_vocab(hf["model.embed_tokens.weight"], a, t % a),
        "model.norm.weight": hf["model.norm.weight"],
    }
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = _sglang_vocab(hf["lm_head.weight"], head, t % head)
    for i in range(m.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = hf[f"{p}.input_layernorm.weight"]
        out[f"{p}.post_attention_layernorm.weight"] = hf[f"{p}.post_attention_layernorm.weight"]
        out.update(_sglang_attention(m, hf, i, a, t % a))
        out.update(_sglang_mlp(m, hf, i, s, t))
    return out
