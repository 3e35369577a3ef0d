"""The hybridflow command line: help, plan, and config errors as exit status 2."""

from pathlib import Path

import pytest

from hybridflow.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "plan" in capsys.readouterr().out


def test_plan_prints_config_and_layout(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "name: quickstart_cpu" in out
    assert "output_dir: runs/quickstart_cpu" in out
    layout = "tp=1 pp=1 vpp=1 ep=2 etp=1 cp=1 dp=2 (world 2, expert_dp 1)"
    assert f"# actor: {layout}; padded vocab 256" in out


def test_plan_applies_overrides(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "actor.parallel.tp=2",
                 "actor.parallel.ep=1", "actor.parallel.dp=1", "critic.enabled=true",
                 "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "# actor: tp=2 " in out
    assert "# critic: tp=1 " in out


def test_bad_override_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "train.lrr=1"]) == 2
    captured = capsys.readouterr()
    assert "train.lrr" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_world_size_mismatch_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "quickstart_cpu.yaml"), "--world-size", "4"]) == 2
    assert "world size 4 does not match actor.parallel" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, total, layout",
    [
        ("qwen3_moe_235b", "235.1B",
         "tp=4 pp=2 vpp=1 ep=8 etp=1 cp=1 dp=8 (world 64, expert_dp 4)"),
        ("deepseek_v3_671b", "671.0B",
         "tp=8 pp=1 vpp=1 ep=64 etp=1 cp=1 dp=8 (world 64, expert_dp 1)"),
    ],
)
def test_big_configs_plan(name, total, layout, capsys):
    assert main(["plan", str(CONFIGS / f"{name}.yaml"), "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert f"{total} parameters" in out
    assert f"# actor: {layout}" in out
