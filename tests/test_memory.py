"""Per-GPU memory estimates: hand-checked tiny models, then sanity on Qwen3-235B."""

from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.memory import (
    ENGINE_MARGIN_BYTES,
    GIB,
    _activation_bytes,
    engine_components,
    engine_params_per_rank,
    kv_bytes_per_token,
    param_split,
    pool_memory,
    stage_layers,
    training_components,
)
from hybridflow.model_size import count_parameters

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# h=64, 2 layers, 4 query heads and 2 kv heads of 16 channels, ffn 128, vocab 256
DENSE = [
    "model.family=llama",
    "model.num_experts=0",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
]
# per layer: q,o 2*64*64 + k,v 2*64*32 = 12288 attention; 3*64*128 = 24576 MLP; 128 norms
DENSE_LAYER = 12288 + 24576 + 128
MLA = [
    "model.family=deepseek_v3",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.num_experts=4",
    "model.moe_ffn_hidden_size=32",
    "model.kv_lora_rank=32",
    "model.qk_nope_head_dim=16",
    "model.qk_rope_head_dim=16",
    "model.v_head_dim=16",
    "model.router_score_function=sigmoid",
    "model.router_expert_bias=true",
]


def _cfg(*overrides):
    return load_config(None, list(overrides))


def _params(cfg, role="actor"):
    return training_components(cfg, role)[1][f"{role} params"]


@pytest.mark.parametrize("path", ["quickstart_cpu", "grpo_qwen3_235b", "grpo_deepseek_v3_671b"])
def test_param_split_adds_up_to_the_model(path):
    cfg = load_config(str(CONFIGS / f"{path}.yaml"))
    m = cfg.model
    outside = 2 * m.vocab_size * m.hidden_size + m.hidden_size  # embedding, head, final norm
    assert sum(p.total for p in param_split(m)) + outside == count_parameters(m)["total"]


