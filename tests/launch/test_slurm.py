"""``hybridflow slurm``: the rendered sbatch script for 1 and 4 nodes, and its input checks.

The script is only rendered and parsed (``bash -n``) here; ``test_slurm_cluster.py`` submits it
to a real one-node Slurm.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config import load_config
from launch.slurm import SCRIPT_NAME, SlurmJob, render_sbatch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")
# the quickstart's layout (ep=2 dp=2, 2 ranks) scaled to 4 nodes x 8 GPUs
BIG = ["actor.parallel.dp=32", "actor.parallel.ep=4", "rollout.tp=2"]


def _render(capsys, tmp_path: Path, *args: str, overrides=()) -> tuple[int, str, str]:
    code = main(["slurm", CONFIG, f"run.output_dir={tmp_path / 'run'}", *overrides, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _directives(script: str) -> list[str]:
    return re.findall(r"^#SBATCH (\S+)$", script, flags=re.M)


def _bash_parses(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.claim("slurm-script")
def test_one_cpu_node(capsys, tmp_path):
    code, out, err = _render(capsys, tmp_path, "--nodes", "1", "--gpus-per-node", "0")
    assert code == 0, err
    path = tmp_path / "run" / SCRIPT_NAME
    script = path.read_text()
    assert out.startswith(script) and f"# written to {path}" in out
    assert (tmp_path / "run" / "logs").is_dir()  # sbatch does not create the --output folder
    directives = _directives(script)
    assert "--nodes=1" in directives and "--ntasks-per-node=1" in directives
    assert not any("gpu" in d for d in directives)  # a CPU job requests no GPU
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives)
    assert f"--output={tmp_path / 'run' / 'logs'}/slurm-%j.out" in directives
    assert f"--chdir={Path.cwd().resolve()}" in directives
    assert 'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    assert "trap checkpoint_before_time_limit USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert f"> {tmp_path / 'run' / 'checkpoint.request'}" in script  # the ranks save, then stop
    for name in ("INT", "TERM", "HUP"):
        assert "trap 'stop_job" in script and f" {name}' {name}" in script
    assert "srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1" in script
    assert "-m hybridflow.cli launch " + CONFIG in script
    assert "--nnodes 1 --nproc-per-node 2 --max-restarts 0" in script
    assert '--rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID"' in script
    assert f"run.output_dir={tmp_path / 'run'}" in script and "run.resume=auto" in script
    assert "export OMP_NUM_THREADS=1" in script
    assert path.stat().st_mode & 0o111
    _bash_parses(path)


@pytest.mark.claim("slurm-script")
def test_four_gpu_nodes(capsys, tmp_path):
    code, out, err = _render(
        capsys,
        tmp_path,
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--account",
        "proj1",
        "--time",
        "04:00:00",
        "--qos",
        "high",
        "--cpus-per-task",
        "64",
        "--mem",
        "0",
        "--max-restarts",
        "2",
        "--rdzv-port",
        "29611",
        "--env",
        "NCCL_IB_HCA=mlx5",
        "--sbatch-option=--constraint=h100",
        overrides=BIG,
    )
    assert code == 0, err
    script = (tmp_path / "run" / SCRIPT_NAME).read_text()
    directives = _directives(script)
    for d in (
        "--nodes=4",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--account=proj1",
        "--time=04:00:00",
        "--qos=high",
        "--cpus-per-task=64",
        "--mem=0",
        "--requeue",
        "--constraint=h100",
    ):
        assert d in directives, d
    assert "srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1" in script
    assert "--nnodes 4 --nproc-per-node 8 --max-restarts 2" in script
    assert '--rdzv-endpoint "$head_node:29611"' in script
    assert "export NCCL_IB_HCA=mlx5" in script
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in script
    assert "OMP_NUM_THREADS" not in script  # GPU ranks keep torch's default
    for override in BIG:
        assert f"    {override} \\" in script
    _bash_parses(tmp_path / "run" / SCRIPT_NAME)


def test_dry_run_writes_nothing(capsys, tmp_path):
    code, out, _ = _render(capsys, tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--dry-run")
    assert code == 0 and out.startswith("#!/bin/bash") and "# written to" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.claim("slurm-script")
def test_printed_output_is_itself_a_valid_script(capsys, tmp_path):
    code, out, _ = _render(capsys, tmp_path, "--nodes", "1", "--gpus-per-node", "0")
    assert code == 0
    (tmp_path / "printed.sh").write_text(out)
    _bash_parses(tmp_path / "printed.sh")


def test_user_run_dir_and_resume_overrides_are_pinned_once(tmp_path):
    cfg = load_config(CONFIG)
    job = SlurmJob(nodes=1, gpus_per_node=0, nproc_per_node=2)
    script = render_sbatch(job, config=Path(CONFIG), overrides=["train.lr=1e-4"], run_dir=tmp_path, workdir=tmp_path)
    assert script.count("run.output_dir=") == 1 and "train.lr=1e-4" in script
    assert cfg.actor.parallel.world_size == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nodes", "2", "--gpus-per-node", "4"],
            "--nodes=2 x --gpus-per-node=4 = 8 processes, but actor.parallel fills 2",
        ),
        (["--nodes", "3", "--gpus-per-node", "0"], "--nodes=3 does not divide the 2 ranks"),
        (["--nodes", "1", "--gpus-per-node", "0", "--partition", "a b"], "--partition='a b'"),
        (["--nodes", "1", "--gpus-per-node", "0", "--env", "1X=2"], "not an environment variable name"),
        (["--nodes", "1", "--gpus-per-node", "0", "--sbatch-option=constraint"], "must be one long option"),
        (["--nodes", "1", "--gpus-per-node", "2", "--nproc-per-node", "1"], "one rank per GPU"),
    ],
)
@pytest.mark.claim("slurm-script")
def test_bad_input_exits_2(capsys, tmp_path, args, message):
    code, _, err = _render(capsys, tmp_path, *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "run").exists()


def test_resume_never_cannot_survive_a_requeue(capsys, tmp_path):
    code, _, err = _render(capsys, tmp_path, "--nodes", "1", "--gpus-per-node", "0", overrides=["run.resume=never"])
    assert code == 2 and "run.resume=auto" in err


@pytest.mark.claim("launch-errors-within-seconds")
def test_missing_config(capsys, tmp_path):
    assert main(["slurm", str(tmp_path / "nope.yaml"), "--nodes", "1", "--gpus-per-node", "0"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_submit_without_sbatch_says_where_the_script_is(capsys, tmp_path, monkeypatch):
    # an empty PATH rather than a skip where sbatch exists: CI installs Slurm, and runs this too
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = _render(capsys, tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--submit")
    assert code == 2 and "sbatch is not installed" in err
    assert (tmp_path / "run" / SCRIPT_NAME).is_file()
