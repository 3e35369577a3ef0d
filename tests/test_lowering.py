"""Lowering: placement, stages with colocation switches, memory per pool, weight sync."""

import dataclasses
import time
from pathlib import Path

import pytest

from hybridflow.algorithms.recipes import algorithm_names, algorithm_spec
from hybridflow.config import load_config
from hybridflow.graph import GraphError
from hybridflow.lowering import Switch, lower, place

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUICKSTART = str(CONFIGS / "quickstart_cpu.yaml")
GPU_RECIPES = ["grpo_qwen3_235b", "grpo_deepseek_v3_671b"]


def _cfg(*overrides):
    return load_config(QUICKSTART, list(overrides))


def _switches(plan):
    return {stage.node.name: stage.switch and stage.switch.describe() for stage in plan.stages}


def test_colocated_quickstart_places_everything_on_one_pool():
    plan = lower(_cfg(), with_reshard=False)
    (pool,) = plan.placement.pools
    assert (pool.name, pool.num_gpus, pool.ranks, pool.num_nodes) == ("colocated", 2, range(2), 1)
    assert set(pool.roles) == {"actor", "rollout", "reward", "driver"}
    assert [s.node.name for s in plan.stages] == [n.name for n in plan.graph.topological_order()]
    assert all(s.pool == "colocated" and s.ranks == range(2) for s in plan.stages)
    assert [m.pool for m in plan.memory] == ["colocated"]
    assert list(plan.memory_of("colocated").phases) == ["generation", "training"]


@pytest.mark.claim("plan-is-what-runs")
def test_colocated_switches_follow_the_step():
    switches = _switches(lower(_cfg(), with_reshard=False))
    # the step ends with the sync, which left the engine's weights resident
    assert switches["generate"] == "engine KV cache resume"
    assert switches["old_logprob"] == ("engine releases weights+KV cache; actor grads+optimizer <- host")
    assert switches["sync_weights"] == "actor grads+optimizer -> host; engine weights resume"
    assert {switches[name] for name in ("reward", "token_rewards", "advantages", "update_actor")} == {None}


def test_switches_move_training_state_only_and_name_the_critic():
    plan = lower(_cfg("reference.enabled=true", "algorithm.kl_loss_coef=0.01"), with_reshard=False)
    switches = _switches(plan)
    # the reference has no training state: its parameters stay resident (the memory estimate says so)
    assert switches["sync_weights"] == "actor grads+optimizer -> host; engine weights resume"
    assert switches["ref_logprob"] is None  # resident all along
    assert "reference params" in plan.memory_of("colocated").phases["generation"]
    ppo = lower(_cfg("algorithm.name=ppo", "critic.enabled=true"), with_reshard=False)
    assert _switches(ppo)["sync_weights"] == "actor, critic grads+optimizer -> host; engine weights resume"


def test_switch_values_move_exactly_what_their_modes_differ_by():
    from hybridflow.lowering import switch

    cfg = _cfg()
    assert switch(cfg, "train", "sync") == Switch(
        source="train", target="sync", offload=("actor",), engine_resume=("weights",)
    )
    assert switch(cfg, "sync", "generate").engine_resume == ("kv_cache", "cuda_graph")
    back = switch(cfg, "generate", "train")
    assert back.engine_release == ("weights", "kv_cache", "cuda_graph") and back.restore == ("actor",)
    start = switch(cfg, None, "generate")  # at start everything is resident
    assert (start.offload, start.engine_resume, start.engine_release) == (("actor",), (), ())
    assert lower(cfg, with_reshard=False).start_mode == "sync"


def _required(stage):
    """What the GPUs must hold for a stage: gen, sync, train or None (CPU)."""
    if stage.node.role == "rollout":
        return "gen"
    if stage.node.op == "sync_weights":
        return "sync"
    return "train" if stage.node.role in ("actor", "reference", "critic") else None


def _after(switch):
    return {"generate": "gen", "sync": "sync", "train": "train"}[switch.target]


@pytest.mark.parametrize("name", algorithm_names())
def test_every_gpu_stage_finds_its_memory_in_place(name):
    cfg = _cfg(f"algorithm.name={name}")
    if algorithm_spec(cfg).needs_critic:
        cfg = _cfg(f"algorithm.name={name}", "critic.enabled=true")
    stages = lower(cfg, with_reshard=False).stages
    # walk the step twice: the second pass starts from what the first one left
    state = next(_required(s) for s in reversed(stages) if _required(s))
    for stage in stages * 2:
        need = _required(stage)
        if stage.switch is not None:
            assert need is not None and need != state, stage.node.name
            state = _after(stage.switch)
        assert need in (None, state), (stage.node.name, need, state)


