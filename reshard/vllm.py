"""The vLLM side: which boxes of which canonical tensors each vLLM tensor-parallel rank needs.

vLLM's model classes cut and fuse a checkpoint as SGLang's do (SGLang's began as vLLM's):
``QKVParallelLinear`` (q, k, v rows of the rank's heads, kv heads repeated when tp exceeds them),
``MergedColumnParallelLinear`` (gate then up), ``RowParallelLinear``, ``VocabParallelEmbedding``
(rows padded to a multiple of 64, split evenly), ``FusedMoE`` (``w13_weight[E, 2I/tp, H]``,
``w2_weight[E, H, I/tp]``). So the plan is SGLang's rules at vLLM's split (tp only: expert and
attention data parallelism are refused for vLLM by ``RolloutConfig``), with vLLM's parameter
names where they differ (``VLLM_NAMES``). Held to vLLM's own loader, rank for rank and element
for element, by ``tests/rollout/test_vllm_loader.py`` (tp 1 / 2 / 4, dense and MoE), whose
parameter names come from the running engine (``VLLMEngine.rank_params``).
"""

from __future__ import annotations

from hfschema.model import ModelConfig
from hfschema.sglang import SGLangSettings
from reshard.layouts import TensorLayout
from reshard.sglang import build_layout

__all__ = ["VLLM_NAMES", "vllm_layout"]

VLLM_NAMES = {".mlp.experts.w13_weight": ".mlp.experts.routed_experts.w13_weight",
              ".mlp.experts.w2_weight": ".mlp.experts.routed_experts.w2_weight"}  # fmt: skip
"""SGLang's parameter name endings that vLLM 0.32 names otherwise (its MoE layer holds the routed
experts in a submodule of their own)."""


def _vllm_name(param: str) -> str:
    for sglang, vllm in VLLM_NAMES.items():
        if param.endswith(sglang):
            return param[: -len(sglang)] + vllm
    return param


def vllm_layout(model: ModelConfig, settings: SGLangSettings, *, dtype: str = "bfloat16") -> TensorLayout:
    """Which box of every canonical tensor each vLLM rank needs, and where it lands."""
    if settings.ep != 1 or settings.moe_dp != 1 or settings.enable_dp_attention:
        raise ValueError(f"vLLM's layout is planned for tensor parallelism alone, not {settings.describe('vllm')}")
    return build_layout(model, settings, dtype=dtype, engine="vLLM", side="vllm", rename=_vllm_name)
