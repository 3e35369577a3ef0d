"""``hybridflow train`` end to end on the quickstart model, kept short (4 SFT + 4 GRPO steps).

Two processes (EP=2 actor) and an SGLang tp=2 engine, as the quickstart runs. One uninterrupted
run (``run.deterministic=true``) checks the step invariants, the weight sync, MLflow and the
reports; a second run is stopped during SFT by a checkpoint request, then killed at the start of
step 3 (``tests.injection`` ``CRASH_AT_STEP``: the process exits on the spot, as under a node failure),
restarted with ``run.resume=auto`` and must reproduce the first run bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms.shaping import KL_COEF_NEXT
from hybridflow.runtime.progress import read_progress
from hybridflow.runtime.startup_clock import PHASES, STARTUP_FILE
from hybridflow.runtime.state import checkpoint_dirs, read_state
from tests.injection import environment

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "run.steps=4",
    "sft.steps=4",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=3",
    "run.heldout_prompts=16",
    "run.prompts_per_step=8",
    "rollout.n=4",
    "checks.refit_every=1",
]
LOGPROB_TOL = 1e-4
"""fp32 SGLang CPU kernels against fp32 megatron-core; observed <= 1e-6."""
TIMING = ("timing/", "rollout/tokens_per_s", "sync/seconds")
DETERMINISTIC = "run.deterministic=true"
"""run.deterministic's whole switch (on CPU it changes rounding only; the default mode's
reproduction across a kill is checked by tests/test_engine_restart.py and test_train_async.py)."""
FULL_RUN = (DETERMINISTIC, "moe.routing_replay=r2", "run.tracking.trackers=[mlflow,wandb]")
"""The uninterrupted run (``full_run``) and the stopped, killed and damaged ones that must reproduce
it bit for bit: deterministic, with routing replay R2 on, as a MoE user would run RL (so every
reproduction covers the replayed routes too; tests/moe/test_train_replay.py checks the replay),
tracked by MLflow and wandb (offline: no key here)."""


def _train(
    out: Path, *extra: str, fault_at: int | None = None, env: dict | None = None, during=None
) -> subprocess.CompletedProcess:
    """``hybridflow train`` of the short quickstart into ``out``; ``during()``: called once the
    job has started (while it runs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if fault_at is not None:
        env.update(environment(CRASH_AT_STEP=str(fault_at)))
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        "configs/quickstart_cpu.yaml",
        f"run.output_dir={out}",
        *SHORT,
        *extra,
    ]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        if during is not None:
            during()
        stdout, stderr = job.communicate(timeout=900)
    return subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def _history(out: Path, checkpoint: str) -> list[dict]:
    return json.loads((out / "checkpoints" / checkpoint / "state.json").read_text())["history"]


def _deterministic(history: list[dict]) -> list[dict]:
    """Everything but timings and how the samples were spread over replicas (a timing too)."""
    return [{k: v for k, v in h.items() if not k.startswith(TIMING) and not _is_spread(k)} for h in history]


def _is_spread(key: str) -> bool:
    """How the samples fell over the replicas, and so what travelled between ranks (timing-bound)."""
    return (key.startswith("rollout/replica") and key.endswith("/samples")) or key == "rollout/received_bytes_max_rank"


def uninterrupted_run(tmp_path_factory) -> Path:
    """The short quickstart, deterministic, to the end (``tests/conftest.py``'s ``full_run``:
    one run for this module and the runs elsewhere that must reproduce it)."""
    out = tmp_path_factory.mktemp("train") / "full"
    result = _train(out, *FULL_RUN)
    _ok(result)
    assert "hybridflow train:" in result.stdout and "held-out" in result.stdout  # the summary screen
    (out.parent / "stdout.txt").write_text(result.stdout)  # beside the run: the summary screen as printed
    (out.parent / "stderr.txt").write_text(result.stderr)  # and rank 0's log
    return out


WARM_UP = "sft.steps=150"
"""The SFT warm-up of the runs that must learn (the learning matrix's length): made once a session
(``tests/conftest.py``'s ``sft_warm_up``) and copied into each of their run directories."""


def warm_up_run(tmp_path_factory, *overrides: str) -> Path:
    """``run.mode=sft`` of the quickstart with the learning runs' warm-up (and ``overrides``, a seed
    say); returns its run directory. No tracking: a run seeded from its checkpoint starts an MLflow
    run of its own."""
    out = tmp_path_factory.mktemp("sft_warm_up") / "run"
    _ok(_train(out, "run.mode=sft", WARM_UP, "run.tracking.trackers=[]", "run.heldout_prompts=0", *overrides))
    return out


