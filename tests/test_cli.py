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
    assert "# weight sync actor -> rollout, planned from shapes in " in out
    assert "# reshard: " in out and "B across devices" in out
    assert re.search(r"lower bound [\d.]+ [kMGT]?B \(ratio 1\.000\)", out)
    assert re.search(r"simulated [\d.e+-]+ s", out)
    return float(re.search(r"baseline [\d.]+ [kMGT]?B \(([\d.]+)x the plan\)", out).group(1))


@pytest.mark.claim("plan-without-gpu")
def test_plan_prints_config_layout_and_reshard(capsys, tmp_path):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "name: quickstart_cpu" in out
    assert "output_dir: runs/quickstart_cpu" in out
    layout = "tp=1 pp=1 vpp=1 ep=2 etp=1 cp=1 dp=2 (world 2, expert_dp 1)"
    assert f"# actor: {layout}; padded vocab 384" in out  # vocab 320, padded to 128s
    assert "# rollout: sglang tp=2 ep=1 x1 replicas (2 ranks); colocated" in out
    assert _check_reshard_summary(out) > 1
    resolved = tmp_path / "plan.yaml"  # the summary is comments: the output still loads
    resolved.write_text(out)
    assert load_config(str(resolved)) == load_config(str(CONFIGS / "quickstart_cpu.yaml"))


@pytest.mark.claim("plan-reshard-from-shapes")
def test_plan_no_reshard(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "--no-reshard"]) == 0
    out = capsys.readouterr().out
    assert "# rollout: sglang tp=2" in out
    assert "# reshard:" not in out and "weight sync" not in out


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
    assert "# actor: tp=2 " in out
    assert "# critic: tp=2 " in out  # unset: the actor's layout


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


@pytest.mark.parametrize(
    "name, total, layout, rollout",
    [
        (
            "qwen3_moe_235b",
            "235.1B",
            "tp=4 pp=2 vpp=1 ep=8 etp=1 cp=1 dp=8 (world 64, expert_dp 4)",
            "sglang tp=8 ep=8 x8 replicas (64 ranks); colocated",
        ),
        (
            "deepseek_v3_671b",
            "671.0B",
            "tp=8 pp=1 vpp=1 ep=64 etp=1 cp=1 dp=8 (world 64, expert_dp 1)",
            "sglang tp=8 ep=8 dp_attention=8 x8 replicas (64 ranks); colocated",
        ),
    ],
)
@pytest.mark.claim("big-recipes-plan")
def test_big_configs_plan(name, total, layout, rollout, capsys):
    # plans the weight sync of a 235B / 671B model from shapes: about a second each
    assert main(["plan", str(CONFIGS / f"{name}.yaml"), "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert f"{total} parameters" in out
    assert f"# actor: {layout}" in out
    assert f"# rollout: {rollout}" in out
    assert _check_reshard_summary(out) >= 7  # the gather baseline at SGLang tp=8


def test_plan_grpo_qwen3_prints_graph_placement_memory_and_reshard(capsys):
    start = time.process_time()  # CPU time: the test machine's cores are shared
    assert main(["plan", str(CONFIGS / "grpo_qwen3_235b.yaml")]) == 0
    assert time.process_time() - start < 20
    out = capsys.readouterr().out
    for line in (
        "# algorithm grpo: GRPO",
        "#   reference (KL in the loss)",
        "# graph grpo (8 nodes, data: prompts, answers):",
        "#   ref_logprob [reference] ref_logprob: responses -> ref_logprobs",
        "# placement colocated, 128 GPUs:",
        "#   colocated: 128 GPUs on 16 nodes, ranks 0-127: actor, reference, rollout, reward, driver",
        "#        switch before it: engine KV cache resume",
        "# memory per GPU, pool colocated (GiB):",
    ):
        assert line in out, line
    peak = re.search(r"#   peak ([\d.]+) GiB \((\w+)\) of 80 GiB: fits", out)
    assert peak and 40 < float(peak.group(1)) < 80
    assert _check_reshard_summary(out) > 1


def test_plan_mermaid_prints_only_the_graph(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "--mermaid"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flowchart TD\n")
    assert 'node_generate -->|"responses"| node_reward' in out
    assert "model:" not in out and "# " not in out


def test_plan_warns_when_memory_does_not_fit(capsys):
    assert main(["plan", str(CONFIGS / "grpo_qwen3_235b.yaml"), "--no-reshard", "--device-memory-gib", "40"]) == 0
    assert "#   WARNING pool colocated: the generation peak" in capsys.readouterr().out


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
