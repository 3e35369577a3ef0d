"""Build megatron-core GPT models from hybridflow's HF-style model config.

One ``ModelConfig`` (hfschema/model.py) describes an architecture the way its Hugging Face
``config.json`` does. ``transformer_config`` turns it into megatron-core's
``TransformerConfig`` (or ``MLATransformerConfig`` for DeepSeek-V3), and ``build_model_chunks``
builds one ``GPTModel`` per virtual pipeline stage held by this rank, with the layer spec that
fits the machine: megatron-core's local modules everywhere (see ``layer_spec`` for why not TE's).

Family differences live in the ``FAMILIES`` traits, derived from each family's registration
(``hfschema.families``), not in branches on the family name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from hfschema.families import FAMILIES as REGISTERED
from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hfschema.train import MoEConfig

from .parallel import device as rank_device
from .routing import moe_config_fields

_EXPERT_MODULES = (SequentialMLP, GroupedMLP, TEGroupedMLP)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyTraits:
    """What a model family needs beyond the shared architecture fields."""

    moe: bool
    """The family has routed experts."""
    mla: bool = False
    """Multi-latent attention (DeepSeek-V2/V3)."""
    extra: Callable[[ModelConfig], dict[str, Any]] = lambda model: {}
    """Extra TransformerConfig fields for this family."""


FAMILIES: dict[str, FamilyTraits] = {
    name: FamilyTraits(moe=family.is_moe, mla=family.attention == "mla", extra=family.megatron_extra)
    for name, family in REGISTERED.items()
}
"""Each registered family's build traits (``hfschema.families``)."""


def _moe_fields(model: ModelConfig, layout: ParallelLayout) -> dict[str, Any]:
    if not model.is_moe:
        return {}
    dense = model.first_k_dense_layers
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_top_k,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": (model.moe_ffn_hidden_size * model.num_shared_experts or None),
        "moe_layer_freq": [0] * dense + [1] * (model.num_layers - dense),
        "moe_router_score_function": model.router_score_function,
        "moe_router_enable_expert_bias": model.router_expert_bias,
        "moe_router_topk_scaling_factor": model.router_topk_scaling_factor,
        "moe_router_num_groups": model.router_num_groups,
        "moe_router_group_topk": model.router_group_topk,
        # softmax over all experts then top-k keeps unnormalised weights (norm_topk_prob=False);
        # top-k then softmax equals softmax-then-renormalise (Qwen3-MoE, Mixtral).
        "moe_router_pre_softmax": not model.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
    }


def transformer_config(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    moe: MoEConfig | None = None,
    initialize: bool = True,
) -> TransformerConfig:
    """megatron-core config for ``model`` under ``layout`` (dropout off: RL needs exact log-probs);
    ``moe`` adds routing replay, the expert-bias update rate and router losses (RL actor);
    ``initialize=False``: no random initialisation (weights about to be loaded)."""
    traits = FAMILIES[model.family]
    on_gpu = torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.attention_bias,
        qk_layernorm=model.qk_layernorm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.02,
        # CPU initialisation draws each full weight before slicing it: a pretrained load skips it
        perform_initialization=initialize,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        # Interleaved schedules send activations and gradients to the same peer at once when
        # pp=2; megatron's batched p2p then pairs a gradient with an activation receive. Its
        # unbatched path keeps the two directions on separate groups (as Megatron-LM does).
        overlap_p2p_comm=layout.vpp > 1,
        batch_p2p_comm=layout.vpp == 1,
        sequence_parallel=layout.tp > 1,
        use_cpu_initialization=not on_gpu,
        calculate_per_token_loss=True,
        # Fused kernels need CUDA (and apex / TE); megatron's unfused paths are exact.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False,
        # run.deterministic switches torch's flag in every rank (hybridflow/runtime/determinism.py)
        deterministic_mode=torch.are_deterministic_algorithms_enabled(),
    )
    fields.update(_moe_fields(model, layout))
    if model.is_moe:
        fields.update(moe_config_fields(moe))
    fields.update(traits.extra(model))
    config_cls = MLATransformerConfig if traits.mla else TransformerConfig
    return config_cls(**fields)


class MLADotProductAttention(DotProductAttention):
    """megatron's unfused attention, accepting the separate key / value head sizes MLA passes.

    ``MLASelfAttention`` builds its core attention with ``k_channels`` / ``v_channels``, which
    only TransformerEngine's attention accepts. The unfused path already handles a query-key
    head size different from the value head size (``kv_channels`` is set to ``v_head_dim``);
    MLA passes its own softmax scale.
    """

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert v_channels in (None, self.config.kv_channels), "MLA needs kv_channels == v_head_dim"