def seed_from_warm_up(warm_up: Path, out: Path) -> Path:
    """Copy the finished warm-up's ``checkpoints/sft`` into the run directory ``out``: a start there
    resumes after SFT (the path of a run stopped once its SFT was saved) and goes on with RL. The
    run must be started with the warm-up's settings (``WARM_UP``); its model must be the warm-up's."""
    import shutil

    shutil.copytree(warm_up / "checkpoints" / "sft", out / "checkpoints" / "sft")
    return out


@pytest.mark.claim("quickstart-reports")
@pytest.mark.features("routing_replay_r2")
def test_first_step_invariants(full_run: Path) -> None:
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] < LOGPROB_TOL
    assert summary["first_step_ppo_kl"] == 0.0
    assert summary["first_step_clipfrac"] == 0.0
    for key in ("heldout_reward_after_sft", "heldout_reward_after_rl", "steps", "wall_seconds"):
        assert summary[key] is not None, key
    assert summary["steps"] == 4


@pytest.mark.claim("quickstart-pushes-every-step", "correctness-gates")
def test_every_push_is_read_back_and_every_gate_passes(full_run: Path) -> None:
    """checks.refit_every=1: the engine's weights after each push are what the trainer shared,
    bit for bit; the engine samples from the trainer's distribution; no gate failed."""
    history = _history(full_run, "step_000004")
    pushed = [h for h in history if h.get("sync/engine_bytes")]
    assert pushed and all(h["checks/refit_max_rel_diff"] == 0.0 for h in pushed), history
    assert all(1.0 <= h["rollout/token_mult_prob_error"] < 1.001 for h in history), history
    assert all(h["checks/failed"] == 0.0 for h in history), history


@pytest.mark.claim("plan-is-what-runs")
def test_the_run_executes_the_plan_that_hybridflow_plan_prints(full_run: Path) -> None:
    summary = json.loads((full_run / "summary.json").read_text())
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.cli",
            "plan",
            "configs/quickstart_cpu.yaml",
            f"run.output_dir={full_run}",
            *SHORT,
            *FULL_RUN,
            "--no-reshard",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    lines = plan.stdout.splitlines()
    start = lines.index("stages:") + 1
    printed = [line.removeprefix("  ") for line in lines[start:] if line.startswith("  ")]
    printed = printed[: len(summary["executed_stages"])]
    # the first RL step as the ranks ran it: every stage, in order, with the switch executed before it
    assert summary["executed_stages"] == printed
    assert any(
        "switch before it: actor grads+optimizer -> host; engine weights resume" in line
        for line in summary["executed_stages"]
    )


