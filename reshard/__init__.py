"""Moving the actor's weights from the training layout to the rollout layout.

    ModelConfig + ParallelLayout --> megatron_layout() --> TensorLayout (source: who holds what)
    ModelConfig + SGLangSettings --> sglang_layout()   --> TensorLayout (destination: who needs it)
                                                                |
    Topology (device of every rank) -------------------------->+--> plan_reshard() --> Plan
                                                                                       |
                    plan_stats(): bytes, lower bound, gather baseline, time <----------+
                    Plan.transfers_for(rank): what an executor sends / receives <------+

Both sides describe their fused parameters (Megatron ``linear_qkv``, ``linear_fc1``, local
experts; SGLang ``qkv_proj``, ``gate_up_proj``, ``w13_weight`` ...) as boxes of canonical Hugging
Face tensors, from one per-family registry (``reshard.families``). The planner takes values and
returns values: no torch, no process groups, no weights, so a 671B plan is shapes only. The
executor over torch.distributed is a separate piece that consumes ``Plan.transfers_for``.

The values the planner takes (``ModelConfig``, ``ParallelLayout``, ``SGLangSettings``) come from
the leaf package ``hfschema``; ``reshard`` imports nothing else of the project.
"""

from reshard.families import FAMILIES, CanonicalTensor, Placement, TensorSpec, canonical_tensors
from reshard.layouts import Holding, ParamInfo, RankHoldings, Shard, TensorLayout
from reshard.megatron import PipelineSplit, dense_rank, expert_rank, layer_stages, megatron_layout
from reshard.planner import KINDS, Bundle, Plan, Slice, Transfer, check_compatible, plan_reshard
from reshard.sglang import sglang_layout
from reshard.stats import Bandwidth, PlanStats, baseline_bytes, lower_bound_bytes, plan_stats
from reshard.topology import Device, Topology

__all__ = [
    "Bandwidth",
    "Bundle",
    "CanonicalTensor",
    "Device",
    "FAMILIES",
    "Holding",
    "KINDS",
    "ParamInfo",
    "PipelineSplit",
    "Placement",
    "Plan",
    "PlanStats",
    "RankHoldings",
    "Shard",
    "Slice",
    "TensorLayout",
    "TensorSpec",
    "Topology",
    "Transfer",
    "baseline_bytes",
    "canonical_tensors",
    "check_compatible",
    "dense_rank",
    "expert_rank",
    "layer_stages",
    "lower_bound_bytes",
    "megatron_layout",
    "plan_reshard",
    "plan_stats",
    "sglang_layout",
]
