"""Algorithm specs and their graphs, built from the quickstart config for every algorithm."""

import ast
import dataclasses
import functools
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.algorithms import (
    ESTIMATORS,
    algorithm_names,
    algorithm_spec,
    build_graph,
    check_roles,
    check_sampling,
    graph_from_spec,
    placed_roles,
    register_algorithm,
)
from hybridflow.config import ALGORITHMS, HybridflowConfig, load_config
from hybridflow.graph import Graph

QUICKSTART = "configs/quickstart_cpu.yaml"
OPS = {
    "generate",
    "generate_greedy",
    "reward",
    "filter_groups",
    "old_logprob",
    "ref_logprob",
    "values",
    "token_rewards",
    "advantages",
    "update_critic",
    "update_actor",
    "sync_weights",
}
WITH_CRITIC = {"ppo", "vapo"}
CRITIC_NODES = {"values", "update_critic"}
OPTIONAL_NODES = {"generate_greedy", "baseline_reward", "filter_groups", "ref_logprob", "values", "update_critic"}


@functools.cache
def _cfg(name: str, *overrides: str) -> HybridflowConfig:
    """Quickstart config running ``name``, with the roles it needs enabled."""
    roles = ("critic.enabled=true",) if name in WITH_CRITIC else ()
    return load_config(QUICKSTART, (f"algorithm.name={name}",) + roles + overrides)


def _graph(name: str, *overrides: str) -> Graph:
    return build_graph(_cfg(name, *overrides))


def _node_names(graph: Graph) -> set[str]:
    return {node.name for node in graph.nodes}


@pytest.mark.claim("algorithms-registered-and-run")
def test_the_registry_holds_exactly_the_configs_algorithm_names():
    assert set(algorithm_names()) == set(ALGORITHMS)


def _registered(module: str, decorator: str) -> set[str]:
    """Names registered with ``@decorator("name")`` in hybridflow/algorithms/<module>.py, read
    without importing it (it imports torch)."""
    path = Path(__file__).resolve().parents[2] / "hybridflow" / "algorithms" / f"{module}.py"
    if not path.exists():
        pytest.skip(f"{path} is not written yet")
    calls = (node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call))
    return {
        call.args[0].value
        for call in calls
        if getattr(call.func, "id", None) == decorator and call.args and isinstance(call.args[0], ast.Constant)
    }


def test_the_graph_knows_exactly_the_registered_estimators():
    assert set(ESTIMATORS) == _registered("estimators", "register_estimator")


def test_every_algorithm_names_a_registered_policy_loss():
    losses = {algorithm_spec(_cfg(name)).policy_loss for name in algorithm_names()}
    assert losses <= _registered("losses", "register_policy_loss")


def test_importing_the_algorithms_package_does_not_import_torch():
    code = "import sys, hybridflow.algorithms; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.claim("algorithm-is-a-graph", "graph-checked-before-start")
@pytest.mark.parametrize("name", algorithm_names())
def test_every_graph_is_a_valid_dag_ending_in_sync_weights(name):
    graph = _graph(name)
    graph.validate(placed_roles(_cfg(name)))
    order = graph.topological_order()
    assert order[0].name == "generate" and order[-1].name == "sync_weights"
    assert [node.name for node in graph.sinks()] == ["sync_weights"]
    assert {node.op for node in graph.nodes} <= OPS
    update = graph.node("update_actor")
    assert {"advantages", "old_logprobs"} <= set(update.inputs)
    assert update.option("policy_loss") == algorithm_spec(_cfg(name)).policy_loss


@pytest.mark.parametrize("name", algorithm_names())
def test_critic_nodes_appear_exactly_for_critic_algorithms(name):
    graph = _graph(name)
    assert (CRITIC_NODES <= _node_names(graph)) == (name in WITH_CRITIC)
    assert (CRITIC_NODES & _node_names(graph) == set()) == (name not in WITH_CRITIC)
    advantage_inputs = graph.node("advantages").inputs
    assert ("values" in advantage_inputs) == (name in WITH_CRITIC)


