"""SIGTERM at random moments of a quickstart run, on a loaded machine: does every process go?

    .venv/bin/python scripts/stop_soak.py --work DIR [--runs 20] [--seed 0] [--load 2] [--json PATH]

First one uninterrupted run gives the run's length T (start-up, SFT, engine start, RL steps with
a checkpoint every step, held-out scoring). Then each of ``--runs`` runs gets SIGTERM to its
launcher (``hybridflow train``, as Slurm or a user's kill sends it) at a random moment of its own
slice of [0, 0.9 T) (the slices spread the moments over every phase, start-up included), while
``--load`` busy processes keep the cores loaded; 30 s after the signal every
process that carries the run's marker in its environment (the launcher, torchrun, the ranks,
SGLang's engine processes and their children) must be gone. A process still there is named and
killed. Prints one JSON report: each run's moment, the phase it hit (from the run's files), the
seconds until the last process went, and what was left.

Slurm sends SIGKILL 30 s after SIGTERM; a straggler holding GPU memory then fails the next job.
Nothing here asserts: tests/launch/test_signals.py does, at fixed moments; this shows the rate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
MARKER = "HYBRIDFLOW_STOP_SOAK"
SHORT = ["sft.steps=20", "run.steps=6", "run.checkpoint_every=1", "run.heldout_prompts=8", "run.heldout_every=3"]
GRACE_S = 30.0


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _start(out: Path, marker: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", "configs/quickstart_cpu.yaml", f"run.output_dir={out}"]
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": "1"}
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (the child's output, closed with the run)
    return subprocess.Popen(
        [*cmd, *SHORT], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _phase(out: Path) -> str:
    """Where the run was, from its files: the newest thing it wrote."""
    progress = out / "progress.json"
    if progress.is_file():
        return f"rl step {json.loads(progress.read_text()).get('done')}"
    if (out / "checkpoints" / "sft").is_dir():
        return "after SFT (engine start / held-out)"
    if (out / "config.yaml").is_file():
        return "SFT or model build"
    return "start-up"


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def one_run(work: Path, index: int, at: float | None) -> dict:
    out, marker = work / f"run{index:02d}", uuid.uuid4().hex
    started = time.monotonic()
    job = _start(out, marker)
    if at is None:
        job.wait()
        return {"seconds": time.monotonic() - started, "exit": job.returncode}
    while time.monotonic() - started < at and job.poll() is None:
        time.sleep(0.05)
    phase = _phase(out) if job.poll() is None else "finished"
    signalled = time.monotonic()
    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
    gone = None
    while time.monotonic() - signalled < GRACE_S:
        if not _marked(marker):
            gone = time.monotonic() - signalled
            break
        time.sleep(0.2)
    left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in _marked(marker)]
    for proc in _marked(marker):
        proc.kill()
    job.wait()
    return {
        "at_s": round(at, 1),
        "phase": phase,
        "gone_after_s": gone and round(gone, 1),
        "left": left,
        "exit": job.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for burner in burners:
        burner.start()
    try:
        whole = one_run(args.work, 0, None)
        rng, span = random.Random(args.seed), 0.9 * whole["seconds"] / args.runs
        runs = [one_run(args.work, i + 1, span * (i + rng.random())) for i in range(args.runs)]
    finally:
        stop.set()
    report = {
        "uninterrupted_s": round(whole["seconds"], 1),
        "load_processes": args.load,
        "runs": runs,
        "clean": sum(not r["left"] for r in runs),
        "slowest_s": max(GRACE_S if r["gone_after_s"] is None else r["gone_after_s"] for r in runs),
        "finished_before_the_signal": sum(r["exit"] == 0 for r in runs),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if report["clean"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
