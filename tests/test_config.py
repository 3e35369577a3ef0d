"""load_config: layering, interpolation, round trips, and one test per user error."""

from pathlib import Path

import pytest

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hybridflow.config import HybridflowConfig, RolloutConfig, enabled_roles, load_config, to_yaml
from hybridflow.model_size import count_parameters

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUICKSTART = str(CONFIGS / "quickstart_cpu.yaml")


def _error(*overrides: str, path: str | None = QUICKSTART) -> str:
    with pytest.raises(ValueError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_defaults_load():
    cfg = load_config(None)
    defaults = HybridflowConfig()  # built directly, ${...} stays unresolved
    assert (cfg.model, cfg.actor, cfg.train) == (defaults.model, defaults.actor, defaults.train)
    assert cfg.run.output_dir == "runs/quickstart"
    assert list(enabled_roles(cfg)) == ["actor"]


def test_yaml_and_overrides_layer_on_the_schema():
    cfg = load_config(
        QUICKSTART,
        ["train.lr=3e-4", "run.name=exp1", "actor.parallel.tp=2", "actor.parallel.ep=1", "actor.parallel.dp=1"],
    )
    assert cfg.model.vocab_size == 320  # from the YAML
    assert cfg.model.norm_eps == 1e-6  # schema default
    assert cfg.train.lr == 3e-4  # override
    assert cfg.actor.parallel == ParallelLayout(tp=2)
    assert cfg.run.output_dir == "runs/exp1"  # ${run.name} resolved after overrides


def test_optional_section_and_role_interpolation():
    cfg = load_config(
        QUICKSTART,
        [
            "model.rope_scaling.factor=4",
            "reference.enabled=true",
            "reference.parallel=${actor.parallel}",
        ],
    )
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 4.0
    assert enabled_roles(cfg) == {"actor": cfg.actor.parallel, "reference": cfg.actor.parallel}


@pytest.mark.parametrize("name", ["quickstart_cpu", "grpo_qwen3_235b", "grpo_deepseek_v3_671b"])
def test_to_yaml_round_trips(name, tmp_path):
    cfg = load_config(str(CONFIGS / f"{name}.yaml"))
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(to_yaml(cfg))
    assert load_config(str(resolved)) == cfg
    assert "${" not in to_yaml(cfg)


@pytest.mark.parametrize(
    "name, total, active",
    [("grpo_qwen3_235b", 235e9, 22e9), ("grpo_deepseek_v3_671b", 671e9, 37e9)],
)
def test_big_configs_match_published_sizes(name, total, active):
    counts = count_parameters(load_config(str(CONFIGS / f"{name}.yaml")).model)
    assert counts["total"] == pytest.approx(total, rel=0.02)
    assert counts["active"] == pytest.approx(active, rel=0.03)


@pytest.mark.claim("config-errors-name-the-key")
def test_tp_must_divide_heads():
    message = _error(
        "model.num_attention_heads=16",
        "model.num_kv_heads=16",
        "actor.parallel.tp=3",
        "actor.parallel.dp=1",
        "actor.parallel.ep=1",
    )
    assert "actor.parallel.tp=3" in message
    assert "model.num_attention_heads=16" in message
    assert "valid tp values: 1, 2, 4, 8, 16" in message


def test_ep_must_divide_experts():
    message = _error("model.num_experts=8", "actor.parallel.ep=3", "actor.parallel.dp=3")
    assert "actor.parallel.ep=3 does not divide model.num_experts=8" in message


def test_disabled_roles_are_not_checked():
    cfg = load_config(QUICKSTART, ["critic.enabled=false", "critic.parallel.tp=3", "critic.parallel.dp=1"])
    assert "critic" not in enabled_roles(cfg)
    assert "critic.parallel.tp=3" in _error("critic.enabled=true", "critic.parallel.tp=3")


def test_a_critic_layout_for_an_algorithm_without_a_critic_is_refused_by_name():
    """Found by the combination matrix (tests/combinations): GRPO with critic.parallel set ran, the
    layout silently unused."""
    message = _error("critic.parallel.tp=2", "critic.parallel.ep=1", "critic.parallel.dp=1")
    assert "critic.parallel is set, but algorithm.name=grpo trains no critic" in message
    assert "ppo, vapo" in message
    assert load_config(
        QUICKSTART, ["algorithm.name=ppo", "critic.parallel.ep=2", "critic.parallel.dp=2"]
    ).critic.enabled


@pytest.mark.claim("config-errors-name-the-key")
def test_misspelled_key_suggests_the_right_one():
    message = _error("train.lrr=1e-4")
    assert "unknown config key 'train.lrr'" in message
    assert "did you mean 'lr'?" in message
    assert "min_lr" in message  # lists the valid keys


def test_misspelled_key_in_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hiden_size: 32\n")
    message = _error(path=str(bad))
    assert "unknown config key 'model.hiden_size'" in message
    assert "did you mean 'hidden_size'?" in message
    assert str(bad) in message


def test_negative_learning_rate():
    assert _error("train.lr=-0.001") == "train.lr=-0.001 must be > 0"


def test_wrong_type():
    assert "train.lr: expected float, got 'abc'" in _error("train.lr=abc")
    assert "actor.parallel.tp: expected int, got 2.5" in _error("actor.parallel.tp=2.5")


def test_scalar_where_a_section_is_expected():
    assert "actor.parallel: expected a mapping with keys tp, pp" in _error("actor.parallel=4")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.num_layers=[1,2]", "model.num_layers: expected int, got [1, 2]"),
        ("data.train_files=5", "data.train_files: expected a list of str, e.g. data.train_files=[a, b], got 5"),
        (
            "data.train_files={a: 1}",
            "data.train_files: expected a list of str, e.g. data.train_files=[a, b], got {'a': 1}",
        ),
        ("data.train_files.0=a.jsonl", "data.train_files: expected a list of str"),
        ("data.train_files=[a.jsonl, {b: 1}]", "data.train_files[1]: expected str, got {'b': 1}"),
        ("data.train_files=[a.jsonl, [b]]", "data.train_files[1]: expected str, got ['b']"),
        ("data.train_files=[null]", "data.train_files[0]: expected str, got null"),
        ("reward.kwargs=[1]", "reward.kwargs: expected a mapping, e.g. reward.kwargs={name: value}, got [1]"),
        ("reward.kwargs=abc", "reward.kwargs: expected a mapping"),
        ("run.name={a: 1}", "run.name: expected str, got {'a': 1}"),
        ("rollout.enable_dp_attention=5", "rollout.enable_dp_attention: expected bool, got 5"),
        ("algorithm.clip_ratio_high=[1]", "algorithm.clip_ratio_high: expected float or null, got [1]"),
        ("train={a: 1}", "unknown config key 'train.a'"),
        ("run=[1, 2]", "run: expected a mapping with keys name, output_dir"),
        (
            "data.train_files=${run.name}",
            "data.train_files: expected a list of str, e.g. data.train_files=[a, b], got 'quickstart_cpu'",
        ),
        ("run.name=${oops", "override 'run.name=${oops' does not parse"),
    ],
)
@pytest.mark.claim("config-errors-name-the-key")
def test_a_value_of_the_wrong_kind_is_one_line_naming_the_key(override, expected):
    message = _error(override)
    assert expected in message and "\n" not in message