def test_grpo_runs_only_the_core_nodes():
    assert _node_names(_graph("grpo")) & OPTIONAL_NODES == set()
    assert _graph("grpo").node("advantages").option("estimator") == "grpo"


def test_ppo_trains_the_critic_on_the_returns_and_waits_for_it_before_syncing():
    graph = _graph("ppo")
    assert graph.node("update_critic").inputs == ("responses", "values", "returns")
    assert "critic_metrics" in graph.node("sync_weights").inputs


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo"])
@pytest.mark.parametrize("kl_loss, kl_reward", [(0.0, 0.0), (0.1, 0.0), (0.0, 0.1), (0.1, 0.1)])
def test_reference_nodes_appear_iff_a_kl_coefficient_is_positive(name, kl_loss, kl_reward):
    graph = _graph(
        name, "reference.enabled=true", f"algorithm.kl_loss_coef={kl_loss}", f"algorithm.kl_reward_coef={kl_reward}"
    )
    assert ("ref_logprob" in _node_names(graph)) == (kl_loss > 0 or kl_reward > 0)
    assert ("ref_logprobs" in graph.node("update_actor").inputs) == (kl_loss > 0)
    assert graph.node("update_actor").option("kl_loss") == (kl_loss > 0)
    token_rewards = graph.node("token_rewards")
    assert ("ref_logprobs" in token_rewards.inputs) == (kl_reward > 0)
    assert ("old_logprobs" in token_rewards.inputs) == (kl_reward > 0)


def test_dapo_filters_groups_before_the_per_sample_nodes():
    graph = _graph("dapo")
    assert graph.node("filter_groups").inputs == ("responses", "scores")
    assert graph.node("filter_groups").option("max_rounds") == 3
    for name in ("old_logprob", "token_rewards", "advantages", "update_actor"):
        assert "kept" in graph.node(name).inputs
    order = [node.name for node in graph.topological_order()]
    assert order.index("filter_groups") < order.index("old_logprob")


