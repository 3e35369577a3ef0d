"""Tiny model configs of the four supported families, shared by the megatron tests."""

from __future__ import annotations

from hfschema.model import ModelConfig, RopeScalingConfig

_COMMON = dict(
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=250,  # not a multiple of 128 * tp: exercises vocab padding
    max_position_embeddings=64,
)


def tiny(family: str) -> ModelConfig:
    """A tiny fp32-sized model of ``family`` (4 layers so PP=2 x VPP=2 also splits)."""
    return ModelConfig(family=family, **{**_COMMON, **_FAMILY[family]})


_FAMILY: dict[str, dict] = {
    "llama": dict(num_experts=0, rope_theta=500000.0),
    "qwen2": dict(num_experts=0, attention_bias=True, tie_word_embeddings=True),
    "qwen3_moe": dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, qk_layernorm=True),
    "mixtral": dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
    "deepseek_v3": dict(
        num_kv_heads=4,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        num_shared_experts=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        router_topk_scaling_factor=2.5,
        first_k_dense_layers=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
}

FAMILIES = tuple(_FAMILY)
MOE_FAMILIES = tuple(f for f in FAMILIES if _FAMILY[f].get("num_experts", 0) > 0)
