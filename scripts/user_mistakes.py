"""Make the mistakes users make, one command each, and tabulate what they see.

    .venv/bin/python scripts/user_mistakes.py --work DIR [--json PATH] [--only N,M]

Every case runs the real command line (``python -m hybridflow.cli ...``) in its own process, as
a user would, and records the last three lines of its output, the exit status and the seconds
until it ended. The cases that need a run directory with checkpoints share one short quickstart
run made first (``DIR/base``; each case damages its own copy). The table goes to stdout as
Markdown; ``--json`` keeps it as data. Nothing here asserts: the tests do (``tests/launch``,
``tests/runtime``, ``tests/test_train.py``); this shows a person what the user sees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the tests' fault hooks are imported from the checkout
from tests.injection import environment  # noqa: E402

CONFIG = "configs/quickstart_cpu.yaml"
SHORT = ["sft.steps=4", "run.steps=2", "run.checkpoint_every=1", "run.heldout_prompts=8", "run.prompts_per_step=8",
         "rollout.n=4"]
FAST = ["rollout.engine=hf", "rollout.tp=1", "rollout.sync_route=full"]  # the in-rank engine: quicker starts


@dataclass
class Case:
    area: str
    mistake: str
    args: list[str]
    """After ``python -m hybridflow.cli``; ``{run}`` is this case's run directory, ``{work}`` the work one."""
    setup: Callable[[Path, Path], None] | None = None
    """(this case's run directory, the work directory) -> None, before the command."""
    env: dict[str, str] = field(default_factory=dict)
    during: Callable[[subprocess.Popen, Path], None] | None = None
    """Acts on the running command (a signal, a request file), once."""
    needs_run: bool = False
    """Starts from a copy of the shared run directory."""


@dataclass
class Seen:
    area: str
    mistake: str
    last_lines: list[str]
    exit: int
    seconds: float
    """From the start of the command, or from the ``during`` act (a signal) when there is one."""
    left: list[str]
    """Processes of the command still alive 30 s after it ended (none expected)."""


def _train(*overrides: str) -> list[str]:
    return ["train", CONFIG, "run.output_dir={run}", *SHORT, *overrides]


def _write(name: str, text: str) -> Callable[[Path, Path], None]:
    def setup(run: Path, work: Path) -> None:
        (work / name).write_text(text)
    return setup


def _model_dir(name: str, kind: str, **overrides) -> Callable[[Path, Path], None]:
    """A tiny qwen3 directory ``{work}/<name>``: a causal LM, or transformers' reward model of one."""
    def setup(run: Path, work: Path) -> None:
        if kind == "reward":
            from tests.reward.rm_models import make_rm_dir

            make_rm_dir(work / name, "qwen3").rename(work / name / "rm")
        else:
            from hybridflow.rollout.tiny import make_tiny_model_dir

            make_tiny_model_dir(work / name, "qwen3", **overrides)
    return setup


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


def _drop_shard(run: Path, work: Path) -> None:
    sorted((_newest(run) / "actor").glob("*.distcp"))[-1].unlink()