def test_dapo_fills_in_clip_higher_dynamic_sampling_and_overlong_shaping():
    spec = algorithm_spec(_cfg("dapo"))
    assert spec.clip_ratio_high == 0.28 and spec.dynamic_sampling and spec.overlong_shaping
    budget = _cfg("dapo").data.max_response_length
    assert spec.overlong_buffer_len == max(1, budget // 5)  # the paper's fifth of the budget
    assert ("algorithm.clip_ratio_high", 0.28) in spec.filled
    assert "algorithm.clip_ratio_high=0.28: dapo's value" in "\n".join(spec.describe())
    assert _graph("dapo").node("update_actor").option("clip_ratio_high") == 0.28
    assert _graph("dapo").node("token_rewards").option("overlong_buffer_len") == max(1, budget // 5)


@pytest.mark.claim("algorithm-fills-unset-knobs")
def test_a_configured_value_beats_the_algorithms_own():
    spec = algorithm_spec(_cfg("dapo", "algorithm.clip_ratio_high=0.25", "algorithm.overlong_buffer_len=2"))
    assert (spec.clip_ratio_high, spec.overlong_buffer_len) == (0.25, 2)
    assert [key for key, _ in spec.filled] == ["algorithm.dynamic_sampling"]


@pytest.mark.claim("algorithm-fills-unset-knobs")
def test_a_written_value_wins_even_when_it_equals_the_schema_default():
    """DAPO's paper values are switched off by writing the 'off' value, and VAPO's by 0."""
    spec = algorithm_spec(_cfg("dapo", "algorithm.dynamic_sampling=false", "algorithm.overlong_buffer_len=0"))
    assert not spec.dynamic_sampling and spec.overlong_buffer_len == 0 and not spec.overlong_shaping
    assert [key for key, _ in spec.filled] == ["algorithm.clip_ratio_high"]
    assert "filter_groups" not in _node_names(_graph("dapo", "algorithm.dynamic_sampling=false"))
    spec = algorithm_spec(
        _cfg("vapo", "algorithm.lm_loss_coef=0", "algorithm.length_adaptive_lam_alpha=0", "critic.enabled=true")
    )
    assert spec.lm_loss_coef == 0.0 and not spec.lm_loss and spec.length_adaptive_lam_alpha is None
    assert ("algorithm.critic_lam", 1.0) in spec.filled
    plain = algorithm_spec(_cfg("grpo"))  # an algorithm without values of its own: all off
    assert (plain.dynamic_sampling, plain.overlong_buffer_len, plain.lm_loss_coef) == (False, 0, 0.0)
    assert plain.filled == ()


def test_grpo_keeps_the_symmetric_clip_and_any_algorithm_may_sample_dynamically():
    assert algorithm_spec(_cfg("grpo")).clip_ratio_high == 0.2
    graph = _graph("grpo", "algorithm.dynamic_sampling=true")
    assert "filter_groups" in _node_names(graph)


def test_remax_scores_a_greedy_baseline():
    graph = _graph("remax")
    assert graph.node("generate_greedy").outputs == ("baseline_responses",)
    baseline = graph.node("baseline_reward")
    assert baseline.op == "reward"
    assert baseline.inputs == ("baseline_responses", "answers")
    assert dict(baseline.options) == {"responses_field": "baseline_responses", "scores_field": "baseline_scores"}
    assert "baseline_scores" in graph.node("advantages").inputs


def test_downweighted_stale_samples_reach_the_advantages_through_an_edge_the_plan_prints():
    async_run = ["rollout.placement=separate", "async_rl.mode=one_step_off", "async_rl.on_stale=downweight"]
    graph = build_graph(_cfg("grpo", *async_run))
    assert "staleness_weights" in graph.node("generate").outputs
    assert ("generate", "advantages", "staleness_weights") in graph.edges()
    assert "staleness_weights" in graph.to_mermaid()
    dropping = build_graph(_cfg("grpo", *async_run[:2]))  # on_stale=drop: no weights to hand on
    assert all("staleness_weights" not in node.outputs for node in dropping.nodes)


def test_remax_with_dynamic_sampling_resamples_the_baseline_with_its_group():
    graph = _graph("remax", "algorithm.dynamic_sampling=true")
    assert graph.node("filter_groups").inputs == ("responses", "scores", "baseline_scores")


def test_vapo_uses_decoupled_length_adaptive_gae_and_an_lm_loss():
    spec = algorithm_spec(_cfg("vapo"))
    assert (spec.estimator, spec.critic_lam, spec.length_adaptive_lam_alpha) == ("gae", 1.0, 0.05)
    assert spec.lm_loss and spec.clip_ratio_high == 0.28
    assert ("algorithm.value_pretrain_steps", 50) in spec.recommended
    update = _graph("vapo").node("update_actor")
    assert "scores" in update.inputs and update.option("lm_loss_coef") == 0.1
    assert _graph("vapo").node("advantages").option("length_adaptive_lam_alpha") == 0.05


def test_vapo_value_pretraining_delays_the_actor():
    spec = algorithm_spec(_cfg("vapo", "algorithm.value_pretrain_steps=7"))
    assert spec.critic_warmup_steps == 7 and not spec.recommended
    assert _graph("vapo", "algorithm.value_pretrain_steps=7").node("update_actor").option("start_step") == 7


def test_gspo_uses_its_loss_and_sequence_mean_with_its_clip_as_advice():
    spec = algorithm_spec(_cfg("gspo"))
    assert (spec.estimator, spec.policy_loss, spec.loss_agg_mode) == ("grpo", "gspo", "seq-mean-token-mean")
    assert dict(spec.recommended) == {"algorithm.clip_ratio_low": 3e-4, "algorithm.clip_ratio_high": 4e-4}
    followed = algorithm_spec(_cfg("gspo", "algorithm.clip_ratio_low=0.0003"))
    assert dict(followed.recommended) == {"algorithm.clip_ratio_high": 4e-4}


@pytest.mark.parametrize(
    "name, estimator, loss",
    [
        ("gpg", "gpg", "gpg"),
        ("cispo", "grpo", "cispo"),
        ("rloo", "rloo", "vanilla"),
        ("reinforce_plus_plus", "reinforce_plus_plus", "vanilla"),
        ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline", "vanilla"),
    ],
)
def test_estimator_and_loss_of_each_critic_free_algorithm(name, estimator, loss):
    spec = algorithm_spec(_cfg(name))
    assert (spec.estimator, spec.policy_loss, spec.needs_critic) == (estimator, loss, False)


@pytest.mark.claim("algorithms-registered-and-run")
def test_pf_ppo_reweights_the_actor_update_by_scores():
    update = _graph("grpo", "algorithm.pf_ppo=pow").node("update_actor")
    assert "scores" in update.inputs and update.option("pf_ppo") == "pow"


def test_overrides_replace_estimator_loss_and_aggregation():
    cfg = _cfg(
        "grpo",
        "algorithm.adv_estimator=rloo",
        "algorithm.policy_loss=gspo",
        "algorithm.loss_agg_mode=seq-mean-token-sum",
    )
    update = build_graph(cfg).node("update_actor")
    assert build_graph(cfg).node("advantages").option("estimator") == "rloo"
    assert (update.option("policy_loss"), update.option("loss_agg_mode")) == ("gspo", "seq-mean-token-sum")


@pytest.mark.parametrize("estimator", ["opo", "grpo_passk"])
def test_group_estimators_are_selectable_and_need_groups(estimator):
    graph = _graph("grpo", f"algorithm.adv_estimator={estimator}")
    assert graph.node("advantages").option("estimator") == estimator
    assert not CRITIC_NODES & _node_names(graph)
    cfg = _cfg("grpo", f"algorithm.adv_estimator={estimator}", "rollout.n=1")
    with pytest.raises(ValueError, match="rollout.n=1: set rollout.n >= 2"):
        check_sampling(cfg, algorithm_spec(cfg))


def test_an_estimator_override_brings_the_nodes_it_needs():
    assert CRITIC_NODES <= _node_names(_graph("grpo", "algorithm.adv_estimator=gae", "critic.enabled=true"))
    assert "generate_greedy" in _node_names(_graph("grpo", "algorithm.adv_estimator=remax"))
    assert not CRITIC_NODES & _node_names(_graph("ppo", "algorithm.adv_estimator=grpo"))


def test_an_unknown_estimator_override_lists_the_known_ones():
    with pytest.raises(ValueError) as error:
        algorithm_spec(_cfg("grpo", "algorithm.adv_estimator=vtrace"))
    assert "'vtrace'" in str(error.value) and ", ".join(ESTIMATORS) in str(error.value)
    assert "algorithm.adv_estimator" in str(error.value)


def test_an_unregistered_name_lists_the_registered_ones():
    cfg = dataclasses.replace(_cfg("grpo"))
    cfg.algorithm = dataclasses.replace(cfg.algorithm)
    cfg.algorithm.name = "trpo"  # the config's own check would reject it first
    with pytest.raises(
        ValueError, match="algorithm.name='trpo' is not a registered algorithm; choose one of: ppo, grpo"
    ):
        algorithm_spec(cfg)


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_algorithm("grpo")(lambda cfg: None)


def test_a_critic_algorithm_with_the_critic_switched_off_names_the_key():
    build_graph(load_config(QUICKSTART, ["algorithm.name=ppo"]))  # unset: the critic is built
    cfg = load_config(QUICKSTART, ["algorithm.name=ppo", "critic.enabled=false"])
    with pytest.raises(ValueError) as error:
        build_graph(cfg)
    message = str(error.value)
    assert message.startswith("algorithm.name=ppo (advantage estimator gae) needs a critic")
    assert "remove critic.enabled=false" in message


def test_an_estimator_override_needing_a_critic_names_the_override():
    cfg = _cfg("grpo", "algorithm.adv_estimator=gae", "critic.enabled=false")
    with pytest.raises(
        ValueError,
        match=r"algorithm.adv_estimator=gae needs a critic: "
        r"remove critic.enabled=false",
    ):
        check_roles(cfg, algorithm_spec(cfg))


@pytest.mark.parametrize("key", ["kl_loss_coef", "kl_reward_coef"])
def test_a_kl_coefficient_without_the_reference_names_the_key(key):
    cfg = _cfg("grpo", f"algorithm.{key}=0.05")
    with pytest.raises(ValueError) as error:
        build_graph(cfg)
    assert str(error.value).startswith(f"algorithm.{key}=0.05 needs the reference policy")
    assert "set reference.enabled=true" in str(error.value)


def test_a_disabled_actor_is_named():
    cfg = _cfg("grpo", "actor.enabled=false")
    with pytest.raises(ValueError, match="algorithm.name=grpo trains the actor: set actor.enabled=true"):
        check_roles(cfg, algorithm_spec(cfg))


def test_idle_roles_are_warned_about(caplog):
    cfg = _cfg("grpo", "critic.enabled=true", "reference.enabled=true")
    with caplog.at_level(logging.WARNING, logger="hybridflow.algorithms.recipes"):
        check_roles(cfg, algorithm_spec(cfg))
    assert "critic.enabled=true, but algorithm.name=grpo" in caplog.text
    assert "reference.enabled=true, but" in caplog.text


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("grpo", ("rollout.n=1",), "compares the responses to one prompt, but rollout.n=1"),
        ("dapo", ("rollout.n=1",), "compares the responses"),
        (
            "remax",
            ("rollout.n=1", "algorithm.dynamic_sampling=true"),
            "dynamic sampling (algorithm.name=remax) drops groups",
        ),
        (
            "grpo",
            ("algorithm.overlong_buffer_len=8", "data.max_response_length=8"),
            "algorithm.overlong_buffer_len=8 must be smaller than data.max_response_length=8",
        ),
    ],
)
def test_sampling_that_cannot_feed_the_algorithm_is_rejected(name, overrides, message):
    cfg = _cfg(name, *overrides)
    with pytest.raises(ValueError) as error:
        check_sampling(cfg, algorithm_spec(cfg))
    assert message in str(error.value)