def test_separate_placement_has_two_pools_and_no_switches():
    cfg = _cfg("rollout.placement=separate", "rollout.num_replicas=2")
    plan = lower(cfg, with_reshard=False)
    actor, rollout = plan.placement.pools
    assert (actor.name, actor.ranks, rollout.name, rollout.ranks) == ("actor", range(2), "rollout", range(2, 6))
    assert plan.placement.num_gpus == 6
    assert all(s.switch is None for s in plan.stages)
    by_name = {s.node.name: s for s in plan.stages}
    assert (by_name["generate"].pool, by_name["generate"].ranks) == ("rollout", range(2, 6))
    assert (by_name["reward"].pool, by_name["reward"].ranks) == ("actor", range(2))
    assert (by_name["sync_weights"].pool, by_name["sync_weights"].ranks) == ("actor+rollout", range(6))
    assert list(plan.memory_of("actor").phases) == ["training"]
    assert list(plan.memory_of("rollout").phases) == ["generation"]


def test_colocated_engines_may_use_part_of_the_pool():
    cfg = _cfg("rollout.tp=1")
    placement = place(cfg)
    assert placement.ranks_of("rollout") == range(1) and placement.ranks_of("actor") == range(2)
    assert "  rollout on rank 0 of pool colocated only" in placement.describe()


def test_a_smaller_critic_runs_on_the_first_ranks():
    placement = place(_cfg("algorithm.name=ppo", "critic.parallel.dp=1"))  # one rank
    assert placement.ranks_of("critic") == range(1)
    assert "  critic on rank 0 of pool colocated only" in placement.describe()


@pytest.mark.parametrize("dp", [1, 4])
def test_a_reference_layout_that_does_not_fill_the_actors_ranks_is_refused(dp):
    """The reference is a frozen model: a layout of its own covers the actor's ranks exactly."""
    with pytest.raises(
        ValueError,
        match=rf"^reference.parallel: tp\*pp\*cp\*dp = 1\*1\*1\*{dp} = {dp} ranks, but a frozen model runs on "
        r"the actor's 2 ranks \(actor.parallel\); set reference.parallel.dp=2$",
    ):
        _cfg("reference.enabled=true", f"reference.parallel.dp={dp}")
    own = _cfg(
        "reference.enabled=true", "algorithm.kl_loss_coef=0.01", "reference.parallel.tp=2", "reference.parallel.dp=1"
    )
    (stage,) = [s for s in lower(own, with_reshard=False).stages if s.node.role == "reference"]
    assert stage.ranks == range(2) and "(its own: reference.parallel)" in stage.layout


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_role_larger_than_its_pool_names_the_key(placement):
    cfg = _cfg("algorithm.name=ppo", "critic.parallel.dp=4", f"rollout.placement={placement}")
    pool = "colocated" if placement == "colocated" else "actor"
    with pytest.raises(
        ValueError,
        match=(
            rf"critic.parallel needs tp\*pp\*cp\*dp = 1\*1\*1\*4 = 4 GPUs, more than the 2 "
            rf"of the {pool} pool .*lower critic.parallel.dp to 2 or less"
        ),
    ):
        place(cfg)
    model_parallel = _cfg(
        "algorithm.name=ppo",
        "critic.enabled=true",
        "critic.parallel.tp=2",
        "critic.parallel.pp=2",
        f"rollout.placement={placement}",
    )
    with pytest.raises(ValueError, match=r"lower critic.parallel.tp\*pp\*cp = 4 to at most 2"):
        lower(model_parallel, with_reshard=False)


def test_missing_roles_fail_before_placement():
    with pytest.raises(ValueError, match="remove critic.enabled=false"):
        lower(_cfg("algorithm.name=ppo", "critic.enabled=false"), with_reshard=False)
    with pytest.raises(ValueError, match="needs the reference policy"):
        lower(_cfg("algorithm.kl_loss_coef=0.1"), with_reshard=False)


def test_the_graph_is_validated_against_the_placed_roles(monkeypatch):
    from hybridflow.lowering import Placement, ResourcePool

    def no_rollout(cfg):
        pool = ResourcePool(
            name="colocated", num_gpus=2, gpus_per_node=8, first_rank=0, roles=("actor", "reward", "driver")
        )
        return Placement(mode="colocated", pools=(pool,), rollout_ranks=0)

    monkeypatch.setattr("hybridflow.lowering.place", no_rollout)
    with pytest.raises(GraphError, match="node 'generate' runs on the rollout role"):
        lower(_cfg(), with_reshard=False)


def test_weight_sync_is_planned_only_when_asked():
    planned = lower(_cfg())
    (sync,) = planned.weight_syncs
    assert sync.node == "sync_weights" and sync.stats.ratio_to_lower_bound == pytest.approx(1)
    assert sync.describe()[0].startswith("weight sync actor -> rollout, planned from shapes in ")
    skipped = lower(_cfg(), with_reshard=False)
    assert skipped.weight_syncs[0].stats is None and skipped.weight_syncs[0].describe() == []
    assert not any("lora.push" in line for line in sync.describe())
    # lora.push=adapter: the printed reshard is the base's, which steps no longer repeat; the plan says so
    (adapter,) = lower(_cfg("lora.enabled=true", "lora.push=adapter")).weight_syncs
    assert "lora.push=adapter: this reshard moves the frozen base before the first step" in adapter.describe()[-1]


