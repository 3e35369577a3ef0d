"""Parameter counts of a ``ModelConfig``, computed from its shapes without building it.

All MLPs are SwiGLU (gate, up, down: ``3 * hidden * ffn``). A layer is

    input norm -> attention (GQA or MLA) -> post-attention norm -> dense MLP or MoE

followed by the final norm, with the input embedding and (unless tied) the LM head.
Counts use the tokenizer vocabulary, not megatron's padded one, so they match the
model cards (Qwen3-235B-A22B, DeepSeek-V3 671B without its MTP module). An architecture no
family maps is counted from its weight files' tensors instead (``reshard.families``).
"""

import math
import os

from hfschema.model import UNMAPPED_FAMILY, ModelConfig

__all__ = ["count_parameters", "format_count"]


def _gqa_attention(m: ModelConfig) -> int:
    h, ch = m.hidden_size, m.kv_channels
    q_dim, kv_dim = m.num_attention_heads * ch, m.num_kv_heads * ch
    params = h * q_dim + 2 * h * kv_dim + q_dim * h
    if m.attention_bias:
        params += q_dim + 2 * kv_dim
    if m.qk_layernorm:
        params += 2 * ch
    return params


def _mla_attention(m: ModelConfig) -> int:
    h, heads = m.hidden_size, m.num_attention_heads
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q = h * heads * qk_head
    else:  # down-projection, its norm, up-projection
        q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk_head
    kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # with kv norm
    kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    o = heads * m.v_head_dim * h
    return q + kv_a + kv_b + o


def _moe_layer(m: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of one MoE block."""
    expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
    shared = expert * m.num_shared_experts
    router = m.hidden_size * m.num_experts
    total = m.num_experts * expert + shared + router
    active = m.moe_top_k * expert + shared + router
    return total, active


def _stored_count(model: ModelConfig) -> dict[str, int]:
    """A dense model's counts from the tensors of its weight files (``model.path``)."""
    from reshard.families import canonical_tensors

    total = sum(math.prod(t.shape) for t in canonical_tensors(model))
    embedding = model.vocab_size * model.hidden_size
    return {"total": total, "active": total, "embedding": embedding}


def count_parameters(model: ModelConfig) -> dict[str, int]:
    """Counts ``total``, ``active`` (per token: top-k + shared experts) and ``embedding``."""
    path = getattr(model, "path", None)
    if model.family == UNMAPPED_FAMILY and path and os.path.exists(os.path.expanduser(path)):
        return _stored_count(model)
    attention = _mla_attention(model) if model.is_mla else _gqa_attention(model)
    per_layer = attention + 2 * model.hidden_size  # plus the two RMSNorms
    num_moe = model.num_layers - model.first_k_dense_layers if model.is_moe else 0
    num_dense = model.num_layers - num_moe
    dense_mlp = 3 * model.hidden_size * model.ffn_hidden_size
    moe_total, moe_active = _moe_layer(model)
    embedding = model.vocab_size * model.hidden_size
    lm_head = 0 if model.tie_word_embeddings else embedding
    outside = embedding + lm_head + model.hidden_size  # + final norm
    shared = outside + model.num_layers * per_layer + num_dense * dense_mlp
    return {
        "total": shared + num_moe * moe_total,
        "active": shared + num_moe * moe_active,
        "embedding": embedding,
    }


def format_count(n: int) -> str:
    """Human-readable count: ``235.1B``, ``1.2T``, ``37.0M``, ``512``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)