@pytest.mark.claim("quickstart-pushes-every-step")
def test_engine_generates_with_the_updated_weights(full_run: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    history = _history(full_run, "step_000004")
    # steps 2..4 sample from weights pushed after an update: stale engine weights would show here
    for h in history[1:]:
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL, h
    # a step whose groups all scored alike has zero advantages (and gradient); not every step can
    assert any(h["actor/grad_norm"] > 0 for h in history)
    tensors = {}
    for name in ("step_000002", "step_000004"):
        dcp_to_torch_save(full_run / "checkpoints" / name / "actor", full_run / f"{name}.pt")
        tensors[name] = torch.load(full_run / f"{name}.pt")
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(tensors["step_000002"][key], tensors["step_000004"][key])


@pytest.mark.claim("quickstart-reports", "tracking-mlflow-tensorboard")
def test_mlflow_holds_the_metrics(full_run: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    summary = json.loads((full_run / "summary.json").read_text())
    client = MlflowClient(tracking_uri=summary["mlflow_uri"])
    rewards = client.get_metric_history(summary["mlflow_run_id"], "reward/mean")
    assert [m.step for m in rewards] == [1, 2, 3, 4]
    assert client.get_metric_history(summary["mlflow_run_id"], "actor/clipfrac")
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    # each held-out scoring's generations as a table, the ones on disk
    from hybridflow.sample_files import HELDOUT_COLUMNS, read

    for step in (0, 4):
        local = client.download_artifacts(summary["mlflow_run_id"], f"heldout/step_{step:06d}.json", str(tmp_path))
        table = json.loads(Path(local).read_text())
        assert table["columns"] == list(HELDOUT_COLUMNS)
        on_disk = read(full_run / "samples" / f"heldout_step_{step:06d}.jsonl")
        by_column = dict(zip(table["columns"], zip(*table["data"])))
        assert list(by_column["response"]) == [r["response"] for r in on_disk]
        assert list(by_column["reward"]) == [r["reward"] for r in on_disk]


@pytest.mark.claim("tracking-wandb")
def test_the_wandb_run_holds_the_metrics_the_tables_and_the_figure(full_run: Path) -> None:
    from tests.wandb_log import history, offline_runs, run_record

    (log,) = offline_runs(full_run)
    summary = json.loads((full_run / "summary.json").read_text())
    assert run_record(log).display_name == summary["run"]
    rows = history(log)
    assert [r["rl/step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]
    assert [r["sft/step"] for r in rows if "sft/loss" in r] == [0, 1, 2, 3]  # as MLflow has them
    logged = {key.rsplit("/", 1)[0] for r in rows for key in r if key.endswith("/_type")}
    tables = {f"samples/step_{s:06d}" for s in (1, 2, 3, 4)} | {"heldout/step_000000", "heldout/step_000004"}
    assert tables | {"figures/run", "figures/reward_curve"} <= logged, logged
    (row,) = [r for r in rows if "heldout/step_000004/path" in r]
    table = json.loads((log.parent / "files" / row["heldout/step_000004/path"]).read_text())
    rewards = [dict(zip(table["columns"], values))["reward"] for values in table["data"]]
    assert sum(rewards) / len(rewards) == pytest.approx(summary["heldout_reward_after_rl"], abs=1e-6)


@pytest.mark.claim("heldout-examples-on-screen")
def test_the_summary_screen_shows_a_solved_and_a_failed_heldout_example(full_run: Path) -> None:
    from hybridflow.sample_files import read

    screen = (full_run.parent / "stdout.txt").read_text()
    summary = json.loads((full_run / "summary.json").read_text())
    examples = summary["heldout_examples"]
    held = read(full_run / "samples" / "heldout_step_000004.jsonl")
    assert examples["count"] == len(held) == 16
    best = max(r["reward"] for r in held)
    assert (examples["solved"] or {}).get("reward", 0.0) == (best if best > 0 else 0.0)
    for kind in ("solved", "failed"):
        (line,) = [line for line in screen.splitlines() if line.startswith(f"  {kind} ")]
        example = examples[kind]
        if example is None:
            assert line.endswith("none of the 16 held-out responses")
        else:
            assert f"-> {example['response']!r} (expected {example['answer']}, " in line and len(line) <= 110
    assert len(screen.splitlines()) <= 40  # with the bars: still one screen


@pytest.mark.claim("quickstart-through-model-path", "quiet-terminal")
def test_rl_starts_from_the_warm_ups_hugging_face_export(full_run: Path) -> None:
    """The SFT warm-up is exported as a Hugging Face directory that transformers loads, and RL's
    actor is loaded from it slice by slice (the loader ``model.path`` uses; rank 0 says so)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = full_run / "checkpoints" / "sft" / "hf"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
    assert AutoTokenizer.from_pretrained(str(export)).chat_template
    AutoModelForCausalLM.from_pretrained(str(export))
    log = (full_run / "logs" / "rank0.log").read_text()  # megatron_adapters' notes: the log file, not the terminal
    assert "rank 0 loaded" in log and f"from {export} in" in log, log[-3000:]
    terminal = (full_run.parent / "stderr.txt").read_text()
    assert "rank 0 loaded" not in terminal and "Params for bucket" not in terminal, terminal[-3000:]


@pytest.mark.claim("no-silent-minute")
def test_every_phase_that_can_take_minutes_says_when_it_begins_and_ends(full_run: Path) -> None:
    terminal = (full_run.parent / "stderr.txt").read_text()
    for line in (
        "training: ",  # the data set's one count
        "building the actor (megatron tp=1 pp=1 vpp=1 ep=2 etp=1 cp=1 dp=2 (world 2, expert_dp 1)) and loading its "
        "weights ...",
        "building the actor: done in ",
        "starting the rollout engine (sglang tp=2",
        "starting the rollout engine: done in ",
        "held-out: scoring 16 prompts (greedy) at step 0 ...",
        "held-out: reward ",
    ):
        assert line in terminal, (line, terminal[-3000:])


@pytest.mark.claim("quickstart-reports", "progress-file")
def test_reports_are_written(full_run: Path) -> None:
    for figure in ("reward_curve.png", "run.png"):
        assert (full_run / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (full_run / "config.yaml").is_file()
    assert not list((full_run / "checkpoints").glob("*.partial"))
    progress = read_progress(full_run)  # for programs that watch the run (hybridflow.faults does)
    steps = read_state(checkpoint_dirs(full_run)[-1]).step
    assert {k: progress[k] for k in ("phase", "done", "total")} == {"phase": "rl", "done": steps, "total": steps}
    # the start-up phases as the driver saw them, in order, each ending after the one before
    marks = json.loads((full_run / STARTUP_FILE).read_text())["marks"]
    assert tuple(name for name, _ in marks) == PHASES
    times = [at for _, at in marks]
    assert times == sorted(times) and times[-1] - times[0] < 3600


def rescored(out: Path, records: list[dict]) -> list[float]:
    """The rewards of ``records`` recomputed from their logged text, as the run's reward function
    scores (its config: the run directory's resolved one)."""
    from hybridflow.config import load_config
    from hybridflow.rewards import score_rows

    recorded = [out / "config.yaml", *sorted((out / "checkpoints").glob("*/config.yaml"))]
    cfg = load_config(str(next(path for path in recorded if path.exists())))
    texts, answers = [r["response"] for r in records], [r["answer"] for r in records]
    return score_rows(texts, answers, [r["data_source"] for r in records], cfg.reward).scores


@pytest.mark.claim("samples-on-disk")
def test_every_step_writes_the_samples_it_scored_and_every_heldout_scoring_its_generations(full_run: Path) -> None:
    """Each RL step's first 16 samples (whole groups of rollout.n) and every held-out response,
    as the reward function read them: their rewards recomputed from the logged text are the ones
    the run used; the held-out files' means are the summary's scores."""
    from hybridflow.runtime.samples import RECORD_KEYS
    from hybridflow.sample_files import read, steps

    assert steps(full_run) == [1, 2, 3, 4] and steps(full_run, heldout=True) == [0, 4]
    for step in (1, 2, 3, 4):
        records = read(full_run / "samples" / f"step_{step:06d}.jsonl")
        assert [tuple(r) for r in records] == [RECORD_KEYS] * 16
        groups = [r["group"] for r in records]
        assert len(set(groups)) == 4 and all(groups.count(g) == 4 for g in groups)  # rollout.n=4 each
        assert [r["reward"] for r in records] == rescored(full_run, records)
        assert {r["policy_version"] for r in records} == {step - 1} and all(r["step"] == step for r in records)
        assert all(r["finish_reason"] in ("stop", "length") and 0 < r["response_tokens"] <= 4 for r in records)
        assert all(r["advantage"] is not None and r["logprob_diff"] < LOGPROB_TOL for r in records)
        means = {g: sum(r["reward"] for r in records if r["group"] == g) / 4 for g in groups}
        for r in records:  # GRPO: a response above its group's mean has a positive advantage
            assert (r["advantage"] > 0) == (r["reward"] > means[r["group"]]), r
    summary = json.loads((full_run / "summary.json").read_text())
    for step, key in ((0, "heldout_reward_after_sft"), (4, "heldout_reward_after_rl")):
        records = read(full_run / "samples" / f"heldout_step_{step:06d}.jsonl")
        assert len(records) == 16 and [r["reward"] for r in records] == rescored(full_run, records)
        assert sum(r["reward"] for r in records) / 16 == pytest.approx(summary[key], abs=1e-6)


@pytest.mark.claim("samples-command")
def test_the_samples_command_shows_a_steps_best_and_worst_and_names_what_is_missing(full_run: Path, capsys) -> None:
    from hybridflow.cli import main

    assert main(["samples", str(full_run), "--pick", "worst", "-n", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"samples: {full_run / 'samples'} (RL steps 1-4; held-out scorings at steps 0, 4)"
    assert out[2].startswith("step_000004.jsonl: 16 samples, mean reward ") and out[2].endswith("; the worst 2:")
    heads = [line for line in out if line.startswith("step 4 sample ")]
    assert len(heads) == 2 and all("[max] reward " in h and ("(stop)" in h or "(length)" in h) for h in heads)
    assert main(["samples", str(full_run), "--heldout", "--step", "0", "-n", "1"]) == 0
    assert "heldout_step_000000.jsonl: 16 samples" in capsys.readouterr().out
    assert main(["samples", str(full_run), "--step", "9"]) == 2
    assert "no samples of step 9: the RL steps with samples are 1-4" in capsys.readouterr().err


@pytest.mark.claim(
    "quickstart-resumes",
    "deterministic-resume-bit-for-bit",
    "restart-reproduces",
    "checkpoint-on-demand",
    "one-run-per-directory",
)
def test_a_run_stopped_during_sft_then_killed_resumes_and_reproduces(full_run: Path, tmp_path: Path) -> None:
    """A second start into the directory while the job runs is refused. A checkpoint request during
    SFT (what the Slurm script writes before the time limit), written from outside once the job
    runs, saves the SFT so far and stops; the next start goes on with SFT, then dies when RL step 3
    starts; the third start resumes from step 2. The end equals the uninterrupted run."""
    import time

    from hybridflow.runtime import stops

    out = tmp_path / "killed"

    def request_once_started() -> None:  # rank 0 writes config.yaml before it builds the SFT actor
        while not (out / "config.yaml").is_file():
            time.sleep(0.05)
        # the same command again while the run goes: refused, and the run below goes on unharmed
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "hybridflow.cli",
                "train",
                "configs/quickstart_cpu.yaml",
                f"run.output_dir={out}",
                *SHORT,
                *FULL_RUN,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and "is in use by a run that is still going" in second.stderr.splitlines()[-1]
        stops.request_checkpoint(out)

    stopped = _train(out, *FULL_RUN, during=request_once_started)
    _ok(stopped)
    (partial,) = [p.name for p in (out / "checkpoints").iterdir()]
    assert partial in ("sft_000001", "sft_000002", "sft_000003"), partial  # not the whole SFT (4 steps)
    assert f"checkpointed SFT step {int(partial[4:])}" in stopped.stderr, stopped.stderr[-2000:]
    assert not (out / stops.REQUEST_FILE).exists()
    crashed = _train(out, *FULL_RUN, fault_at=2)  # dies when step 3 (0-based 2) starts
    assert crashed.returncode != 0
    assert f"resuming from {out / 'checkpoints' / partial}" in crashed.stdout, crashed.stdout[-2000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["sft", "step_000002"], saved  # sft_000001 removed once the SFT was complete
    _ok(_train(out, *FULL_RUN))
    sft_losses = [
        json.loads((run / "checkpoints" / "sft" / "state.json").read_text())["sft_losses"] for run in (full_run, out)
    ]
    assert sft_losses[0] == sft_losses[1] and len(sft_losses[1]) == 4
    assert _deterministic(_history(out, "step_000004")) == _deterministic(_history(full_run, "step_000004"))
    first = json.loads((full_run / "summary.json").read_text())
    second = json.loads((out / "summary.json").read_text())
    assert second["heldout_reward_after_rl"] == first["heldout_reward_after_rl"]
    # three starts wrote the samples: each step's file once, as the uninterrupted run's
    for path in sorted((full_run / "samples").glob("*.jsonl")):
        assert (out / "samples" / path.name).read_text() == path.read_text(), path.name
    names = [sorted(p.name for p in (run / "samples").iterdir()) for run in (out, full_run)]
    assert names[0] == names[1]
    # and one wandb run over the three starts, reopened after the kill (pytest's own wandb service,
    # which earlier in-process tests start and export, is not the one a trainer uses); what the
    # killed start logged may be lost with it (wandb-core buffers its offline writes: CI once found
    # not even its run record), what the starts wrote is the uninterrupted run's, and the resumed
    # start's run and steps are all there
    from tests.wandb_log import history, offline_runs, records, run_record

    logs = offline_runs(out)
    written = [log for log in logs if any(r.WhichOneof("record_type") == "run" for r in records(log))]
    assert len(logs) == 3 and logs[-1] in written and len({run_record(log).run_id for log in written}) == 1
    rewards = [(r["rl/step"], r["reward/mean"]) for log in logs for r in history(log) if "reward/mean" in r]
    (full,) = offline_runs(full_run)
    uninterrupted = [(r["rl/step"], r["reward/mean"]) for r in history(full) if "reward/mean" in r]
    assert [step for step, _ in uninterrupted] == [1, 2, 3, 4]
    assert rewards[-2:] == uninterrupted[-2:] and set(rewards) <= set(uninterrupted), rewards


@pytest.mark.claim("deterministic-resume-bit-for-bit", "damaged-checkpoint-set-aside")
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
    full_run: Path, tmp_path: Path
) -> None:
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(full_run, out)
    newest = out / "checkpoints" / "step_000004"
    assert all((c / "checksums.json").is_file() for c in (out / "checkpoints").iterdir())
    shard = sorted((newest / "actor").glob("*.distcp"))[-1]
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # one byte changed in place: the size and .metadata still agree
    shard.write_bytes(bytes(damaged))
    assert (newest / "config.yaml").is_file()  # each checkpoint keeps the config it was saved under
    stop = _train(out, *FULL_RUN, "run.resume_fallback=stop")
    assert stop.returncode == 2 and f"{shard} has changed since it was written" in stop.stderr, stop.stderr[-2000:]
    result = _train(out, *FULL_RUN)
    _ok(result)
    assert f"checkpoint step_000004 is damaged: {shard} has changed since it was written" in result.stderr
    assert f"resuming from {out / 'checkpoints' / 'step_000002'}" in result.stdout
    assert (out / "checkpoints" / "step_000004.damaged").is_dir()
    assert _deterministic(_history(out, "step_000004")) == _deterministic(_history(full_run, "step_000004"))


def test_resume_never_refuses_a_run_directory_with_checkpoints(full_run: Path) -> None:
    result = _train(full_run, "run.resume=never")
    assert result.returncode == 2
    assert "run.resume=auto" in result.stderr and "checkpoints" in result.stderr


def _weights(checkpoint: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp)
    return torch.load(tmp)


@pytest.mark.claim("algorithms-registered-and-run", "critic-from-the-sft-policy")
def test_ppo_trains_a_critic_that_starts_from_the_sft_policy(tmp_path: Path) -> None:
    """PPO runs end to end: the critic (value head on the actor's model) is trained beside the
    actor and starts from the actor's SFT weights, not from a fresh initialisation."""
    out = tmp_path / "ppo"
    _ok(
        _train(
            out,
            "algorithm.name=ppo",
            "critic.enabled=true",
            "critic.parallel.ep=2",
            "critic.parallel.dp=2",
            "run.steps=2",
            "sft.steps=10",
            "run.checkpoint_every=0",
        )
    )
    history = _history(out, "step_000002")
    for h in history:
        assert h["critic/vf_loss"] > 0 and h["critic/grad_norm"] > 0, h
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL
    checkpoints = out / "checkpoints"
    sft = _weights(checkpoints / "sft" / "actor", tmp_path / "sft.pt")
    actor = _weights(checkpoints / "step_000002" / "actor", tmp_path / "actor.pt")
    critic = _weights(checkpoints / "step_000002" / "critic", tmp_path / "critic.pt")
    # two RL steps move the actor and the critic about as far from the SFT weights; a critic
    # that started from the initialisation stays as far from them as SFT moved (10x more, measured)
    for key in (
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
    ):
        moved_actor = (actor[key] - sft[key]).abs().mean()
        moved_critic = (critic[key] - sft[key]).abs().mean()
        assert moved_critic < 2 * moved_actor, (key, float(moved_critic), float(moved_actor))


@pytest.mark.claim("algorithms-registered-and-run", "dynamic-sampling-with-model-scorers", "dynamic-sampling-remax")
@pytest.mark.parametrize("algorithm", ["remax", "dapo"])
@pytest.mark.features("dynamic_sampling", "reward_model")
def test_algorithms_with_more_rollouts_per_step_train_on_dp_local_rows(
    full_run: Path, tmp_path: Path, algorithm: str
) -> None:
    """ReMax's greedy baseline and DAPO's extra draws are rollouts too: each DP rank receives its
    share of them, and the baseline / kept rows line up with the samples they belong to.

    The ReMax run also draws with dynamic sampling (once a crash at its first step: its greedy
    baselines indexed with the kept rows, none for the extra rounds; ``tests/runtime/test_kept.py``)
    and pushes by ``rollout.sync_route=full``: whole HF tensors gathered to the driver, every engine
    rank receives all of them; the engine then scores like the trainer, as with the sliced route of
    ``full_run``. The DAPO run has a reward model beside the rule (its weight 0, so the rule's ties
    still drop groups): its extra rounds are scored by it too."""
    out = tmp_path / algorithm
    if algorithm == "remax":
        extra = ["rollout.sync_route=full", "algorithm.dynamic_sampling=true"]
    else:
        from tests.reward.rm_models import make_rm_dir

        rm = make_rm_dir(tmp_path, "qwen3")
        # a dense reward model: the MoE actor's EP=2 is not its layout, DP=2 is
        extra = [
            f"reward_model.path={rm}",
            "reward_model.parallel.dp=2",
            "reward_model.weight=0",
            "reward.rule_weight=1",
        ]
    _ok(_train(out, f"algorithm.name={algorithm}", "run.steps=2", "run.checkpoint_every=2", *extra))
    history = _history(out, "step_000002")
    assert len(history) == 2
    # a DAPO step that kept no group has no rows to score (and skips its update)
    checked = [h["rollout/logprob_diff_max"] for h in history if "rollout/logprob_diff_max" in h]
    assert checked and max(checked) < LOGPROB_TOL, history
    again = [h for h in history if h["dapo/sampling_rounds"] > 1]  # both drew again at some step
    if algorithm == "remax":
        assert again, history
        _check_full_route(out, full_run)
    else:  # steps that drew again had the reward model score their extra rounds
        assert again and all("dapo/model_scores_mean" in h for h in again), history


def _check_full_route(out: Path, sliced_run: Path) -> None:
    """Every push of ``out`` (``rollout.sync_route=full``) carried the whole model to each engine
    rank; ``sliced_run``'s (the default sliced route) carried less."""
    from hybridflow.config import load_config
    from reshard.hf import hf_layout

    cfg = load_config(ROOT / "configs" / "quickstart_cpu.yaml")
    model_bytes = sum(math.prod(shape) * 4 for shape in hf_layout(cfg.model, dtype="float32").param_shapes(0).values())
    # a step whose update was skipped syncs nothing; each run pushed at least once
    pushed_full = [h["sync/engine_bytes"] for h in _history(out, "step_000002") if "sync/engine_bytes" in h]
    pushed_sliced = [h["sync/engine_bytes"] for h in _history(sliced_run, "step_000002") if "sync/engine_bytes" in h]
    assert pushed_full and pushed_sliced
    assert set(pushed_full) == {cfg.rollout.tp * model_bytes}
    assert max(pushed_sliced) < cfg.rollout.tp * model_bytes
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step_logprob_diff_max"] < LOGPROB_TOL


# every registered algorithm the tests above do not run (grpo: full_run; ppo, remax, dapo: above)
HF_ENGINE = ("rollout.engine=hf", "rollout.tp=1", "rollout.sync_route=full")
OTHER_ALGORITHMS = ("vapo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo", "gpg", "cispo")
ESTIMATOR_OR_LOSS_ONLY = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "cispo")
"""Algorithms that differ from grpo's run only by their estimator or policy-loss function: slow
tier. Those functions are checked against verl's numerics (tests/algorithms/), and the estimators'
batch-wide sums under DP against one process (tests/runtime/test_shares.py); the runs below keep
each distinct runtime path in the default tier (a critic and VAPO's LM loss, GSPO's sequence
ratio with rollout correction, RLOO's token-sum). REINFORCE++ with the reference model and the
adaptive KL reward runs in the default tier in
``test_a_reference_of_its_own_layout_reads_the_initial_weights_also_after_a_resume``."""


@pytest.mark.claim("reference-own-layout", "adaptive-kl-reward")
@pytest.mark.features("kl_reward")
def test_a_reference_of_its_own_layout_reads_the_initial_weights_also_after_a_resume(tmp_path: Path) -> None:
    """No SFT warm-up and no ``model.path``: the reference is the random actor's initial weights,
    which a fresh start keeps in ``checkpoints/initial`` and the reference reads under a layout of
    its own (TP=2 beside the actor's EP=2 x DP=2). Step 1 samples from those weights (KL 0); a
    run resumed after step 1 measures step 2's KL to them exactly as the uninterrupted run does
    (before, a resumed run copied the resumed actor into the reference: KL 0 at step 2). The KL
    is in the reward under the adaptive controller (REINFORCE++): 32 responses a step move its
    coefficient by at most 10%, and the resumed run takes it up where the checkpoint left it."""
    overrides = (
        "sft.steps=0",
        "run.steps=2",
        "run.checkpoint_every=1",
        "run.heldout_prompts=0",
        "algorithm.name=reinforce_plus_plus",
        "reference.enabled=true",
        "algorithm.kl_reward_coef=0.05",
        "algorithm.kl_reward_target=0.001",
        "algorithm.kl_reward_horizon=64",
        "reference.parallel.tp=2",
        "reference.parallel.ep=1",
        "reference.parallel.dp=1",
        "reference.offload=true",  # on the host between uses (the offloaded path; on a CPU nothing moves)
        "reward.function=tests.reward.length.chars",  # rewards that differ: the policy moves
        *HF_ENGINE,
    )
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _ok(_train(whole, *overrides))
    assert (whole / "checkpoints" / "initial" / "hf" / "config.json").is_file()
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    _ok(_train(resumed, *overrides))
    history = _history(whole, "step_000002")
    first, second = (h["actor/reward_kl"] for h in history)
    assert first < 1e-6 and second > 1e-3, (first, second)
    assert _deterministic(_history(resumed, "step_000002")) == _deterministic(history)  # the KL, its coefficient...
    error = min(max(first / 0.001 - 1, -0.2), 0.2)
    assert history[0]["actor/reward_kl_coef"] == 0.05 and history[0]["actor/reward_kl_responses"] == 32
    assert history[0][KL_COEF_NEXT] == pytest.approx(0.05 * (1 + error * 32 / 64)) != 0.05
    assert history[1]["actor/reward_kl_coef"] == history[0][KL_COEF_NEXT]
    summary = json.loads((whole / "summary.json").read_text())
    (line,) = [line for line in summary["executed_stages"] if " ref_logprob [reference] " in line]
    assert "megatron tp=2 pp=1 " in line and "(its own: reference.parallel)" in line, line


@pytest.mark.parametrize(
    "algorithm",
    [
        pytest.param(a, marks=pytest.mark.slow)
        if a in ESTIMATOR_OR_LOSS_ONLY
        else pytest.param(a, marks=pytest.mark.features("rollout_correction_mis"))
        if a == "gspo"
        else a
        for a in OTHER_ALGORITHMS
    ],
)
@pytest.mark.claim("algorithms-registered-and-run", "rollout-correction", "adaptive-kl-reward")
def test_every_registered_algorithm_runs_two_rl_steps_end_to_end(tmp_path: Path, algorithm: str) -> None:
    """``hybridflow train``, two RL steps: every step updates the actor with a finite loss, the
    engine scores like the trainer, and the critic-based ones train their critic (built by
    default, under the actor's layout). These runs take the transformers engine, which starts in
    the ranks' own processes, half a run's wall time here: what they test is the algorithm, and
    the SGLang engine carries grpo, ppo, remax and dapo through the same runtime above."""
    out = tmp_path / algorithm
    # one run also carries the rollout correction through the runtime (it works with every loss)
    correction = (
        ("algorithm.rollout_correction=mis", "algorithm.rollout_correction_level=geometric")
        if algorithm == "gspo"
        else ()
    )
    if algorithm == "rloo":  # and one the unnormalised token-sum aggregation
        correction = ("algorithm.loss_agg_mode=token-sum",)
    if algorithm == "reinforce_plus_plus":  # the adaptive in-reward KL coefficient
        correction = (
            "reference.enabled=true",
            "algorithm.kl_reward_coef=0.05",
            "algorithm.kl_reward_target=0.001",
            "algorithm.kl_reward_horizon=64",
        )
    if algorithm == "vapo":  # the critic's own learning rate
        correction = ("train.critic_lr=2e-3",)
    _ok(
        _train(
            out,
            f"algorithm.name={algorithm}",
            "run.steps=2",
            "run.checkpoint_every=2",
            "sft.steps=1",
            "run.heldout_prompts=0",
            *HF_ENGINE,
            *correction,
        )
    )
    history = _history(out, "step_000002")
    assert [h["step"] for h in history] == [1, 2]
    if algorithm == "rloo":  # metrics are token-weighted even though the loss has no divisor
        assert all(h["actor/entropy"] > 0 for h in history), history
    elif algorithm == "reinforce_plus_plus":  # 32 responses a step move the coefficient by <= 10%
        first, second = history
        error = min(max(first["actor/reward_kl"] / 0.001 - 1, -0.2), 0.2)
        assert first["actor/reward_kl_coef"] == 0.05 and first["actor/reward_kl_responses"] == 32, first
        assert first[KL_COEF_NEXT] == pytest.approx(0.05 * (1 + error * 32 / 64)) != 0.05, first
        assert second["actor/reward_kl_coef"] == first[KL_COEF_NEXT], second
    elif algorithm == "vapo":
        assert all(h["critic/lr"] == 2e-3 and h["actor/lr"] == 1e-3 for h in history), history
    elif correction:  # fp32 engine and trainer agree: nothing is dropped, every weight is about 1
        assert all(h["actor/rollout_corr/dropped_fraction"] == 0.0 for h in history), history
        assert all(abs(h["actor/rollout_corr/weight_mean"] - 1) < 1e-3 for h in history), history
    for h in history:
        # one SFT step leaves rewards mostly 0: a group of equal rewards has no gradient (norm 0)
        assert h["actor/updated"] == 1.0 and math.isfinite(h["actor/pg_loss"] + h["actor/grad_norm"]), h
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL
        if algorithm == "vapo":
            assert h["critic/vf_loss"] > 0, h
    from hybridflow.algorithms.recipes import algorithm_names

    assert set(algorithm_names()) == {"grpo", "ppo", "remax", "dapo", *OTHER_ALGORITHMS}  # none left untried