def test_dense_tp2_halves_the_layer_and_vocab_params():
    one = _params(_cfg(*DENSE))
    two = _params(_cfg(*DENSE, "actor.parallel.tp=2"))
    # tp=1: 2 layers + embedding + head (256*64 each) + final norm; bf16
    assert one == 2 * (2 * DENSE_LAYER + 2 * 256 * 64 + 64)
    # tp=2 splits everything but the 128 norm weights of each layer and the final norm
    assert two == 2 * (2 * ((DENSE_LAYER - 128) // 2 + 128) + 256 * 64 + 64)


def test_ep2_halves_the_expert_params():
    base = ["actor.parallel.dp=2", "rollout.tp=1"]
    one = _params(_cfg(*base))  # the default tiny MoE: 4 experts of 3*64*64, 2 layers
    two = _params(_cfg(*base, "actor.parallel.ep=2"))
    experts = 2 * 4 * 3 * 64 * 64
    assert one - two == 2 * experts // 2


def test_pipeline_stages_split_layers_and_vocab():
    cfg = _cfg(*DENSE, "actor.parallel.pp=2")
    layout = cfg.actor.parallel
    assert stage_layers(2, layout, 0) == [0] and stage_layers(2, layout, 1) == [1]
    # each stage: one layer and one vocab matrix; the last stage adds the final norm
    _, parts = training_components(cfg, "actor")
    assert parts["actor params"] == 2 * (DENSE_LAYER + 256 * 64 + 64)
    interleaved = _cfg(*DENSE, "model.num_layers=4", "actor.parallel.pp=2", "actor.parallel.vpp=2").actor.parallel
    assert stage_layers(4, interleaved, 0) == [0, 2]
    assert stage_layers(4, interleaved, 1) == [1, 3]


def test_distributed_optimizer_divides_state_by_dp():
    base = ["actor.parallel.dp=2", "rollout.tp=1"]
    sharded = training_components(_cfg(*base), "actor")[1]
    whole = training_components(_cfg(*base, "train.use_distributed_optimizer=false"), "actor")[1]
    params = sharded["actor params"] // 2
    assert whole["actor optimizer"] == 12 * params
    assert sharded["actor optimizer"] == 12 * params // 2
    assert sharded["actor grads"] == whole["actor grads"] == 4 * params  # fp32, not sharded


def test_activations_hand_checked():
    cfg = _cfg(
        *DENSE,
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
    )
    tokens = 2 * (64 + 16)
    # per token and layer: attention 2h + q + k + v + o_in = 128 + 64 + 32 + 32 + 64;
    # MLP 2h + 3 ffn = 128 + 384; bf16
    per_layer = (128 + 64 + 32 + 32 + 64) + (128 + 384)
    full = training_components(cfg, "actor", full_recompute=False)[1]
    assert full["actor activations"] == 2 * per_layer * tokens * 2
    recompute = training_components(cfg, "actor")[1]  # two layer inputs + one layer's set
    assert recompute["actor activations"] == (2 * 64 + per_layer) * tokens * 2
    assert full["actor logits"] == 2 * 4 * tokens * 256  # two fp32 copies, padded vocab 256


def test_first_stage_keeps_pp_micro_batches():
    cfg = _cfg(
        *DENSE, "model.num_layers=4", "actor.parallel.pp=2", "train.micro_batch_size=1", "train.global_batch_size=8"
    )
    first = _activation_bytes(cfg, cfg.actor.parallel, 0, full_recompute=False)
    last = _activation_bytes(cfg, cfg.actor.parallel, 1, full_recompute=False)
    assert first == 2 * last


def test_reference_holds_parameters_only():
    cfg = _cfg(*DENSE, "reference.enabled=true")
    _, parts = training_components(cfg, "reference")
    assert parts == {"reference params": _params(cfg)}


def test_kv_cache_gqa():
    # 2 layers, 2 kv heads of 16 channels, bf16: K and V
    assert kv_bytes_per_token(_cfg(*DENSE)) == 2 * 2 * 16 * 2 * 2
    assert kv_bytes_per_token(_cfg(*DENSE, "rollout.tp=2", "actor.parallel.dp=2")) == 2 * 1 * 16 * 2 * 2
    # attention tp 4 > 2 kv heads: each rank keeps one (replicated) kv head
    four = _cfg(*DENSE, "rollout.tp=4", "rollout.placement=separate")
    assert kv_bytes_per_token(four) == 2 * 1 * 16 * 2 * 2
    parts = engine_components(_cfg(*DENSE, "rollout.max_total_tokens=1000"))
    assert parts["engine KV cache"] == 1000 * 256
    assert parts["engine margin"] == ENGINE_MARGIN_BYTES


def test_kv_cache_mla_is_one_latent_not_split_by_tp():
    one = _cfg(*MLA)
    eight = _cfg(*MLA, "rollout.tp=4", "rollout.placement=separate")
    assert kv_bytes_per_token(one) == kv_bytes_per_token(eight) == (32 + 16) * 2 * 2


def test_engine_weights_split_by_tp_and_ep():
    whole = engine_params_per_rank(_cfg(*DENSE))
    assert whole == 2 * DENSE_LAYER + 2 * 256 * 64 + 64
    half = engine_params_per_rank(_cfg(*DENSE, "rollout.tp=2", "actor.parallel.dp=2"))
    assert half == 2 * ((DENSE_LAYER - 128) // 2 + 128) + 256 * 64 + 64
    moe = ["rollout.tp=2", "actor.parallel.dp=2"]
    experts = 2 * 4 * 3 * 64 * 64
    ep1 = engine_params_per_rank(_cfg(*moe))  # moe_tp=2: each expert split in two
    ep2 = engine_params_per_rank(_cfg(*moe, "rollout.ep=2"))  # two whole experts per rank
    assert ep1 == ep2 and ep1 > experts // 2


def test_qwen3_235b_params_per_gpu_match_the_shard_count():
    cfg = load_config(str(CONFIGS / "grpo_qwen3_235b.yaml"))
    m, layout = cfg.model, cfg.actor.parallel
    experts = m.num_layers * m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size
    dense = count_parameters(m)["total"] - experts
    expected = 2 * (dense / (layout.tp * layout.pp) + experts / (layout.ep * layout.pp))
    assert _params(cfg) == pytest.approx(expected, rel=0.03)
    assert 7 * GIB < _params(cfg) < 10 * GIB  # ~235e9 * 2 B / 64 expert shards (ep=32 x pp=2)


def test_colocated_phases_differ_and_the_peak_is_their_max():
    cfg = load_config(str(CONFIGS / "grpo_qwen3_235b.yaml"))
    est = pool_memory(cfg, ["actor", "rollout"], pool="colocated")
    gen, train = est.totals["generation"], est.totals["training"]
    assert gen != train and est.peak_bytes == max(gen, train)
    assert "actor optimizer" not in est.phases["generation"]  # offloaded while generating
    assert "engine KV cache" not in est.phases["training"]  # released while training
    assert est.phases["generation"]["actor params"] == est.phases["training"]["actor params"]


def test_separate_pools_have_one_phase_each():
    cfg = load_config(str(CONFIGS / "quickstart_cpu.yaml"), ["rollout.placement=separate"])
    assert list(pool_memory(cfg, ["rollout"], pool="rollout").phases) == ["generation"]
    actor = pool_memory(cfg, ["actor"], pool="actor")
    assert list(actor.phases) == ["training"] and actor.fits and actor.warning() is None


def test_describe_is_one_table_with_the_peak_and_a_warning_when_too_big():
    cfg = load_config(str(CONFIGS / "grpo_qwen3_235b.yaml"))
    est = pool_memory(cfg, ["actor", "rollout"], pool="colocated", device_memory_gib=40)
    lines = est.describe()
    assert lines[0] == "memory per GPU, pool colocated (GiB):"
    assert lines[1].split() == ["generation", "training"]
    assert any(line.split()[:3] == ["actor", "optimizer", "-"] for line in lines)
    assert f"peak {est.peak_bytes / GIB:.2f} GiB (generation) of 40 GiB: DOES NOT FIT" in "\n".join(lines)
    warning = est.warning()
    assert warning.startswith("WARNING pool colocated: the generation peak")
    assert "raise rollout.tp / rollout.ep" in warning  # the engine's weights are the biggest part
    small = pool_memory(cfg, ["rollout"], pool="rollout", device_memory_gib=1)
    assert "lower rollout.max_total_tokens" in small.warning() or "raise rollout.tp" in small.warning()


def test_a_pool_without_gpu_roles_is_an_error():
    with pytest.raises(ValueError, match="pool x holds no role"):
        pool_memory(_cfg(), ["reward"], pool="x")


@pytest.mark.claim("cpu-host-memory")
def test_a_cpu_run_hears_its_host_memory_from_plan_and_a_warning_when_it_would_not_fit(monkeypatch, capsys):
    """The processes of a CPU run and its model's share: plan says the total on a machine without
    a GPU, and preflight warns, before any rank starts, when the machine has less free."""
    from hybridflow import cli
    from hybridflow.config import load_config
    from hybridflow.host_memory import BYTES_PER_RANK_PARAM, PROCESS_BYTES, host_memory
    from hybridflow.preflight import check_host_memory

    quickstart = load_config("configs/quickstart_cpu.yaml")
    estimate = host_memory(quickstart)
    # 2 trainer ranks, a tp=2 engine: 2 schedulers and a detokenizer, the launcher and torchrun's agent
    processes = 2 * PROCESS_BYTES["trainer rank"] + 2 * PROCESS_BYTES["engine scheduler"]
    processes += PROCESS_BYTES["engine detokenizer"] + PROCESS_BYTES["launcher"] + PROCESS_BYTES["torchrun agent"]
    assert processes < estimate.total < processes + GIB // 8  # a 0.2M-parameter model: the processes are the run
    bigger = load_config("configs/quickstart_cpu.yaml", ["model.hidden_size=1024", "model.moe_ffn_hidden_size=2048"])
    grown = host_memory(bigger).parts["actor parameters"] - estimate.parts["actor parameters"]
    assert grown > 100 * BYTES_PER_RANK_PARAM * 1000  # the model's part grows with its parameters
    monkeypatch.setattr(cli, "has_gpu_device", lambda: False)
    assert cli.main(["plan", "configs/quickstart_cpu.yaml", "--no-reshard"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == estimate.line(), lines[:4]  # after the answer and the pool's peak
    check_host_memory(quickstart, available=None)
    check_host_memory(quickstart, available=64 * GIB)
    assert capsys.readouterr().err == ""
    check_host_memory(quickstart, available=GIB)
    assert capsys.readouterr().err == (
        f"hybridflow train: warning: {estimate.line()}, more than the 1.00 GiB this machine has free: the run "
        "will likely be killed for memory; lower train.micro_batch_size, rollout.max_total_tokens or the data "
        "lengths, or use fewer processes (actor.parallel, rollout.tp)\n"
    )


@pytest.mark.parametrize(
    "engine,rows",
    [("sglang", 320), ("vllm", 320), ("hf", 300)],  # 300 -> 320 (a multiple of 64); transformers as is
)
def test_engine_weights_count_the_embedding_rows_each_engine_allocates(engine, rows):
    """Each engine's own padding (``EngineTraits.padded_vocab``), not SGLang's for every engine."""
    overrides = [*DENSE, "model.vocab_size=300", f"rollout.engine={engine}", "rollout.sync_route=full"]
    assert engine_params_per_rank(_cfg(*overrides)) == 2 * DENSE_LAYER + 2 * rows * 64 + 64