def test_one_response_per_prompt_suits_remax_and_ppo():
    _graph("remax", "rollout.n=1")
    _graph("ppo", "rollout.n=1")


def test_graphs_are_values():
    spec = algorithm_spec(_cfg("dapo"))
    assert graph_from_spec(spec) == graph_from_spec(spec)
    assert hash(graph_from_spec(spec)) == hash(graph_from_spec(spec))


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_routing_replay_hands_the_routes_from_old_logprob_to_the_update(mode):
    graph = _graph("dapo", f"moe.routing_replay={mode}")
    assert "routed_experts" in graph.node("old_logprob").outputs
    assert graph.node("old_logprob").option("routing_replay") == mode
    assert "routed_experts" in graph.node("update_actor").inputs
    assert "routed_experts" not in {f for n in _graph("dapo").nodes for f in n.inputs + n.outputs}


@pytest.mark.claim("algorithm-fills-unset-knobs")
def test_the_critic_is_built_exactly_when_the_estimator_reads_values():
    """config.needs_values (which resolves critic.enabled=None) agrees with every spec, and the
    critic takes the actor's layout unless one is written."""
    from hybridflow.config import ALGORITHMS

    def unset(*overrides):  # the quickstart, critic.enabled left to the algorithm
        return load_config(QUICKSTART, overrides)

    for name in ALGORITHMS:
        cfg = unset(f"algorithm.name={name}")
        assert cfg.critic.enabled == algorithm_spec(cfg).needs_critic, name
        assert cfg.critic.parallel == cfg.actor.parallel == cfg.reference.parallel
    assert unset("algorithm.adv_estimator=gae").critic.enabled
    assert not unset("algorithm.name=ppo", "algorithm.adv_estimator=grpo").critic.enabled
    assert not unset("algorithm.name=ppo", "critic.enabled=false").critic.enabled  # a written value wins