def test_the_plan_is_a_frozen_value():
    plan = lower(_cfg(), with_reshard=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages = ()
    assert lower(_cfg(), with_reshard=False).stages == plan.stages


def test_describe_draws_every_section():
    text = "\n".join(lower(_cfg()).describe())
    for piece in (
        "graph grpo (7 nodes, data: prompts, answers):",
        "  generate [rollout] generate: prompts -> responses",
        "placement colocated, 2 GPUs:",
        "  colocated: 2 GPUs on 1 node, ranks 0-1: actor, rollout, reward, driver",
        "stages:",
        "  1. generate [rollout] generate on colocated ranks 0-1",
        "     switch before it: engine KV cache resume",
        "memory per GPU, pool colocated (GiB):",
        "  peak ",
        "reshard: ",
        "lower bound",
    ):
        assert piece in text, piece


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_fit_80_gib_and_carry_the_reference(name):
    cfg = load_config(str(CONFIGS / f"{name}.yaml"))
    assert cfg.reference.enabled and cfg.reference.parallel == cfg.actor.parallel
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.kl_loss_coef > 0
    assert cfg.run.prompts_per_step * cfg.rollout.n == cfg.train.global_batch_size * cfg.algorithm.mini_batches
    plan = lower(cfg, with_reshard=False)
    assert plan.fits
    (memory,) = plan.memory
    assert memory.totals["generation"] != memory.totals["training"]
    assert "ref_logprob" in [s.node.name for s in plan.stages]


@pytest.mark.claim("plan-reshard-from-shapes")
def test_lowering_deepseek_v3_with_the_reshard_takes_seconds():
    cfg = load_config(str(CONFIGS / "grpo_deepseek_v3_671b.yaml"))
    # CPU time of this process, not wall time: the test machine's cores are shared
    start = time.process_time()
    plan = lower(cfg)
    # about 3 s on an idle core, 13 s on this machine on a slow day: the bound catches a planner
    # gone quadratic (minutes at this size), not a slow machine
    assert time.process_time() - start < 40
    assert plan.weight_syncs[0].stats.bytes > 0
    assert plan.placement.num_gpus == 256


def test_memory_that_does_not_fit_is_a_warning_not_an_error(caplog):
    cfg = load_config(str(CONFIGS / "grpo_qwen3_235b.yaml"))
    plan = lower(cfg, with_reshard=False, device_memory_gib=40)
    assert not plan.fits
    # the reference's parameters stay resident while generating: generation is the peak here
    assert "WARNING pool colocated: the generation peak" in "\n".join(plan.describe())
    assert "exceeds the device's 40 GiB" in caplog.text


PAPER_RECIPES = {"dapo_qwen3_235b": 16, "vapo_qwen3_235b": 32}
"""The DAPO and VAPO papers' settings at 100B+ MoE scale, and the nodes each asks for."""


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_paper_recipes_fit_and_carry_the_papers_settings(name, tmp_path):
    from hybridflow.algorithms.recipes import algorithm_spec
    from hybridflow.cli import main

    cfg = load_config(str(CONFIGS / f"{name}.yaml"))
    assert lower(cfg, with_reshard=False).fits
    spec = algorithm_spec(cfg)
    assert (spec.clip_ratio_high, cfg.algorithm.clip_ratio_low, spec.loss_agg_mode) == (0.28, 0.2, "token-mean")
    # 512 prompts x 16 responses in mini-batches of 512: 16 updates a step
    assert (cfg.run.prompts_per_step, cfg.rollout.n, cfg.train.global_batch_size, cfg.algorithm.mini_batches) == (
        512,
        16,
        512,
        16,
    )
    assert cfg.train.lr == 1e-6 and not cfg.reference.enabled and not spec.uses_reference
    if spec.name == "dapo":
        assert spec.dynamic_sampling and spec.overlong_buffer_len == 4096 and cfg.data.max_response_length == 20480
    else:
        assert cfg.critic.enabled and spec.needs_critic and spec.critic_warmup_steps == 50
        assert (spec.lm_loss_coef, spec.length_adaptive_lam_alpha, spec.critic_lam) == (0.1, 0.05, 1.0)
    nodes = PAPER_RECIPES[name]
    assert cfg.actor.parallel.world_size == nodes * 8
    assert (
        main(
            [
                "slurm",
                str(CONFIGS / f"{name}.yaml"),
                f"run.output_dir={tmp_path}",
                "--nodes",
                str(nodes),
                "--gpus-per-node",
                "8",
                "--dry-run",
            ]
        )
        == 0
    )
