"""Tiny model configs of every family and seeded random layout pairs for the reshard tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hfschema.sglang import SGLangSettings
from reshard import PipelineSplit, Topology, megatron_layout, sglang_layout
from reshard.topology import Device

TINY_MODELS: dict[str, ModelConfig] = {
    "llama": ModelConfig(
        family="llama",
        hidden_size=16,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=24,
        vocab_size=200,
        num_experts=0,
    ),
    "llama_tied": ModelConfig(
        family="llama",
        hidden_size=16,
        num_layers=2,
        num_attention_heads=8,
        num_kv_heads=8,
        head_dim=4,
        ffn_hidden_size=16,
        vocab_size=130,
        num_experts=0,
        tie_word_embeddings=True,
    ),
    "qwen2": ModelConfig(
        family="qwen2",
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=1,
        ffn_hidden_size=32,
        vocab_size=150,
        num_experts=0,
        attention_bias=True,
    ),
    "qwen3_moe": ModelConfig(
        family="qwen3_moe",
        hidden_size=16,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        ffn_hidden_size=32,
        vocab_size=190,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=8,
        qk_layernorm=True,
    ),
    "qwen3_moe_small": ModelConfig(
        family="qwen3_moe",
        hidden_size=16,
        num_layers=3,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=4,
        ffn_hidden_size=16,
        vocab_size=64,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=8,
        qk_layernorm=True,
    ),
    "mixtral": ModelConfig(
        family="mixtral",
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=16,
        vocab_size=100,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=16,
    ),
    "deepseek_v3": ModelConfig(
        family="deepseek_v3",
        hidden_size=16,
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=32,
        vocab_size=120,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=8,
        num_shared_experts=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        first_k_dense_layers=1,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
    ),
    "deepseek_v3_no_q_lora": ModelConfig(
        family="deepseek_v3",
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=16,
        vocab_size=70,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=8,
        num_shared_experts=2,
        router_score_function="sigmoid",
        router_expert_bias=True,
        first_k_dense_layers=1,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        tie_word_embeddings=True,
    ),
}
"""Covers all five families, tied embeddings (dense and MoE), q/k/v bias, q/k norm, first dense
layers, shared experts, MLA with and without q_lora_rank, vocab sizes that need padding. Only
what SGLang's model class of the family builds: Qwen3-MoE and Mixtral are never tied and have no
dense layers (``reshard.sglang.check_settings``, ``hfschema.model.FAMILY_FIXED``)."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One random layout pair with its topology."""

    name: str
    model: ModelConfig
    layout: ParallelLayout
    split: PipelineSplit
    settings: SGLangSettings
    topology: Topology

    def build(self):
        """(source layout, destination layout) for this case."""
        return (megatron_layout(self.model, self.layout, split=self.split), sglang_layout(self.model, self.settings))

    def __str__(self) -> str:
        return f"{self.name}: {self.layout.describe()} {self.split} -> {self.settings.describe()}"


def _pick(rng: random.Random, values):
    return values[rng.randrange(len(values))]


def random_megatron(rng: random.Random, model: ModelConfig) -> tuple[ParallelLayout, PipelineSplit]:
    """A megatron layout of at most 16 ranks that fits ``model`` (rejection sampling)."""
    while True:
        try:
            layout = ParallelLayout(
                tp=_pick(rng, [1, 1, 2, 4]),
                pp=_pick(rng, [1, 1, 2, 3]),
                vpp=_pick(rng, [1, 1, 2]),
                ep=_pick(rng, [1, 2, 4]) if model.is_moe else 1,
                etp=_pick(rng, [1, 1, 2]) if model.is_moe else 1,
                cp=_pick(rng, [1, 1, 2]),
                dp=_pick(rng, [1, 1, 2, 4]),
            )
            split = _random_split(rng, model, layout)
            if layout.world_size <= 16:
                megatron_layout(model, layout, split=split)  # validates
                return layout, split
        except ValueError:
            continue


def _random_split(rng: random.Random, model: ModelConfig, layout: ParallelLayout) -> PipelineSplit:
    if layout.pp == 1 or layout.vpp > 1 or rng.random() < 0.6:
        return PipelineSplit()
    return PipelineSplit(
        num_layers_in_first_pipeline_stage=rng.randrange(0, model.num_layers),
        num_layers_in_last_pipeline_stage=_pick(rng, [None, 0, 1, 2]),
    )


def _random_eplb(rng: random.Random, model: ModelConfig, ep: int) -> tuple[tuple[int, ...], ...]:
    extra = ep * rng.randrange(0, 3)
    physical = model.num_experts + extra
    if physical % ep or rng.random() < 0.5:
        return ()

    def row():
        r = list(range(model.num_experts))
        r += [rng.randrange(model.num_experts) for _ in range(extra)]
        rng.shuffle(r)
        return tuple(r)

    return (row(),) if rng.random() < 0.5 else tuple(row() for _ in range(model.num_layers))


def random_sglang(rng: random.Random, model: ModelConfig) -> SGLangSettings:
    """SGLang settings of at most 16 ranks that fit ``model`` (rejection sampling)."""
    while True:
        tp = _pick(rng, [1, 2, 2, 4, 8])
        dp_attention = rng.random() < 0.4
        dp = _pick(rng, [d for d in (1, 2, 4, 8) if tp % d == 0]) if dp_attention else 1
        ep = _pick(rng, [d for d in (1, 2, 4, 8) if tp % d == 0]) if model.is_moe else 1
        moe_dp = _pick(rng, [d for d in (1, 1, 2) if tp % (ep * d) == 0]) if model.is_moe else 1
        try:
            s = SGLangSettings(
                tp=tp,
                ep=ep,
                moe_dp=moe_dp,
                enable_dp_attention=dp_attention,
                dp_size=dp,
                enable_dp_lm_head=dp_attention and rng.random() < 0.5,
                num_replicas=_pick(rng, [1, 1, 2, 3]),
                physical_to_logical=_random_eplb(rng, model, ep) if model.is_moe else (),
            )
            if s.num_ranks <= 16:
                sglang_layout(model, s)  # validates
                return s
        except ValueError:
            continue


def random_topology(rng: random.Random, num_source: int, num_destination: int) -> Topology:
    """Colocated, separate, or every rank on a random device of a random small cluster."""
    kind = rng.randrange(3)
    if kind == 0:
        return Topology.colocated(num_source, num_destination=num_destination, gpus_per_node=_pick(rng, [2, 4, 8]))
    if kind == 1:
        return Topology.separate(num_source, num_destination, gpus_per_node=_pick(rng, [2, 4]))
    nodes = rng.randrange(1, 4)
    per_node = -(-max(num_source, num_destination) // nodes) + rng.randrange(2)
    pool = [Device(node=n, gpu=g) for n in range(nodes) for g in range(per_node)]
    # one device per rank on each side; the two sides overlap at random
    return Topology(source=tuple(rng.sample(pool, num_source)), destination=tuple(rng.sample(pool, num_destination)))


def random_cases(seed: int, count: int) -> list[Case]:
    """``count`` random cases cycling over ``TINY_MODELS``."""
    rng = random.Random(seed)
    names = list(TINY_MODELS)
    cases = []
    for i in range(count):
        name = names[i % len(names)]
        model = TINY_MODELS[name]
        layout, split = random_megatron(rng, model)
        settings = random_sglang(rng, model)
        topology = random_topology(rng, layout.world_size, settings.num_ranks)
        cases.append(Case(name=name, model=model, layout=layout, split=split, settings=settings, topology=topology))
    return cases
