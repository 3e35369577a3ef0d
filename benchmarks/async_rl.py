"""Asynchronous RL benchmark: sync vs one_step_off vs async K=2 (whole batches, and partial
rollouts) on a long-tail task.

    PYTHONPATH=. .venv/bin/python benchmarks/async_rl.py [--json PATH] [--steps 8] [--sft-steps 150] [--modes a,b]

The quickstart's max task with separate placement (2 actor ranks, one tp=1 engine rank),
rewritten so that a few prompts generate 8x longer: every 8th training prompt is marked
(``max(a,b)?=``) and its SFT demonstration pads the answer with filler to 8x the usual
response, so after the warm-up the engine's batches carry a long tail. The held-out prompts
stay the task's own. Each mode is one ``hybridflow train`` run with the same seed; steps per
second are taken over the RL steps after the first (the first fills the pipeline), from each
step's ``timing/step_wall``; the overlap fraction is the mean of ``async/overlap_fraction``
(sync: 0 by construction, generation and training never run at once). Prints one JSON object,
``{"modes": [{"mode", "steps_per_second", "overlap_fraction", "heldout_reward"}, ...], ...}``;
``--json`` also writes it (temporary file, then rename). ``label`` tells the two async runs apart
(``async``, ``async_partial``: ``async_rl.partial_rollout`` with 6 tokens per version).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

from hybridflow.config import load_config  # noqa: E402
from hybridflow.tasks import make_task_files  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart_cpu.yaml"
MODES = {
    "sync": ["async_rl.mode=sync"],
    "one_step_off": ["async_rl.mode=one_step_off"],
    "async": ["async_rl.mode=async", "async_rl.max_staleness=2"],
    "async_partial": [
        "async_rl.mode=async",
        "async_rl.max_staleness=2",
        "async_rl.partial_rollout=true",
        "async_rl.segment_tokens=6",
    ],
}
LONG_EVERY, LONG_FACTOR = 8, 8
COMMON = [
    "rollout.placement=separate",
    "rollout.tp=1",
    "run.prompts_per_step=16",
    "rollout.n=8",
    "run.heldout_prompts=20",
    "run.checkpoint_every=0",
    "data.max_response_length=24",
    "algorithm.rollout_correction=tis",
]


def _long_tail_files(out: Path) -> tuple[Path, Path]:
    """The task's files, every LONG_EVERY-th training prompt marked and its demonstration padded."""
    cfg = load_config(str(CONFIG), [])
    train, heldout = make_task_files(cfg.task, cfg.data, out / "task", seed=cfg.run.seed, sft_key=cfg.sft.response_key)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    key = cfg.sft.response_key
    for i, row in enumerate(rows):
        if i % LONG_EVERY == 0:
            row["prompt"] = re.sub(r"=$", "?=", row["prompt"])
            row[key] = f"{row[key]} " + "z" * (2 * LONG_FACTOR - 2)  # 16 tokens: 8x a short answer and its end
    long_train = out / "long_tail_train.jsonl"
    long_train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return long_train, heldout


def _run(mode: str, out: Path, train: Path, heldout: Path, steps: int, sft_steps: int) -> dict:
    run_dir = out / mode
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        str(CONFIG),
        f"run.output_dir={run_dir}",
        f"run.steps={steps}",
        f"sft.steps={sft_steps}",
        f"data.train_files=[{train}]",
        f"data.heldout_files=[{heldout}]",
        *COMMON,
        *MODES[mode],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"{mode} run failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    history = json.loads(next((run_dir / "checkpoints").glob("step_*/state.json")).read_text())["history"]
    steady = history[1:]  # the first step fills the pipeline
    wall = sum(h["timing/step_wall"] for h in steady)
    lengths = [h["response_length/mean"] for h in history]
    cfg = load_config(str(CONFIG), MODES[mode])
    return {
        "mode": cfg.async_rl.mode,
        "label": mode,
        "partial_rollout": cfg.async_rl.partial_rollout,
        "steps_per_second": len(steady) / wall,
        "overlap_fraction": sum(h.get("async/overlap_fraction", 0.0) for h in steady) / len(steady),
        "heldout_reward": summary["heldout_reward_after_rl"],
        "heldout_reward_after_sft": summary["heldout_reward_after_sft"],
        "staleness_mean": sum(h.get("async/staleness_mean", 0.0) for h in history) / len(history),
        "response_length_mean": sum(lengths) / len(lengths),
        "generation_seconds_per_step": sum(h["timing/generate"] for h in steady) / len(steady),
        "run_seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    parser.add_argument("--steps", type=int, default=8, help="RL steps per mode")
    parser.add_argument("--sft-steps", type=int, default=150, help="SFT warm-up steps per mode")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, sync first (of {', '.join(MODES)})")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridflow-async-bench-") as tmp:
        out = Path(tmp)
        train, heldout = _long_tail_files(out)
        chosen = args.modes.split(",")
        if chosen[0] != "sync" or not set(chosen) <= set(MODES):
            parser.error(f"--modes={args.modes}: list sync first, then any of {', '.join(MODES)}")
        modes = [_run(mode, out, train, heldout, args.steps, args.sft_steps) for mode in chosen]
    sync = modes[0]["steps_per_second"]
    for m in modes:
        m["speedup_vs_sync"] = m["steps_per_second"] / sync
    result = {
        "modes": modes,
        "cpu_count": os.cpu_count(),
        "setup": "quickstart max task, 2 actor ranks (EP=2) + 1 "
        f"engine rank (tp=1), every {LONG_EVERY}th training prompt {LONG_FACTOR}x longer, "
        f"{args.steps} RL steps x 16 prompts x 8 samples, steps/s over steps 2..{args.steps}",
        "goal_async_1_5x_sync_met": next((m["speedup_vs_sync"] >= 1.5 for m in modes if m["label"] == "async"), None),
        "note": "one run per mode: after the first step the modes' policies differ, and so do their "
        "response lengths (response_length_mean) and generation work; on a CPU shared with other "
        "jobs the load also varies between the runs, and overlapped processes take a larger share "
        "of contended cores. Read the speed-up as indicative, not as a controlled measurement. The "
        "engine runs its requests in the order they were announced, so a step's weight push waits "
        "for the batch in flight: async K=2 runs further ahead than one_step_off but cannot absorb "
        "a long batch by more than one step. Partial rollouts generate a batch started ahead 6 tokens "
        "per request per version: the rest runs after the pushes, between steps, so less of it "
        "overlaps training than with whole batches.",
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
