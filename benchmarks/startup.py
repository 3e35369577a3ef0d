"""Start-up benchmark: seconds from the command to the end of the first RL step, by phase, for
the CPU quickstart's three shapes.

    PYTHONPATH=. .venv/bin/python benchmarks/startup.py [--json PATH] [--shapes colocated,...]

Each shape is one ``hybridflow train configs/quickstart_cpu.yaml`` run, one RL step, no SFT
warm-up and no held-out scoring (they are work, not start-up). The driver rank records when each
phase ended (``hybridflow/runtime/startup_clock.py``); this script started the command, so

    launcher    the command until torchrun's worker exists (the CLI's imports, preflight, torchrun)
    imports     the worker's modules
    rendezvous  the process groups
    session     the data files, tokenizer and prompts, the MLflow run
    warm_up     the SFT warm-up (none here)
    models      the actor and reference built (megatron-core), their weights loaded
    engines     the rollout engines started, with the weight sync's plan (separate placement:
                the engine ranks start theirs meanwhile; the first push waits for them)
    first_push  the actor's weights pushed into them
    first_step  the first RL step (generation, log-probs, update, push)

Prints ``{"cases": [{"shape", "seconds_to_first_step", "phases": {name: seconds}}]}``; ``--json``
also writes it (temporary file, then rename).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

from hybridflow.runtime.startup_clock import STARTUP_FILE  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart_cpu.yaml"
SHAPES = {
    "colocated": [],  # the quickstart as it ships: one engine, tp=2, on the actor's two processes
    "two_replicas": ["rollout.tp=1", "rollout.num_replicas=2"],
    "separate": ["rollout.placement=separate", "rollout.tp=1"],
}
ONE_STEP = ["run.steps=1", "sft.steps=0", "run.heldout_prompts=0", "run.checkpoint_every=0"]


def run_shape(shape: str, work: Path) -> dict:
    """One run of ``shape``: its seconds to the first step and each phase's share."""
    out = work / shape
    command = [sys.executable, "-m", "hybridflow.cli", "train", str(CONFIG), f"run.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.time()
    done = subprocess.run([*command, *SHAPES[shape], *ONE_STEP], cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{shape}: hybridflow train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    marks = json.loads((out / STARTUP_FILE).read_text())["marks"]
    phases, previous = {}, began
    for name, at in marks:
        phases["launcher" if name == "process" else name] = round(at - previous, 2)
        previous = at
    return {"shape": shape, "seconds_to_first_step": round(previous - began, 2), "phases": phases}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        result = {"cases": [run_shape(shape, Path(work)) for shape in shapes]}
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
