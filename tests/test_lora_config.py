"""The ``lora:`` section: off by default, and one-line errors that name the key."""

from pathlib import Path

import pytest

from hybridflow.config import load_config

QUICKSTART = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart_cpu.yaml")
ON = "lora.enabled=true"


def _error(*overrides: str) -> str:
    with pytest.raises(ValueError) as info:
        load_config(QUICKSTART, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_off_by_default_and_loads_when_on():
    assert not load_config(QUICKSTART).lora.enabled
    cfg = load_config(QUICKSTART, [ON, "lora.rank=8", "lora.target_modules=[linear_qkv,experts]"])
    assert (cfg.lora.rank, cfg.lora.target_modules, cfg.lora.lr) == (8, ["linear_qkv", "experts"], None)


@pytest.mark.claim("lora-refusals")
def test_unknown_target_names_the_valid_ones():
    message = _error(ON, "lora.target_modules=[q_proj]")
    assert "lora.target_modules" in message and "'q_proj'" in message and "linear_qkv" in message


def test_rank_larger_than_a_target_dimension():
    # the quickstart's experts are 64 -> 32 wide
    message = _error(ON, "lora.rank=48", "lora.target_modules=[linear_qkv,experts]")
    assert "lora.rank=48" in message and "experts" in message and "32" in message


def test_target_the_family_lacks():
    message = _error(ON, "lora.target_modules=[linear_fc1]")  # every quickstart layer is MoE
    assert "lora.target_modules" in message and "'linear_fc1'" in message
    assert "'shared_experts'" in _error(ON, "lora.target_modules=[shared_experts]")
    dense = ["model.family=llama", "model.num_experts=0", "model.qk_layernorm=false", "actor.parallel.ep=1"]
    assert "'experts'" in _error(ON, "lora.target_modules=[experts]", *dense)


def test_bad_values_name_their_key():
    assert "lora.rank=0" in _error(ON, "lora.rank=0")
    assert "lora.dropout" in _error(ON, "lora.dropout=1.0")
    assert "lora.lr" in _error(ON, "lora.lr=-1")
    assert "lora.target_modules" in _error(ON, "lora.target_modules=[]")
    assert "lora.ranks" in _error("lora.ranks=4")  # an unknown key
    tp2 = ["actor.parallel.tp=2", "actor.parallel.ep=1", "actor.parallel.dp=1", "actor.parallel.etp=1"]
    # dropout under TP: the masks are keyed, not drawn per rank (tests/megatron_adapters/test_lora.py)
    assert load_config(QUICKSTART, [ON, "lora.dropout=0.1", *tp2]).lora.dropout == 0.1


@pytest.mark.claim("lora-layouts-equal-one-process")
def test_expert_adapters_under_etp_split_their_rank():
    etp2 = ["actor.parallel.ep=1", "actor.parallel.etp=2", "lora.target_modules=[linear_qkv,experts]"]
    assert load_config(QUICKSTART, [ON, "lora.rank=8", *etp2]).lora.rank == 8
    assert "lora.rank=15 with actor.parallel.etp=2" in _error(ON, "lora.rank=15", *etp2)
    assert load_config(QUICKSTART, [ON, "lora.rank=8", "lora.dropout=0.1", *etp2]).lora.dropout == 0.1
    attention_only = ["actor.parallel.ep=1", "actor.parallel.etp=2", "lora.rank=15"]  # no expert adapters
    assert load_config(QUICKSTART, [ON, *attention_only]).lora.rank == 15


def test_preflight_refuses_lora_in_sft_mode():
    from hybridflow.preflight import check_runtime_support

    check_runtime_support(load_config(QUICKSTART, [ON]))
    with pytest.raises(ValueError, match="lora.enabled=true with run.mode=sft"):
        check_runtime_support(load_config(QUICKSTART, [ON, "run.mode=sft"]))


def test_memory_plan_counts_grads_and_state_of_the_adapters_only():
    from hybridflow.memory import training_components

    full = training_components(load_config(QUICKSTART), "actor")[1]
    cfg = load_config(QUICKSTART, [ON, "lora.target_modules=[linear_qkv,linear_proj,experts]"])
    lora = training_components(cfg, "actor")[1]
    # per layer, r=16: qkv 16 * (64 + 128) + proj 16 * (64 + 64); 4 experts / ep=2 of
    # 16 * (64 + 2 * 32) + 16 * (32 + 64); two layers. (benchmarks/lora_cost.py measures the same at ep=1.)
    adapters = 2 * (16 * 192 + 16 * 128 + 2 * (16 * 128 + 16 * 96))
    assert lora["actor grads"] == 4 * adapters
    assert lora["actor optimizer"] < full["actor optimizer"] / 2
    assert lora["actor params"] == full["actor params"] + 2 * adapters


@pytest.mark.claim("lora-refusals")
def test_adapter_pushes_run_on_any_placement_and_are_refused_where_they_cannot():
    from hybridflow.preflight import check_runtime_support

    push = [ON, "lora.push=adapter"]
    attention = "lora.target_modules=[linear_qkv,linear_proj]"
    check_runtime_support(load_config(QUICKSTART, [*push, attention]))
    separate = ["rollout.placement=separate", "rollout.tp=1", "rollout.num_replicas=2"]
    check_runtime_support(load_config(QUICKSTART, [*push, attention, *separate]))
    check_runtime_support(load_config(QUICKSTART, [*push, attention, *separate, "async_rl.mode=one_step_off"]))
    assert "lora.push" in _error("lora.push=adapters")  # not a choice
    cases = {
        "rollout.engine=hf rollout.tp=1 rollout.sync_route=full": "rollout.engine=hf",
        "lora.target_modules=[linear_qkv,experts]": "'experts'",
    }
    for override, named in cases.items():
        cfg = load_config(QUICKSTART, [*push, "lora.target_modules=[linear_qkv]", *override.split()])
        with pytest.raises(ValueError, match="lora.push=adapter") as info:
            check_runtime_support(cfg)
        assert named in str(info.value)