def test_a_wrong_kind_in_the_yaml_file_names_the_key_and_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_files:\n    a: 1\nreward:\n  kwargs: [1]\n")
    message = _error(path=str(bad))
    assert message == (
        f"data.train_files: expected a list of str, e.g. data.train_files=[a, b], got {{'a': 1}} (in config file {bad})"
    )
    assert load_config(QUICKSTART, ["rollout.enable_dp_attention=1"]).rollout.enable_dp_attention is True


def test_unknown_family_lists_valid_ones():
    message = _error("model.family=gpt2")
    assert "model.family='gpt2'" in message
    assert "llama, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3" in message


@pytest.mark.claim("config-errors-name-the-key")
def test_nested_section_errors_carry_their_path():
    assert _error("model.rope_scaling.type=ntk").startswith("model.rope_scaling.type='ntk'")
    assert _error("run.tracking.trackers=[mlflow,neptune]") == (
        "run.tracking.trackers='neptune' is not one of: mlflow, tensorboard, wandb"
    )
    assert _error("actor.parallel.pp=0") == "actor.parallel.pp=0 must be >= 1"


def test_cross_field_errors_name_both_keys():
    message = _error("train.global_batch_size=9")
    assert message == "train.global_batch_size=9 is not a multiple of train.micro_batch_size=16"
    assert "model.moe_top_k=8 must be <= model.num_experts=4" in _error("model.moe_top_k=8")


