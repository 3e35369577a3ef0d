"""The combination matrix, from the registries: every algorithm with every feature
(``hybridflow.features``), and every pair of features that touch a common part of a step.

    cells()          algorithm_names() x FEATURES            (each algorithm with each feature)
                     + PAIR_ALGORITHM x {f, g in FEATURES: f.touches & g.touches}
    default_cells()  EVER_FAILED (cells that once crashed), then each feature no other test of
                     the run runs end to end (``@pytest.mark.features``), once
    refusal(cell)    the one line ``hybridflow train`` refuses it with, before any rank starts
    run_cells(...)   the cells that are not refused, many per torchrun job (tests.combinations.worker)

A cell is the CPU quickstart started from the shared SFT warm-up, two short RL steps, with the
algorithm and the features' switches as a user types them. It passes when it is refused at
config with one line naming both settings, or runs both steps with a finite update.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.algorithms.recipes import algorithm_names
from hybridflow.config import job_worlds, load_config
from hybridflow.features import FEATURES, feature
from hybridflow.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")
SHORT = (
    "sft.steps=150",  # the shared warm-up's (tests.test_train.WARM_UP): its checkpoint is reused
    "run.steps=2",
    "run.prompts_per_step=8",
    "rollout.n=4",
    "run.heldout_prompts=0",
    "run.checkpoint_every=2",
    "run.tracking.trackers=[]",
    "run.samples_per_step=0",
)
PAIR_ALGORITHM = "grpo"
"""The algorithm the pairs of features run with (the quickstart's)."""
CELLS_PER_JOB = 12
"""Cells a torchrun job runs before the next job takes over: a run leaves threads (its gloo groups
stay referenced) that slow each later cell of a process a little (9 s to 19 s over 30 cells)."""
EVER_FAILED = (("remax", ("dynamic_sampling",)),)
"""Cells that once crashed at run time; the default tier runs each of them (remax x dynamic
sampling: its greedy baselines indexed with the kept rows, twice)."""


@dataclass(frozen=True)
class Cell:
    algorithm: str
    features: tuple[str, ...]

    @property
    def name(self) -> str:
        return "+".join((self.algorithm, *self.features))

    def overrides(self, dirs: dict[str, str]) -> list[str]:
        switches = [part for name in self.features for part in feature(name).overrides(dirs)]
        return [*SHORT, f"algorithm.name={self.algorithm}", *switches]

    @property
    def needs(self) -> set[str]:
        return {need for name in self.features for need in feature(name).needs}


def cells() -> list[Cell]:
    """The whole matrix."""
    singles = [Cell(a, (f.name,)) for a in algorithm_names() for f in FEATURES]
    pairs = [
        Cell(PAIR_ALGORITHM, (f.name, g.name)) for f, g in itertools.combinations(FEATURES, 2) if f.touches & g.touches
    ]
    return pairs + singles  # the interactions first: a run cut short has covered them


def default_cells(dirs: dict[str, str], run_elsewhere: set[str] = frozenset()) -> list[Cell]:
    """Every cell that ever failed, then each feature that no other test of the run runs end to
    end (``run_elsewhere``: their ``features`` marks) once, with the first algorithm (in turn from
    where the last feature's left off) that accepts it."""
    algorithms = list(algorithm_names())
    chosen, start = [], 0
    for f in FEATURES:
        if f.name in run_elsewhere:
            continue
        for offset in range(len(algorithms)):
            algorithm = algorithms[(start + offset) % len(algorithms)]
            if refusal(Cell(algorithm, (f.name,)), dirs) is None:
                chosen.append(Cell(algorithm, (f.name,)))
                start = (start + offset + 1) % len(algorithms)
                break
    failed = [Cell(a, fs) for a, fs in EVER_FAILED]
    return failed + [c for c in chosen if c not in failed]


def refusal(cell: Cell, dirs: dict[str, str]) -> str | None:
    """The line ``hybridflow train`` refuses ``cell`` with before any rank starts, or None."""
    with tempfile.TemporaryDirectory() as out:
        try:
            cfg = load_config(CONFIG, [*cell.overrides(dirs), f"run.output_dir={out}/run"])
            preflight(cfg)
        except (ValueError, TypeError, KeyError) as error:  # ConfigError is a ValueError
            return str(error).strip()
    return None


def names(line: str, feature_name: str) -> bool:
    """Whether a refusal ``line`` names the feature: a key of its switch, or that key's section."""
    keys = {part.split("=")[0] for part in feature(feature_name).switch}
    return any(word in line for word in keys | {key.rsplit(".", 1)[0] for key in keys})


@dataclass
class Outcome:
    cell: Cell
    refused: str | None = None
    crash: str | None = None
    steps: list[dict] = field(default_factory=list)
    pending: bool = False
    """Not run: the run of the matrix stopped before it (``collect``)."""

    @property
    def ran(self) -> bool:
        return self.refused is None and self.crash is None and not self.pending

    def problems(self) -> list[str]:
        """What is wrong with this outcome (empty: the cell holds)."""
        if self.pending:
            return [f"{self.cell.name}: not run"]
        if self.crash is not None:
            return [f"{self.cell.name} crashed: {self.crash.strip().splitlines()[-1]}"]
        if self.refused is not None:
            return []  # judged with the other cells' outcomes: check()
        if [h["step"] for h in self.steps] != [1, 2]:
            return [f"{self.cell.name}: steps {[h['step'] for h in self.steps]}, not [1, 2]"]
        # every step generated and scored samples, and an update that ran has a finite loss
        bad = [
            h["step"]
            for h in self.steps
            if not math.isfinite(h["reward/mean"]) or not math.isfinite(h.get("actor/pg_loss", 0.0))
        ]
        return [f"{self.cell.name}: a non-finite reward or loss at steps {bad}"] if bad else []


def check(outcomes: list[Outcome], refused_alone: dict[str, str | None]) -> list[str]:
    """What is wrong in ``outcomes`` (empty: every cell holds). A cell that ran must have run
    both steps (``Outcome.problems``); a refused one must be refused in one line naming both
    sides: the algorithm (by ``algorithm.name=<it>``) and the feature, or for a pair each feature;
    except a side refused on its own anywhere (``refused_alone``: feature -> its line with the
    quickstart's algorithm, or None), whose line need name only that side."""
    problems = []
    for outcome in outcomes:
        problems += outcome.problems()
        line, cell = outcome.refused, outcome.cell
        if line is None:
            continue
        if "\n" in line:
            problems.append(f"{cell.name}: refused in more than one line: {line!r}")
        alone = [f for f in cell.features if refused_alone.get(f)]
        if alone:  # that feature's own refusal
            if not any(names(line, f) for f in alone):
                problems.append(f"{cell.name}: refused without naming {alone}: {line}")
            continue
        sides = [names(line, f) for f in cell.features]
        if len(cell.features) == 1:
            sides.append(f"algorithm.name={cell.algorithm}" in line)
        if not all(sides):
            problems.append(f"{cell.name}: refused without naming both settings: {line}")
    return problems


def refused_alone(dirs: dict[str, str]) -> dict[str, str | None]:
    """Each feature's refusal with the quickstart's algorithm alone (None: it runs)."""
    return {f.name: refusal(Cell(PAIR_ALGORITHM, (f.name,)), dirs) for f in FEATURES}


def run_cells(chosen: list[Cell], root: Path, dirs: dict[str, str], seed) -> list[Outcome]:
    """Each cell of ``chosen``: refused, or run from a copy of the warm-up (``seed(out)``), as
    many to a torchrun job as have the same ranks (``job_worlds``)."""
    outcomes = {cell: Outcome(cell, refused=refusal(cell, dirs)) for cell in chosen}
    marks = root / "marks"
    marks.mkdir(parents=True, exist_ok=True)
    # a cell a stopped run of ``root`` finished is not run again
    todo = [c for c in chosen if outcomes[c].refused is None and not (marks / f"{c.name}.done").exists()]
    jobs = {cell: _job(cell, root, dirs, seed) for cell in todo}
    shapes: dict[str, list[Cell]] = {}
    for cell, job in jobs.items():
        shapes.setdefault(json.dumps(job["worlds"]), []).append(cell)
    for shape, waiting in shapes.items():
        while waiting:  # a crash ends its job; the next job starts at the cell after it
            _run_job(json.loads(shape), [jobs[cell] for cell in waiting[:CELLS_PER_JOB]], marks)
            started = [cell for cell in waiting[:CELLS_PER_JOB] if (marks / f"{cell.name}.started").exists()]
            if not started:
                raise RuntimeError(f"a matrix job started no cell; see {marks / 'jobs.log'}")
            waiting = waiting[len(started) :]
    return collect(chosen, root, outcomes)


def collect(chosen: list[Cell], root: Path, outcomes: dict[Cell, Outcome]) -> list[Outcome]:
    """The outcomes of ``chosen`` from what their runs under ``root`` left (the refused ones as
    given); a cell whose job never started it (a run stopped early) is ``pending``."""
    marks = root / "marks"
    for cell in chosen:
        outcome = outcomes[cell]
        if outcome.refused is not None:
            continue
        crash, out = marks / f"{cell.name}.crash", root / cell.name
        if crash.exists():
            outcome.crash = crash.read_text()
        elif (marks / f"{cell.name}.done").exists():
            outcome.steps = json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())["history"]
        elif (marks / f"{cell.name}.started").exists():
            outcome.crash = f"no result: its job died in it ({out}/logs, {marks / 'jobs.log'})"
        else:
            outcome.pending = True
    return [outcomes[cell] for cell in chosen]


def _job(cell: Cell, root: Path, dirs: dict[str, str], seed) -> dict:
    if (root / cell.name).exists():  # left by a stopped run: started again from the warm-up
        shutil.rmtree(root / cell.name)
    out = seed(root / cell.name)
    overrides = [*cell.overrides(dirs), f"run.output_dir={out}"]
    worlds = job_worlds(load_config(CONFIG, overrides))
    return {"name": cell.name, "overrides": overrides, "out": str(out), "worlds": worlds}


def _run_job(worlds: dict[str, int], cells: list[dict], marks: Path) -> None:
    jobs_file = marks / "jobs.json"
    jobs_file.write_text(json.dumps({"config": CONFIG, "marks": str(marks), "worlds": worlds, "cells": cells}))
    for cell in cells:  # a rerun starts clean
        (marks / f"{cell['name']}.started").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "launch.torchrun_entry",
        "--standalone",
        f"--nproc-per-node={sum(worlds.values())}",
        "-m",
        "tests.combinations.worker",
        str(jobs_file),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(marks / "jobs.log", "a") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=False)
