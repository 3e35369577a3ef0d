"""The hybridflow command line: help, plan, and config errors as exit status 2."""

import re
import time
from pathlib import Path

import pytest
import torch

from hybridflow.cli import main
from hybridflow.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "plan" in capsys.readouterr().out


def _check_reshard_summary(out: str) -> float:
    """Assert the weight-sync lines are there and exact; return the baseline / plan ratio."""
    assert "\nweight sync actor -> rollout, planned from shapes in " in out
    assert "\nreshard: " in out and "B across devices" in out
    assert re.search(r"lower bound [\d.]+ [kMGT]?B \(ratio 1\.000\)", out)
    assert re.search(r"simulated [\d.e+-]+ s", out)
    return float(re.search(r"baseline [\d.]+ [kMGT]?B \(([\d.]+)x the plan\)", out).group(1))


@pytest.mark.claim("plan-without-gpu")
def test_plan_answers_first_then_layout_and_reshard(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "fits: 2 GPUs on 1 node of 80 GiB (colocated)"
    assert re.fullmatch(r"  pool colocated: peak [\d.]+ GiB per GPU in generation \(training [\d.]+\)", lines[1])
    layout = "tp=1 pp=1 vpp=1 ep=2 etp=1 cp=1 dp=2 (world 2, expert_dp 1)"
    assert f"\nactor: {layout}; padded vocab 384\n" in out  # vocab 320, padded to 128s
    assert "\nrollout: sglang tp=2 ep=1 x1 replicas (2 ranks); colocated" in out
    assert _check_reshard_summary(out) > 1
    assert "name: quickstart_cpu" not in out  # the resolved YAML only on request
    assert lines[-1] == f"(the resolved config: hybridflow plan {CONFIGS / 'quickstart_cpu.yaml'} ... --resolved)"


@pytest.mark.claim("plan-without-gpu")
def test_plan_resolved_prints_the_config_alone_and_it_loads(capsys, tmp_path):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "train.lr=3e-4", "--resolved"]) == 0
    out = capsys.readouterr().out
    assert "output_dir: runs/quickstart_cpu" in out and "fits" not in out
    resolved = tmp_path / "plan.yaml"
    resolved.write_text(out)
    assert load_config(str(resolved)) == load_config(str(CONFIGS / "quickstart_cpu.yaml"), ["train.lr=3e-4"])


def test_plan_no_reshard(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "--no-reshard"]) == 0
    out = capsys.readouterr().out
    assert "\nrollout: sglang tp=2" in out
    assert "reshard:" not in out and "weight sync" not in out


def test_plan_separate_rollout(capsys):
    assert (
        main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "rollout.placement=separate", "rollout.num_replicas=2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "x2 replicas (4 ranks); separate" in out
    assert " 0 B local copies" in out  # no engine rank shares a device with the actor
    assert _check_reshard_summary(out) > 1


def test_colocated_rollout_too_big_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "rollout.num_replicas=2"]) == 2
    captured = capsys.readouterr()
    assert "rollout.placement=colocated puts rollout.tp*num_replicas = 2*2 = 4" in captured.err
    assert captured.out == ""