def _use_local_mla_attention(block_spec: Any) -> None:
    """Local MLA: unfused attention that takes MLA's head sizes; replicated down-projections.

    With column-parallel down-projections (megatron's local MLA spec) the shared rotary key
    ``k_pos_emb`` is gathered over TP and used by every rank's heads, but its gradient is then
    only split back, not summed: each rank's down-projection received only its own heads'
    part (seen as a 1% gradient error at TP=2). A replicated ``Linear`` (megatron's own, marked
    ``sequence_parallel`` so TP all-reduces its gradient) takes megatron's other path, where
    ``k_pos_emb`` is gathered over the sequence and reduce-scattered on the way back.
    """
    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.submodules.core_attention = ModuleSpec(module=MLADotProductAttention)
            attention.submodules.linear_q_down_proj = ReplicatedLinear
            attention.submodules.linear_kv_down_proj = ReplicatedLinear


def layer_spec(config: TransformerConfig, model: ModelConfig, *, vp_stage: int | None = None):
    """The decoder layer spec: megatron-core's local modules, on CPUs and GPUs alike.

    TransformerEngine's spec is not used even where TE imports: it fuses norms into the next
    linear under other parameter names (``linear_qkv.layer_norm_weight`` for ``input_layernorm``,
    ``linear_fc1.layer_norm_weight`` in dense layers, MLA's ``linear_q_up_proj.layer_norm_weight``
    / ``linear_kv_up_proj.layer_norm_weight``, extra ``_extra_state``), which the weight export,
    the reshard plan and the converters do not map yet; a run would fail at its first weight sync.
    """
    if model.is_moe or FAMILIES[model.family].mla:
        # The block spec handles dense-then-MoE layer mixes and shared experts.
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        if FAMILIES[model.family].mla:
            _use_local_mla_attention(spec)
        return spec
    return get_gpt_layer_local_spec(qk_layernorm=model.qk_layernorm, normalization="RMSNorm")


def _rope_kwargs(model: ModelConfig) -> dict[str, Any]:
    """GPTModel's rotary arguments. MLA builds its own (yarn) rotary inside attention."""
    scaling = model.rope_scaling
    kwargs: dict[str, Any] = {"position_embedding_type": "rope"}
    if scaling is None or FAMILIES[model.family].mla:
        return kwargs
    if scaling.type == "llama3":
        return {**kwargs, "rope_scaling": True, "rope_scaling_factor": scaling.factor}
    if scaling.type == "linear":
        return {**kwargs, "seq_len_interpolation_factor": scaling.factor}
    raise ValueError(
        f"model.rope_scaling.type={scaling.type!r} is supported only for MLA models here; "
        "use 'llama3' or 'linear' for this family"
    )


def mark_expert_params(chunk: torch.nn.Module) -> int:
    """Tag every routed-expert parameter for reduction over the expert data-parallel group.

    megatron-core's linear layers tag expert weights only when ``expert_model_parallel_size >
    1``; otherwise they are reduced over the dense data-parallel group. That is right only while
    the expert grid equals the dense grid: with EP=1 and ETP != TP (for example TP=2, ETP=1, or
    ETP=2 over DP=2) the two groups differ, and expert gradients were left unreduced or summed
    across different shards. Tagging them always makes DDP reduce them over the expert
    data-parallel group, which equals the dense one when the grids agree. Returns the count.
    """
    tagged = 0
    for module in chunk.modules():
        if isinstance(module, _EXPERT_MODULES):
            for param in module.parameters():
                param.allreduce = False
                tagged += 1
    return tagged


def padded_vocab_size(model: ModelConfig, layout: ParallelLayout) -> int:
    """Vocab size megatron builds: rounded up so every TP rank holds an equal, aligned slice."""
    return layout.padded_vocab_size(model)


def build_model_chunks(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    pg_collection: ProcessGroupCollection | None = None,
    moe: MoEConfig | None = None,
    initialize: bool = True,
) -> list[GPTModel]:
    """The GPTModel chunks this rank holds: one, or ``layout.vpp`` under interleaved pipelining.
    ``initialize=False``: parameters are zeros, for weights about to be loaded.

    Needs the groups of ``layout``: megatron's global ones (``parallel.initialize``), or a
    ``pg_collection`` from ``parallel.layout_groups`` (its pipeline stage is read from there).
    """
    config = transformer_config(model, layout, params_dtype=params_dtype, moe=moe, initialize=initialize)
    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    vpp = layout.vpp if layout.vpp > 1 else None
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = is_pp_first_stage(pg_collection.pp) and is_vp_first_stage(stage, vpp)
        post = is_pp_last_stage(pg_collection.pp) and is_vp_last_stage(stage, vpp)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(config, model, vp_stage=stage),
                vocab_size=padded_vocab_size(model, layout),
                max_sequence_length=model.max_position_embeddings,
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=model.tie_word_embeddings,
                rotary_base=int(model.rope_theta),
                **_rope_kwargs(model),
                pg_collection=pg_collection,
                vp_stage=stage,
            )
        )
    device = rank_device()
    for chunk in chunks:
        chunk.to(device)  # a no-op on GPUs (built there); CPU initialisation builds on the host
        mark_expert_params(chunk)
        if not initialize:  # uninitialised memory; rows no weight file fills (vocab padding) stay 0
            with torch.no_grad():
                for param in chunk.parameters():
                    param.zero_()
    return chunks