def _flip_byte(run: Path, work: Path) -> None:
    shard = sorted((_newest(run) / "actor").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _drop_state(run: Path, work: Path) -> None:
    (_newest(run) / "state.json").unlink()


def _signal_once_started(signum: int) -> Callable[[subprocess.Popen, Path], None]:
    def during(job: subprocess.Popen, run: Path) -> None:
        _wait_for(run / "config.yaml", job)
        time.sleep(3.0)
        job.send_signal(signum)
    return during


def _request_once_started(job: subprocess.Popen, run: Path) -> None:
    _wait_for(run / "config.yaml", job)
    (run / "checkpoint.request").write_text("checkpoint at the next step boundary and stop\n")


def _wait_for(path: Path, job: subprocess.Popen) -> None:
    while not path.exists() and job.poll() is None:
        time.sleep(0.05)


def _busy(run: Path, work: Path) -> None:
    """Another run holds the directory for 90 s (a stand-in for the same command typed twice)."""
    hold = ("import sys, time\nfrom launch.run_lock import hold_run_directory\n"
            "with hold_run_directory(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(90)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    holder.stdout.readline()


def _a_file(run: Path, work: Path) -> None:
    run.parent.mkdir(parents=True, exist_ok=True)
    run.write_text("not a directory\n")


def _hf_dir(config: dict) -> Callable[[Path, Path], None]:
    def setup(run: Path, work: Path) -> None:
        shutil.rmtree(work / "hf", ignore_errors=True)
        (work / "hf").mkdir()
        (work / "hf" / "config.json").write_text(json.dumps(config))
    return setup


DEEPSEEK_GROUPS = {  # a tiny DeepSeek-V3 whose routing picks 2 experts from the best 2 of 4 groups
    "model_type": "deepseek_v3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 2.5,
    "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "norm_topk_prob": True, "q_lora_rank": 48,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
ROWS_WITHOUT_PROMPT = '{"question": "1+1?", "answer": "2"}\n'

CASES = [
    Case("reward", "`reward.function=maxx` (misspelt)", _train("reward.function=maxx")),
    Case("reward", "`reward.function=mypkg.rewards.score` (no such module)", _train("reward.function=mypkg.rewards.score")),
    Case("reward", "`reward.function=hybridflow.rewards.nope`", _train("reward.function=hybridflow.rewards.nope")),
    Case("reward", "`reward.kwargs={scale: 2}` that the user's function does not take",
         _train("reward.function=myrewards.score", "reward.kwargs={scale: 2}"),
         setup=_write("myrewards.py", "def score(response, answer):\n    return float(response.strip() == str(answer))\n"),
         env={"PYTHONPATH": "{work}"}),
    Case("data", "training file missing", _train("data.train_files=[{work}/nope.jsonl]")),
    Case("data", "empty training file", _train("data.train_files=[{work}/empty.jsonl]"), setup=_write("empty.jsonl", "")),
    Case("data", "rows without the prompt column", _train("data.train_files=[{work}/cols.jsonl]"),
         setup=_write("cols.jsonl", ROWS_WITHOUT_PROMPT)),
    Case("data", "a `.csv` data file", _train("data.train_files=[{work}/rows.csv]"), setup=_write("rows.csv", "a,b\n1,2\n")),
    Case("data", "held-out file missing", _train("data.heldout_files=[{work}/nope.jsonl]")),
    Case("config", "`rollout.ep=2` on a machine without a GPU", _train("rollout.ep=2")),
    Case("config", "`rollout.tp=3` for 4 attention heads", _train("rollout.tp=3")),
    Case("config", "`run.resume_fallback=later`", _train("run.resume_fallback=later")),
    Case("config", "`model.num_layers=[1,2]`", _train("model.num_layers=[1,2]")),
    Case("config", "`train={a: 1}`", _train("train={a: 1}")),
    Case("config", "`data.train_files=5`", _train("data.train_files=5")),
    Case("config", "`reward.kwargs=[1]`", _train("reward.kwargs=[1]")),
    Case("config", "`rollout.enable_dp_attention=5`", _train("rollout.enable_dp_attention=5")),
    Case("config", "`run.name=${oops`", _train("run.name=${oops")),
    Case("config", "config path misspelt", ["train", "configs/quickstart_cpu.yml"]),
    Case("config", "`algorithm.nmae=ppo`", _train("algorithm.nmae=ppo")),
    Case("config", "`algorithm.name=ppo2`", _train("algorithm.name=ppo2")),
    Case("config", "`train.global_batch_size=100` with micro-batch 16", _train("train.global_batch_size=100")),
    Case("config", "`algorithm.name=dapo rollout.n=1`", _train("algorithm.name=dapo", "rollout.n=1")),
    Case("config", "`packing.max_tokens_per_micro_batch=16` (below one sample's 32 + 4 tokens)",
         _train("packing.enabled=true", "packing.max_tokens_per_micro_batch=16")),
    Case("config", "`async_rl.mode=async` with colocated placement", _train("async_rl.mode=async")),
    Case("frozen models", "`reward_model.path` at a causal LM (no score head)",
         _train("reward_model.path={work}/causal"), setup=_model_dir("causal", "causal")),
    Case("frozen models", "`model.path` at a reward model", _train("model.path={work}/rmdir/rm", "model.init=null"),
         setup=_model_dir("rmdir", "reward")),
    Case("frozen models", "`judge.template` without `{response}`", _train('judge.template="Rate {prompt}"')),
    Case("frozen models", "`distillation.teacher_path` with another vocabulary",
         _train("distillation.teacher_path={work}/teacher"), setup=_model_dir("teacher", "causal", vocab_size=300)),
    Case("frozen models", "`distillation.parallel.tp=1` (1 rank; the actor runs on 2)",
         _train("distillation.teacher_path={work}/teacher2", "distillation.parallel.tp=1"),
         setup=_model_dir("teacher2", "causal")),
    Case("launch", "`slurm --nodes 1 --gpus-per-node 1` for a 2-rank layout",
         ["slurm", "--nodes", "1", "--gpus-per-node", "1", CONFIG, "run.output_dir={run}"]),
    Case("launch", "`launch --node-rank 2 --nnodes 2`",
         ["launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29511",
          CONFIG, "run.output_dir={run}"]),
    Case("launch", "`launch --nnodes 2 --nproc-per-node 2` for a 2-rank layout",
         ["launch", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29512", CONFIG,
          "run.output_dir={run}"]),
    Case("launch", "a joining node given an endpoint that is not torchrun's (10.255.255.1)",
         ["launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1", "--rdzv-endpoint",
          "10.255.255.1:29500", "--rdzv-wait-s", "5", CONFIG, "run.output_dir={run}", "rollout.gpus_per_node=1"]),
    Case("launch", "node rank 0 given another machine's address",
         ["launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0", "--rdzv-endpoint",
          "10.255.255.1:29500", CONFIG, "run.output_dir={run}", "rollout.gpus_per_node=1"]),
    Case("converter", "HF directory missing", ["convert", "hf-to-mcore", "--hf", "{work}/missing", "--out", "{work}/o1"]),
    Case("converter", "`model_type` unknown", ["convert", "hf-to-mcore", "--hf", "{work}/hf", "--out", "{work}/o2"],
         setup=_hf_dir({"model_type": "qwen9"})),
    Case("converter", "DeepSeek-V3 group-limited routing megatron-core computes differently",
         ["convert", "hf-to-mcore", "--hf", "{work}/hf", "--out", "{work}/o3"], setup=_hf_dir(DEEPSEEK_GROUPS)),
    Case("converter", "mcore-to-hf from a Hugging Face directory",
         ["convert", "mcore-to-hf", "--mcore", "{work}/hf", "--out", "{work}/o4"], setup=_hf_dir({"model_type": "llama"})),
    Case("checkpoint", "newest checkpoint lost a shard, `run.resume_fallback=stop`",
         _train("run.resume_fallback=stop"), setup=_drop_shard, needs_run=True),
    Case("checkpoint", "a byte of a shard changed in place, `run.resume_fallback=stop`",
         _train("run.resume_fallback=stop"), setup=_flip_byte, needs_run=True),
    Case("checkpoint", "the same under the default `previous` (the run goes on)", _train(*FAST),
         setup=_flip_byte, needs_run=True),
    Case("checkpoint", "the newest checkpoint's state.json deleted, `stop`", _train("run.resume_fallback=stop"),
         setup=_drop_state, needs_run=True),
    Case("checkpoint", "resume after `model.num_layers=3`", _train("model.num_layers=3"), needs_run=True),
    Case("checkpoint", "`run.resume=never` into a directory with checkpoints", _train("run.resume=never"),
         needs_run=True),
    Case("checkpoint", "resume under another layout (`actor.parallel.tp=2 actor.parallel.ep=1`)",
         _train(*FAST, "actor.parallel.tp=2", "actor.parallel.ep=1", "run.steps=3"), needs_run=True),
    Case("checkpoint", "the disk fills up while a checkpoint is saved", _train(*FAST, "run.steps=3"),
         env=environment(DISK_FULL="step_000003.partial"),
         needs_run=True),
    Case("run directory", "the same command again while the first run goes", _train(*FAST), setup=_busy),
    Case("run directory", "`run.output_dir` is an existing file", _train(*FAST), setup=_a_file),
    Case("run directory", "`run.output_dir=/sys/run` (cannot be written)", ["train", CONFIG, "run.output_dir=/sys/run"]),
    Case("config", "`moe.routing_replay: off` as the README writes it (YAML 1.1 reads a boolean)",
         _train(*FAST, "moe.routing_replay=off", "run.steps=1")),
    Case("signals", "SIGTERM to `hybridflow train` during SFT", _train(*FAST, "sft.steps=400"),
         during=_signal_once_started(signal.SIGTERM)),
    Case("signals", "SIGINT (Ctrl-C) to `hybridflow train` during SFT", _train(*FAST, "sft.steps=400"),
         during=_signal_once_started(signal.SIGINT)),
    Case("signals", "a checkpoint request during SFT (the Slurm time limit)", _train(*FAST, "sft.steps=400"),
         during=_request_once_started),
    Case("ranks", "a rank raises mid-run", _train(*FAST), env=environment(RAISE_AT_STEP="0:1")),
]


MARK = "HYBRIDFLOW_MISTAKE_CASE"
"""In every process of a case's command (inherited), so what outlives it is found."""


def _job_processes(case: str) -> list[str]:
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            if (proc.info["environ"] or {}).get(MARK) == case:
                left.append(" ".join(proc.info["cmdline"] or [])[:80])
        except (psutil.Error, TypeError):
            continue
    return left


def run_case(case: Case, work: Path, base: Path | None, index: int) -> Seen:
    run = work / f"case{index:02d}"
    shutil.rmtree(run, ignore_errors=True)
    if case.needs_run:
        shutil.copytree(base, run)
    if case.setup is not None:
        case.setup(run, work)
    args = [a.replace("{run}", str(run)).replace("{work}", str(work)) for a in case.args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **{k: v.replace("{work}", str(work)) for k, v in case.env.items()}}
    started = time.perf_counter()
    job = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", *args], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                           env={**env, MARK: run.name})
    if case.during is not None:
        case.during(job, run)
        started = time.perf_counter()
    output, _ = job.communicate(timeout=1800)
    seconds = time.perf_counter() - started
    time.sleep(0.5)
    lines = [line for line in output.splitlines() if line.strip()]
    return Seen(case.area, case.mistake, lines[-3:], job.returncode, round(seconds, 1), _job_processes(run.name))


def _base_run(work: Path) -> Path:
    base = work / "base"
    if not (base / "summary.json").is_file():
        shutil.rmtree(base, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", CONFIG, f"run.output_dir={base}",
                               *SHORT, *FAST], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise SystemExit(f"the base run failed: {done.stderr[-2000:]}")
    return base


def markdown(seen: list[Seen]) -> str:
    rows = ["| # | area | mistake | what the user sees (last 3 lines) | exit | s (after the act, if any) | processes left |",
            "|---|---|---|---|---|---|---|"]
    for i, s in enumerate(seen, 1):
        shown = " / ".join(line.replace("|", "\\|")[:300] for line in s.last_lines)
        rows.append(f"| {i} | {s.area} | {s.mistake} | {shown} | {s.exit} | {s.seconds} | {len(s.left)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (kept, for a look)")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.add_argument("--only", help="comma-separated case numbers (1-based)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    chosen = [int(n) for n in args.only.split(",")] if args.only else range(1, len(CASES) + 1)
    base = _base_run(args.work) if any(CASES[n - 1].needs_run for n in chosen) else None
    seen = []
    for n in chosen:
        seen.append(run_case(CASES[n - 1], args.work.resolve(), base, n))
        print(f"[{n}/{len(CASES)}] exit {seen[-1].exit} in {seen[-1].seconds} s: {CASES[n - 1].mistake}",
              file=sys.stderr, flush=True)
    print(markdown(seen))
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in seen], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