@pytest.mark.claim("plan-without-gpu")
def test_plan_applies_overrides(capsys):
    assert (
        main(
            [
                "plan",
                str(CONFIGS / "quickstart_cpu.yaml"),
                "actor.parallel.tp=2",
                "actor.parallel.ep=1",
                "actor.parallel.dp=1",
                "critic.enabled=true",
                "--world-size",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "\nactor: tp=2 " in out
    assert "\ncritic: tp=2 " in out  # unset: the actor's layout


def test_bad_override_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "train.lrr=1"]) == 2
    captured = capsys.readouterr()
    assert "train.lrr" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


@pytest.mark.claim("plan-names-the-world-mismatch")
def test_world_size_mismatch_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "--world-size", "4"]) == 2
    assert "world size 4 does not match actor.parallel" in capsys.readouterr().err
    # the README's example: tp=4 alone shrinks the DeepSeek-V3 recipe's world below its ep=256
    assert main(["plan", str(CONFIGS / "grpo_deepseek_v3_671b.yaml"), "actor.parallel.tp=4"]) == 2
    assert "= 256 does not divide the world size tp*pp*cp*dp = 4*1*1*32 = 128" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, total, layout, rollout",
    [
        (
            "grpo_qwen3_235b",
            "235.1B",
            "tp=4 pp=2 vpp=1 ep=32 etp=1 cp=1 dp=16 (world 128, expert_dp 2)",
            "sglang tp=16 ep=16 dp_attention=4 x8 replicas (128 ranks); colocated",
        ),
        (
            "grpo_deepseek_v3_671b",
            "671.0B",
            "tp=8 pp=1 vpp=1 ep=256 etp=1 cp=1 dp=32 (world 256, expert_dp 1)",
            "sglang tp=32 ep=32 dp_attention=4 x8 replicas (256 ranks); colocated",
        ),
    ],
)
@pytest.mark.claim("big-recipes-plan")
def test_big_configs_plan(name, total, layout, rollout, capsys):
    # plans the weight sync of a 235B / 671B model from shapes: about a second each
    world = layout.split("world ")[1].split(",")[0]
    assert main(["plan", str(CONFIGS / f"{name}.yaml"), "--world-size", world]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fits: {world} GPUs on {int(world) // 8} nodes of 80 GiB (colocated)\n")
    assert f"{total} parameters" in out
    assert f"\nactor: {layout}" in out
    assert f"\nrollout: {rollout}" in out
    assert _check_reshard_summary(out) >= 7  # the gather baseline at SGLang tp >= 8


def test_plan_grpo_qwen3_prints_graph_placement_memory_and_reshard(capsys):
    start = time.process_time()  # CPU time: the test machine's cores are shared
    assert main(["plan", str(CONFIGS / "grpo_qwen3_235b.yaml")]) == 0
    assert time.process_time() - start < 20
    out = capsys.readouterr().out
    for line in (
        "\nalgorithm grpo: GRPO",
        "\n  reference (KL in the loss)",
        "\ngraph grpo (8 nodes, data: prompts, answers):",
        "\n  ref_logprob [reference] ref_logprob: responses -> ref_logprobs",
        "\nplacement colocated, 128 GPUs:",
        "\n  colocated: 128 GPUs on 16 nodes, ranks 0-127: actor, reference, rollout, reward, driver",
        "\n       switch before it: engine KV cache resume",
        "\nmemory per GPU, pool colocated (GiB):",
    ):
        assert line in out, line
    peak = re.search(r"\n  peak ([\d.]+) GiB \((\w+)\) of 80 GiB: fits", out)
    assert peak and 40 < float(peak.group(1)) < 80
    assert _check_reshard_summary(out) > 1


def test_plan_mermaid_prints_only_the_graph(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "--mermaid"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flowchart TD\n")
    assert 'node_generate -->|"responses"| node_reward' in out
    assert "model:" not in out and "# " not in out


def test_plan_that_does_not_fit_says_so_first_and_exits_3(capsys):
    assert main(["plan", str(CONFIGS / "grpo_qwen3_235b.yaml"), "--no-reshard", "--device-memory-gib", "40"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "DOES NOT FIT: 128 GPUs on 16 nodes of 40 GiB (colocated)"
    assert lines[2].startswith("    the generation peak ") and "exceeds the device's 40 GiB" in lines[2]


def test_plan_advice_never_proposes_what_is_already_set(capsys):
    """The recipe sets the distributed optimizer and micro-batches of 1: advice to set either sends
    a user in circles; the optimizer's advice names the GPUs to add instead."""
    args = ["plan", str(CONFIGS / "grpo_qwen3_235b.yaml"), "actor.parallel.dp=8", "rollout.num_replicas=4"]
    assert main([*args, "--no-reshard", "--device-memory-gib", "70"]) == 3
    advice = capsys.readouterr().out.splitlines()[2]
    assert "use_distributed_optimizer" not in advice and "micro_batch_size" not in advice
    assert "add GPUs (raise actor.parallel.dp): the distributed optimizer already shards" in advice
    off = ["train.use_distributed_optimizer=false", "train.micro_batch_size=2"]
    assert main([*args, *off, "--no-reshard", "--device-memory-gib", "70"]) == 3
    advice = capsys.readouterr().out.splitlines()[2]
    assert "set train.use_distributed_optimizer=true" in advice


def test_role_larger_than_its_pool_exits_2(capsys):
    assert (
        main(
            [
                "plan",
                str(CONFIGS / "quickstart_cpu.yaml"),
                "algorithm.name=ppo",
                "critic.parallel.dp=4",
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "critic.parallel needs tp*pp*cp*dp = 1*1*1*4 = 4 GPUs" in captured.err
    assert "lower critic.parallel.dp to 2 or less" in captured.err
    assert captured.out == ""


def test_algorithm_without_its_role_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "algorithm.name=ppo", "critic.enabled=false"]) == 2
    assert "remove critic.enabled=false" in capsys.readouterr().err


@pytest.mark.claim("r3-refused-on-cpu")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would let SGLang return routed experts")
def test_train_with_r3_on_cpu_exits_2_pointing_to_r2(capsys, tmp_path):
    assert (
        main(
            [
                "train",
                str(CONFIGS / "quickstart_cpu.yaml"),
                "moe.routing_replay=r3",
                f"run.output_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    assert "moe.routing_replay=r2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


CPU_RECIPES = {
    "quickstart_cpu",
    "quickstart_cpu_fsdp2",
    "quickstart_cpu_day0",
    "quickstart_cpu_lora",
    "quickstart_cpu_packed",
    "quickstart_cpu_vllm",
    "agentic_cpu",
    "my_model",
}
"""Recipes for this CPU (the template included); every other recipe names its GPUs."""
HEADER = re.compile(r"^# Memory per GPU \(hybridflow plan, (\d+) GiB GPUs\): (.+)\.$", re.M)


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_fits_its_plan_and_its_header_says_what_plan_says(recipe, capsys):
    """A recipe that does not fit the GPUs it names is a claim without proof; a figure typed into
    a header drifts from the estimate. GPU recipes state plan's figures, and a test holds them."""
    header = HEADER.search(recipe.read_text())
    if recipe.stem not in CPU_RECIPES:
        assert header, f"{recipe.name}: no '# Memory per GPU (hybridflow plan, N GiB GPUs): ...' line"
    gib = header.group(1) if header else "80"
    assert main(["plan", str(recipe), "--no-reshard", "--device-memory-gib", gib]) == 0, recipe.name
    pool = capsys.readouterr().out.splitlines()[1]
    peak, phase, others = re.search(r"peak ([\d.]+) GiB per GPU in (\w+)(?: \((.*)\))?$", pool).groups()
    shown = {phase: peak, **dict(re.findall(r"(\w+) ([\d.]+)", others or ""))}
    if header:
        stated = dict(re.findall(r"(\w+) ([\d.]+) GiB", header.group(2)))
        assert stated == shown, f"{recipe.name}: header {stated}, plan {shown}"


def test_every_plan_command_the_docs_show_fits(capsys):
    """The README's and docs' example `hybridflow plan configs/...` commands, as typed."""
    root = CONFIGS.parent
    shown = set()
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        shown |= set(re.findall(r"hybridflow plan (configs/[\w.]+\.yaml(?: [\w.=/-]+)*)", doc.read_text()))
    assert len(shown) >= 2, shown
    for command in sorted(shown):
        path, *rest = command.split()
        args = [a for a in rest if "=" in a]  # overrides; flags like --mermaid print no verdict
        assert main(["plan", str(root / path), *args, "--no-reshard"]) == 0, command
        assert capsys.readouterr().out.startswith("fits: "), command


@pytest.mark.claim("trainer-seam")
@pytest.mark.parametrize("command", ["plan", "selftest"])
def test_a_layout_fsdp2_does_not_shard_is_refused_by_plan_and_selftest_too(command, capsys):
    """``hybridflow plan`` prints what runs: it does not plan an FSDP2 actor split over experts."""
    assert main([command, str(CONFIGS / "quickstart_cpu.yaml"), "actor.backend=fsdp2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"hybridflow {command}: error: actor.parallel.ep=2 with actor.backend=fsdp2: ")
    assert line.endswith("or use actor.backend=megatron")


@pytest.mark.claim("fsdp2-quickstart")
def test_the_plan_of_an_fsdp2_run_names_the_trainer_that_runs_and_its_memory(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu_fsdp2.yaml")]) == 0
    out = capsys.readouterr().out
    assert "update_actor on colocated ranks 0-1 (fsdp2 dp=2 (every parameter sharded over 2 ranks))" in out
    assert "actor fsdp2 dp=2 (every parameter sharded over 2 ranks) -> rollout sglang tp=2" in out
    assert "megatron" not in out and "padded vocab" not in out
    from hybridflow.memory import training_components

    bigger = [str(CONFIGS / "quickstart_cpu_fsdp2.yaml"), ["model.hidden_size=1024", "model.num_layers=8"]]
    two = training_components(load_config(*bigger), "actor")[1]
    one = training_components(load_config(bigger[0], [*bigger[1], "actor.parallel.dp=1", "rollout.tp=1"]), "actor")[1]
    for part in ("grads", "optimizer"):  # FSDP2 shards them (and the parameters) over dp
        assert two[f"actor {part}"] * 2 == pytest.approx(one[f"actor {part}"], rel=1e-3)