def test_family_rules():
    assert "set model.num_experts > 0" in _error("model.num_experts=0")
    assert "model.family='llama' is dense" in _error("model.family=llama")
    assert "model.family='deepseek_v3' uses MLA" in _error("model.family=deepseek_v3")


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Llama / Qwen3-MoE attention_bias also biases o_proj, which megatron-core cannot hold alone
        (
            ("model.family=llama", "model.num_experts=0", "model.qk_layernorm=false", "model.attention_bias=true"),
            "model.attention_bias=true with model.family='llama'",
        ),
        (("model.attention_bias=true",), "model.attention_bias=true with model.family='qwen3_moe'"),
        (("model.qk_layernorm=false",), "model.qk_layernorm=false with model.family='qwen3_moe'"),
        (
            ("model.family=qwen2", "model.num_experts=0", "model.qk_layernorm=false", "model.attention_bias=false"),
            "model.attention_bias=false with model.family='qwen2'",
        ),
        (("model.first_k_dense_layers=1",), "SGLang builds every layer of this family as an MoE"),
        (("model.num_shared_experts=1",), "model.num_shared_experts=1 with model.family='qwen3_moe'"),
        (
            ("model.router_score_function=sigmoid", "model.router_expert_bias=true"),
            "model.router_expert_bias=true with model.family='qwen3_moe'",
        ),
        (
            ("model.family=mixtral", "model.qk_layernorm=false", "model.norm_topk_prob=false"),
            "model.norm_topk_prob=false with model.family='mixtral'",
        ),
    ],
)
def test_flags_the_family_fixes_are_refused(overrides, message):
    # quickstart is qwen3_moe with qk_layernorm: true
    error = _error(*overrides)
    assert message in error and "; set model." in error


def test_family_flags_default_to_the_family():
    assert ModelConfig().qk_layernorm and not ModelConfig().attention_bias  # qwen3_moe
    qwen2 = ModelConfig(family="qwen2", num_experts=0)
    assert qwen2.attention_bias and not qwen2.qk_layernorm
    assert load_config(QUICKSTART, ["model.qk_layernorm=null"]).model.qk_layernorm


def test_router_rules():
    assert "router_score_function='sigmoid'" in _error("model.router_expert_bias=true")
    assert "set both or neither" in _error("model.router_num_groups=2")
    message = _error("model.router_num_groups=3", "model.router_group_topk=1")
    assert "model.router_num_groups=3 does not divide model.num_experts=4" in message


@pytest.mark.claim("plan-names-the-world-mismatch")
def test_world_size_mismatch():
    cfg = load_config(QUICKSTART, ["actor.parallel.tp=2", "actor.parallel.ep=1", "actor.parallel.dp=1"])
    with pytest.raises(ValueError) as info:
        cfg.actor.parallel.check_world_size(4, prefix="actor.parallel")
    assert str(info.value) == ("world size 4 does not match actor.parallel: tp*pp*cp*dp = 2*1*1*1 = 2")


def test_unresolvable_interpolation():
    assert _error("run.output_dir=${run.nme}").startswith("run.output_dir:")


def test_missing_file():
    assert _error(path="nope/missing.yaml") == "config file not found: nope/missing.yaml"


def test_malformed_override():
    assert "override 'train.lr' must look like key=value" in _error("train.lr")