@pytest.mark.claim("ops-read-printed-options")
def test_a_knob_the_algorithm_never_reads_is_named():
    from hybridflow.algorithms.recipes import idle_options

    cfg = _cfg("grpo", "algorithm.value_clip=0.3", "algorithm.norm_adv_by_std=false", "algorithm.lam=0.9")
    lines = idle_options(cfg, algorithm_spec(cfg))
    assert lines == [
        "algorithm.value_clip=0.3 has no effect: algorithm.name=grpo (advantage estimator grpo) (policy loss "
        "vanilla) does not read it",
        "algorithm.lam=0.9 has no effect: algorithm.name=grpo (advantage estimator grpo) (policy loss vanilla) "
        "does not read it",
    ]  # norm_adv_by_std is grpo's own knob
    ppo = _cfg("ppo", "algorithm.value_clip=0.3", "algorithm.lam=0.9")
    assert idle_options(ppo, algorithm_spec(ppo)) == []
    assert (
        "rollout_correction_upper"
        in idle_options(*(lambda c: (c, algorithm_spec(c)))(_cfg("grpo", "algorithm.rollout_correction_upper=3.0")))[0]
    )


def _options_each_op_reads() -> dict[str, set[str]]:
    """``node.option("key")`` literals in each op of ``hybridflow/runtime/ops.py``, with those of
    the module's functions it calls (the loss builders)."""
    import hybridflow.runtime.ops as ops

    tree = ast.parse(Path(ops.__file__).read_text())
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}

    def reads(name: str, seen: set[str]) -> set[str]:
        seen.add(name)
        keys, calls = set(), set()
        for n in ast.walk(functions[name]):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "option":
                keys.add(n.args[0].value)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in functions:
                calls.add(n.func.id)
        for callee in calls - seen:
            keys |= reads(callee, seen)
        return keys

    by_op = {}
    for f in functions.values():
        for d in f.decorator_list:
            if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "op":
                by_op[d.args[0].value] = reads(f.name, set())
    return by_op


@pytest.mark.claim("ops-read-printed-options")
def test_ops_take_their_settings_from_the_graph_they_run():
    """What ``hybridflow plan`` prints as a node's options is what its op runs with: every option
    a graph builder writes is read by the node's op, and no op reads one no builder writes."""
    reads = _options_each_op_reads()
    written: dict[str, set[str]] = {op: set() for op in reads}
    for name in algorithm_names():
        for extra in (
            (),
            ("moe.routing_replay=r2",),
            ("algorithm.kl_reward_coef=0.01", "reference.enabled=true"),
            (
                "reward_model.path=rm",
                "distillation.teacher_path=teacher",
                "judge.path=judge",
                "algorithm.dynamic_sampling=false",
            ),
            # on their own GPUs: request, then collect
            ("reward_model.path=rm", "reward_model.gpus=1", "distillation.teacher_path=teacher", "distillation.gpus=1"),
        ):
            for node in _graph(name, *extra).nodes:
                keys = {key for key, _ in node.options}
                assert keys <= reads[node.op], (name, node.name, keys - reads[node.op])
                written[node.op] |= keys
    assert written == reads
