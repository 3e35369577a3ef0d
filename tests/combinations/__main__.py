"""Run the combination matrix outside pytest and write its tables into docs/testing.md.

    .venv/bin/python -m tests.combinations --tier all --json runs/matrix.json --docs

trains the shared SFT warm-up once (``--workdir``), runs the cells (``tests.combinations.matrix``),
prints one JSON row per cell, writes them all to ``--json``, and with ``--docs`` replaces the
matrix section of docs/testing.md (between its ``matrix:`` markers) with the tables. Exits 1 when
a cell does not hold (the problems are printed), after writing. ``--render PATH`` only writes the
tables from an earlier ``--json`` file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hfschema.files import write_atomic
from hybridflow.algorithms.recipes import algorithm_names
from hybridflow.features import FEATURES
from tests.combinations.matrix import (
    CONFIG,
    ROOT,
    SHORT,
    Cell,
    Outcome,
    cells,
    check,
    collect,
    default_cells,
    refusal,
    refused_alone,
    run_cells,
)

DOCS = ROOT / "docs" / "testing.md"
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"


def warm_up(workdir: Path) -> Path:
    """The shared SFT warm-up (``tests.test_train.warm_up_run``'s settings), trained once."""
    out = workdir / "warm_up"
    if not (out / "checkpoints" / "sft" / "hf").is_dir():
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "hybridflow.cli", "train", CONFIG, f"run.output_dir={out}", "run.mode=sft"]
        cmd += [SHORT[0], "run.tracking.trackers=[]", "run.heldout_prompts=0"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return out


def model_dirs(workdir: Path, warm: Path) -> dict[str, str]:
    """The model directories the features name: a tiny reward model; the warm-up's export as the
    judge and the teacher (its tokenizer is the actor's)."""
    from tests.reward.rm_models import make_rm_dir

    rm = workdir / "rm_qwen3"
    if not rm.is_dir():
        make_rm_dir(workdir, "qwen3")
    hf = str(warm / "checkpoints" / "sft" / "hf")
    return {"reward_model": str(rm), "judge": hf, "teacher": hf}


def row(outcome: Outcome, tier: set[Cell]) -> dict:
    steps = outcome.steps
    return {
        "algorithm": outcome.cell.algorithm,
        "features": list(outcome.cell.features),
        "default_tier": outcome.cell in tier,
        "refused": outcome.refused,
        "crash": None if outcome.crash is None else outcome.crash.strip().splitlines()[-1],
        "not_run": outcome.pending,
        "reward": [round(h["reward/mean"], 3) for h in steps],
    }


def _mark(r: dict, notes: list[str]) -> str:
    if r.get("not_run"):
        return "not run"
    if r["crash"]:
        return "**crash**"
    if r["refused"]:
        if r["refused"] not in notes:
            notes.append(r["refused"])
        return f"refused ({notes.index(r['refused']) + 1})"
    return "runs" + (" (D)" if r["default_tier"] else "")


def tables(rows: list[dict]) -> str:
    """The matrix as markdown: features x algorithms, then the pairs, then the refusal lines."""
    by = {(r["algorithm"], tuple(r["features"])): r for r in rows}
    algorithms, notes = list(algorithm_names()), []
    lines = ["| feature | " + " | ".join(algorithms) + " |", "| --- |" + " --- |" * len(algorithms)]
    for f in FEATURES:
        marks = [_mark(by[(a, (f.name,))], notes) if (a, (f.name,)) in by else "not run" for a in algorithms]
        lines.append(f"| {f.name} | " + " | ".join(marks) + " |")
    pairs = [r for r in rows if len(r["features"]) == 2]
    if pairs:
        lines += ["", f"Pairs of features that touch a common part of a step, with {pairs[0]['algorithm']}:", ""]
        lines += ["| pair | outcome | pair | outcome | pair | outcome |", "| --- | --- | --- | --- | --- | --- |"]
        marks = [(" x ".join(r["features"]), _mark(r, notes)) for r in pairs]
        for i in range(0, len(marks), 3):
            chunk = [part for pair in marks[i : i + 3] for part in pair]
            lines.append("| " + " | ".join(chunk + ["", ""] * (3 - len(marks[i : i + 3]))) + " |")
    lines += ["", "Refusals, each the one line `hybridflow train` prints before any rank starts:", ""]
    lines += [f"{i}. {line}" for i, line in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def write_docs(rows: list[dict], when: str) -> None:
    text = DOCS.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOCS} has no {START} ... {END} section to fill")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    counts = (
        f"{len(rows)} cells ({when}): "
        f"{sum(1 for r in rows if not (r['refused'] or r['crash'] or r.get('not_run')))} run, "
        f"{sum(1 for r in rows if r['refused'])} refused, {sum(1 for r in rows if r['crash'])} crashed, "
        f"{sum(1 for r in rows if r.get('not_run'))} not run yet; "
        "(D): in the default tier too.\n\n"
    )
    write_atomic(DOCS, head + START + "\n" + counts + tables(rows) + END + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.combinations", description=__doc__.split("\n")[0])
    parser.add_argument("--tier", choices=("default", "all"), default="all")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "combinations")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--docs", action="store_true")
    parser.add_argument("--render", type=Path, help="write the tables from this --json file and stop")
    parser.add_argument("--collect", type=Path, help="the rows of a stopped run's cells directory (no run)")
    parser.add_argument("--resume", type=Path, help="go on with a stopped run's cells directory")
    args = parser.parse_args(argv)
    if args.render:
        write_docs(json.loads(args.render.read_text()), "rendered from " + args.render.name)
        return 0
    from tests.test_train import seed_from_warm_up

    args.workdir.mkdir(parents=True, exist_ok=True)
    warm = warm_up(args.workdir)
    dirs = model_dirs(args.workdir, warm)
    default = default_cells(dirs)
    tier = set(default)
    chosen = cells() if args.tier == "all" else default
    if args.collect:
        outcomes = collect(chosen, args.collect, {c: Outcome(c, refused=refusal(c, dirs)) for c in chosen})
    else:
        root = args.resume or args.workdir / time.strftime("cells_%Y%m%d_%H%M%S")
        outcomes = run_cells(chosen, root, dirs, lambda out: seed_from_warm_up(warm, out))
    rows = [row(o, tier) for o in outcomes]
    for r in rows:
        print("matrix-row", json.dumps(r), flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=1))
    if args.docs:
        write_docs(rows, time.strftime("%Y-%m-%d"))
    problems = check(outcomes, refused_alone(dirs))
    print("\n".join(problems) if problems else f"all {len(rows)} cells hold")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