def test_model_properties():
    mla = ModelConfig(family="deepseek_v3", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    assert mla.is_mla and mla.is_moe
    assert ModelConfig(hidden_size=64, num_attention_heads=4).kv_channels == 16
    assert ModelConfig(head_dim=32).kv_channels == 32
    assert not ModelConfig(family="qwen2", num_experts=0).is_moe


# --------------------------------------------------------------------------- rollout


@pytest.mark.parametrize(
    "name, tp, num_replicas",
    [
        ("quickstart_cpu", 2, 1),
        ("grpo_qwen3_235b", 16, 8),
        ("grpo_deepseek_v3_671b", 32, 8),
    ],
)
def test_rollout_sections_fit_the_actor(name, tp, num_replicas):
    cfg = load_config(str(CONFIGS / f"{name}.yaml"))
    assert (cfg.rollout.tp, cfg.rollout.num_replicas) == (tp, num_replicas)
    assert cfg.rollout.placement == "colocated"
    assert cfg.rollout.num_ranks <= cfg.actor.parallel.world_size


def test_rollout_tp_must_split_the_heads():
    message = _error("rollout.tp=3")
    assert message.startswith("rollout.tp=3 gives attention tp 3")
    assert "model.num_attention_heads=4 and model.num_kv_heads=2" in message
    assert "valid rollout.tp values: 1, 2, 4" in message
    assert "sglang." not in message


def test_rollout_ep_must_divide_experts():
    message = _error("rollout.placement=separate", "rollout.tp=4", "rollout.ep=4", "model.num_experts=6")
    assert "rollout.ep=4 does not divide the 6 physical experts" in message
    assert "valid ep values: 1, 2" in message


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.engine=trtllm", "rollout.engine='trtllm' is not one of: sglang, hf, vllm"),
        ("rollout.placement=remote", "rollout.placement='remote' is not one of: colocated, separate"),
        ("rollout.dtype=int8", "rollout.dtype='int8' is not one of: bfloat16, float16, float32"),
        ("rollout.num_replicas=0", "rollout.num_replicas=0 must be > 0"),
        ("rollout.dp_size=2", "rollout.dp_size=2 needs rollout.enable_dp_attention=true"),
        ("rollout.moe_dp=2", "rollout.moe_dp=2: SGLang 0.5.23 runs MoE data parallelism only with attention context"),
    ],
)
def test_rollout_bad_values(override, expected):
    assert expected in _error(override)


def test_rollout_dp_attention_needs_a_family_that_has_it():
    message = _error(
        "model.family=mixtral", "model.qk_layernorm=false", "rollout.enable_dp_attention=true", "rollout.dp_size=2"
    )
    assert message.startswith("rollout.enable_dp_attention=true: SGLang builds mixtral attention")


def test_hf_rollout_is_unsharded():
    assert (
        load_config(
            QUICKSTART, ["rollout.engine=hf", "rollout.tp=1", "rollout.sync_route=full", "rollout.num_replicas=2"]
        ).rollout.num_ranks
        == 2
    )
    message = _error("rollout.engine=hf")  # the quickstart's tp=2
    assert message.startswith("rollout.tp=2 needs rollout.engine=sglang")
    message = _error("rollout.engine=hf", "rollout.tp=1")  # the quickstart's sliced route
    assert message.startswith("rollout.engine=hf takes full weight pushes only: set rollout.sync_route=full")


def test_the_gpu_quickstart_loads_and_plans():
    from hybridflow.lowering import lower

    cfg = load_config(str(Path(QUICKSTART).with_name("quickstart_gpu.yaml")))
    assert (cfg.rollout.engine, cfg.rollout.sync_route, cfg.run.tracking.trackers) == ("hf", "full", [])
    assert cfg.actor.parallel.world_size == 1
    assert lower(cfg, with_reshard=True).weight_syncs[0].stats is not None


def test_colocated_rollout_must_fit_on_the_actor_gpus():
    message = _error("rollout.num_replicas=2")
    assert "rollout.tp*num_replicas = 2*2 = 4 engine ranks" in message
    assert "actor.parallel fills only 2" in message
    assert "rollout.placement=separate" in message
    cfg = load_config(QUICKSTART, ["rollout.num_replicas=2", "rollout.placement=separate"])
    assert cfg.rollout.num_ranks == 4


def test_rollout_built_directly_names_bare_keys():
    with pytest.raises(ValueError) as info:
        RolloutConfig(dp_size=2)
    assert str(info.value).startswith("dp_size=2 needs enable_dp_attention=true")


def test_moe_section_defaults_and_errors():
    cfg = load_config(QUICKSTART, ["moe.routing_replay=r2", "moe.freeze_router=true"])
    assert cfg.moe.routing_replay == "r2" and cfg.moe.bias_update_rate == 0.0  # frozen: no bias update
    assert load_config(QUICKSTART).moe.bias_update_rate == 1e-3
    assert "moe.routing_replay='r4' is not one of: off, r2, r3" in _error("moe.routing_replay=r4")
    assert "moe.z_loss_coef=-1.0 must be >= 0" in _error("moe.z_loss_coef=-1")
    dense = (
        "model.family=llama",
        "model.num_experts=0",
        "model.qk_layernorm=false",
        "actor.parallel.ep=1",
        "actor.parallel.dp=2",
    )
    assert "moe.routing_replay=r2 needs an MoE model" in _error(*dense, "moe.routing_replay=r2")
    assert "moe.freeze_router=True needs an MoE model" in _error(*dense, "moe.freeze_router=true")


@pytest.mark.claim("yaml-words")
def test_yaml_11_boolean_words_are_read_as_the_word_typed(tmp_path):
    """``off`` / ``on`` / ``yes`` / ``no``, unquoted in a file or an override: a choice gets the word
    (YAML 1.1 would make it False, refused as 'False'), a boolean setting reads it as one, and
    free text keeps it; true / false stay booleans."""
    config = tmp_path / "words.yaml"
    config.write_text(
        "moe:\n  routing_replay: off\n  freeze_router: On\nsft:\n  export_hf: no\ndata:\n  system_prompt: YES\n"
    )
    cfg = load_config(str(config))
    assert (cfg.moe.routing_replay, cfg.moe.freeze_router, cfg.sft.export_hf) == ("off", True, False)
    assert cfg.data.system_prompt == "YES"
    cfg = load_config(QUICKSTART, ["moe.routing_replay=off", "sft.export_hf=off", "moe.freeze_router=yes"])
    assert (cfg.moe.routing_replay, cfg.sft.export_hf, cfg.moe.freeze_router) == ("off", False, True)
    assert "async_rl.mode='off' is not one of: sync, one_step_off, async" in _error("async_rl.mode=off")
    assert "moe.routing_replay='False' is not one of: off, r2, r3" in _error("moe.routing_replay=false")
    assert load_config(str(config), ["moe.routing_replay=r2"]).moe.routing_replay == "r2"  # later layers win


def test_algorithm_accepts_the_verl_losses_aggregations_and_kl_kinds():
    cfg = load_config(
        QUICKSTART,
        (
            "algorithm.policy_loss=clip_cov",
            "algorithm.loss_agg_mode=token-sum",
            "algorithm.kl_type=low_var_kl+",
            "algorithm.log_ratio_clamp=null",
            "algorithm.adv_estimator=opo",
        ),
    )
    algorithm = cfg.algorithm
    assert (algorithm.loss_agg_mode, algorithm.kl_type, algorithm.log_ratio_clamp) == ("token-sum", "low_var_kl+", None)
    defaults = (
        algorithm.clip_cov_ratio,
        algorithm.clip_cov_lb,
        algorithm.clip_cov_ub,
        algorithm.kl_cov_ratio,
        algorithm.ppo_kl_coef,
        algorithm.sapo_tau_pos,
        algorithm.sapo_tau_neg,
    )
    assert defaults == (0.0002, 1.0, 5.0, 0.0002, 0.1, 1.0, 1.05)  # verl's


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algorithm.clip_cov_ratio=0", "algorithm.clip_cov_ratio=0.0 must be in (0, 1]"),
        ("algorithm.kl_cov_ratio=2", "algorithm.kl_cov_ratio=2.0 must be in (0, 1]"),
        ("algorithm.clip_cov_lb=6", "algorithm.clip_cov_lb=6.0 must be below algorithm.clip_cov_ub=5.0"),
        ("algorithm.ppo_kl_coef=-1", "algorithm.ppo_kl_coef=-1.0 must be >= 0"),
        ("algorithm.sapo_tau_pos=0", "algorithm.sapo_tau_pos=0.0 must be > 0"),
        ("algorithm.log_ratio_clamp=0", "algorithm.log_ratio_clamp=0.0 must be > 0"),
        ("algorithm.kl_type=k2+", "algorithm.kl_type='k2+' is not one of"),
    ],
)
def test_algorithm_loss_knobs_bad_values(override, expected):
    assert expected in _error(override)
