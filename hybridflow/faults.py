"""Fault injection: SIGKILL ranks of a running ``hybridflow launch`` and check that the run survives.

    FaultHarness.run()
      ├─ starts  hybridflow launch CONFIG --max-restarts N ...   (own session; output to a log file)
      ├─ N times:
      │    wait for the workers of this start (torchrun's children, each with its RANK) and for
      │    the run's progress.json, written by this start's rank 0, to show where they resumed
      │    pick a rank and a step at random (a step this start will still run), wait for that step,
      │    then a random fraction of a step more, and SIGKILL that rank's process
      │    torchrun stops the other ranks and starts all again; they resume (run.resume=auto)
      │    record: the steps completed when killed, the step resumed from (-> steps lost)
      └─ wait for the end; check every complete checkpoint (state readable, step matches, the
         actor's checkpoint metadata present) -> FaultReport

Nothing inside the run cooperates: progress is read from the run directory (``progress.json``,
which the run writes for any watcher, and the checkpoints), the processes are found with
psutil, and the kill is a plain SIGKILL from outside, as a node or the OOM killer would deliver
it.

    python -m hybridflow.faults CONFIG [k=v ...] --out DIR [--faults N] [--seed S] [--reference DIR]

runs the harness by hand and prints the report as JSON; with ``--reference`` (an uninterrupted
run's directory) it also compares the final metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from hybridflow.config import load_config
from hybridflow.runtime.progress import read_progress
from hybridflow.runtime.state import checkpoint_dirs, checkpoint_problem, read_state, sft_checkpoint
from launch.torchrun_entry import TORCHRUN

__all__ = [
    "FaultHarness",
    "FaultReport",
    "Kill",
    "check_checkpoints",
    "final_metrics",
    "launch_command",
    "main",
    "run_uninterrupted",
]

logger = logging.getLogger(__name__)

TIMING_KEYS = ("timing/", "rollout/tokens_per_s", "sync/seconds")
"""Metrics that measure wall time: they differ between any two runs."""
_POLL_S = 0.2
MARKER_ENV = "HYBRIDFLOW_FAULT_HARNESS_RUN"


@dataclass
class Kill:
    """One injected fault."""

    rank: int
    target_step: int
    """The 0-based RL step the kill was aimed at (killed while it ran, after ``delay_s``)."""
    delay_s: float
    steps_done: int
    """RL steps completed by that start of the workers when the kill landed."""
    newest_checkpoint: int | None
    """Step of the newest complete checkpoint at the kill (None: only the SFT one)."""
    partial_dirs: int
    """Checkpoints being written (``.partial``) at the kill; never resumed from."""
    resumed_from: int | None = None
    """The step the next start of the workers continued from (its first ``progress.json``)."""

    @property
    def steps_lost(self) -> int | None:
        return None if self.resumed_from is None else self.steps_done - self.resumed_from


@dataclass
class FaultReport:
    """What happened to one run under injected faults."""

    faults_requested: int
    seed: int
    kills: list[Kill] = field(default_factory=list)
    corrupt_checkpoints: list[str] = field(default_factory=list)
    leftover_processes: list[str] = field(default_factory=list)
    """Processes of the run still alive after it ended (orphans of killed ranks); killed then."""
    returncode: int | None = None
    wall_s: float = 0.0
    log: str = ""

    @property
    def faults_injected(self) -> int:
        return len(self.kills)

    @property
    def steps_lost(self) -> int:
        return sum(k.steps_lost or 0 for k in self.kills)

    def as_dict(self) -> dict:
        kills = [{**asdict(k), "steps_lost": k.steps_lost} for k in self.kills]
        return {
            **asdict(self),
            "kills": kills,
            "faults_injected": self.faults_injected,
            "steps_lost": self.steps_lost,
            "corrupt_checkpoints_found": len(self.corrupt_checkpoints),
        }


def check_checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """A line per complete checkpoint that a resume could not use (an empty list: all good)."""
    problems = []
    sft = sft_checkpoint(output_dir)
    for path in [*([sft] if sft.exists() else []), *checkpoint_dirs(output_dir)]:
        problem = checkpoint_problem(path)  # what a resume checks: state, metadata, every listed shard
        if problem is not None:
            problems.append(f"{path}: {problem}")
            continue
        state = read_state(path)
        if path.name != "sft" and state.step != int(path.name.removeprefix("step_")):
            problems.append(f"{path}: state.json says step {state.step}")
    return problems


def final_metrics(output_dir: str | os.PathLike) -> list[dict]:
    """The newest checkpoint's per-step metrics without the wall-time ones (equal across reruns on CPU)."""
    history = read_state(checkpoint_dirs(output_dir)[-1]).history
    return [{k: v for k, v in h.items() if not k.startswith(TIMING_KEYS)} for h in history]


def _newest_step(output_dir: Path) -> int | None:
    steps = checkpoint_dirs(output_dir)
    return int(steps[-1].name.removeprefix("step_")) if steps else None


class _Progress:
    """The run's ``progress.json`` (``runtime.progress``) as the driver of one start of the
    workers writes it: an earlier start's record, under another pid, does not count."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir, self.driver_pid = output_dir, None
        self.seen: dict[int, float] = {}
        """Steps done -> when the driver recorded it (this start's records that were read)."""

    def follow(self, driver_pid: int) -> None:
        """From now on, the start whose rank 0 is ``driver_pid``."""
        self.driver_pid, self.seen = driver_pid, {}

    def current(self) -> int | None:
        """RL steps completed by the workers of this start, once its RL loop has begun."""
        progress = read_progress(self.output_dir)
        if progress is None or progress.get("pid") != self.driver_pid or progress.get("phase") != "rl":
            return None
        done = int(progress["done"])
        self.seen.setdefault(done, float(progress.get("time", 0.0)))
        return done

    def step_seconds(self) -> float | None:
        """How long one RL step of this start took, from the two latest records read; None before."""
        if len(self.seen) < 2:
            return None
        (a, t_a), (b, t_b) = sorted(self.seen.items())[-2:]
        return max(t_b - t_a, 0.0) / (b - a)


def _kill_marked(marker: str) -> list[str]:
    """SIGKILL every process that carries ``marker`` in its environment; returns what they were."""
    killed = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_ENV) != marker:
                continue
            killed.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed


def _workers(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """rank -> worker process: torchrun's children that run ``hybridflow.runtime.worker``."""
    found = {}
    try:
        descendants = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in descendants:
        # one process at a time: a zombie (an orphan the launcher adopted, not yet reaped) or one
        # that exits under us is skipped, not allowed to hide the others
        try:
            with proc.oneshot():
                if "hybridflow.runtime.worker" not in " ".join(proc.cmdline()):
                    continue
                if TORCHRUN not in " ".join(proc.parent().cmdline()):
                    continue  # a process the worker started (SGLang's schedulers keep its cmdline)
                found[int(proc.environ()["RANK"])] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError, KeyError):
            continue
    return found


class FaultHarness:
    """Runs ``hybridflow launch`` once on this machine and kills ranks of it ``faults`` times."""

    def __init__(
        self,
        config: str,
        overrides: Sequence[str],
        *,
        output_dir: Path,
        nproc: int,
        steps: int,
        faults: int,
        seed: int,
        max_delay_s: float = 2.0,
        timeout_s: float = 1800.0,
        launch_args: Sequence[str] = (),
    ) -> None:
        self.config, self.overrides, self.out = config, list(overrides), Path(output_dir)
        self.launch_args = list(launch_args)
        self.nproc, self.steps, self.faults = nproc, steps, faults
        self.rng, self.max_delay_s, self.timeout_s = random.Random(seed), max_delay_s, timeout_s
        self.report = FaultReport(faults_requested=faults, seed=seed, log=str(self.out) + ".log")
        self._deadline = 0.0

    def command(self) -> list[str]:
        return launch_command(
            self.config,
            self.overrides,
            output_dir=self.out,
            nproc=self.nproc,
            max_restarts=self.faults,
            launch_args=self.launch_args,
        )

    def run(self) -> FaultReport:
        started = time.monotonic()
        self._deadline = started + self.timeout_s
        log_path = Path(self.report.log)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        marker = uuid.uuid4().hex  # inherited by every process of the run, orphans included
        env = {**os.environ, "OMP_NUM_THREADS": "1", MARKER_ENV: marker}
        with log_path.open("wb") as log_file:
            child = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        try:
            self._inject(child, _Progress(self.out))
            self.report.returncode = child.wait(timeout=max(self._deadline - time.monotonic(), 1))
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            self.report.leftover_processes = _kill_marked(marker)
        self.report.corrupt_checkpoints = check_checkpoints(self.out)
        self.report.wall_s = time.monotonic() - started
        return self.report

    def _inject(self, child: subprocess.Popen, progress: _Progress) -> None:
        launcher = psutil.Process(child.pid)
        previous: set[int] = set()
        for start_index in range(self.faults + 1):  # the first start, then one after each kill
            workers = self._wait_for(lambda seen=previous: self._new_workers(launcher, seen), child)
            if workers is None:
                return  # the run ended (or failed) before this start
            previous = {p.pid for p in workers.values()}
            progress.follow(workers[0].pid)  # the old workers are gone: this start's records from here on
            start = self._wait_for(progress.current, child)
            if start is None:
                return
            if self.report.kills:
                self.report.kills[-1].resumed_from = start
            if start_index == self.faults or start >= self.steps:
                return
            # Before the last fault, aim below the final step: a kill after the final checkpoint
            # would leave nothing to resume into, and the remaining faults could not happen.
            last = start_index == self.faults - 1
            stop = self.steps if last else max(start + 1, self.steps - 1)
            self._kill_during(self.rng.randrange(start, stop), workers, progress, child)

    def _new_workers(self, launcher: psutil.Process, previous: set[int]) -> dict[int, psutil.Process] | None:
        workers = _workers(launcher)
        fresh = len(workers) == self.nproc and not previous & {p.pid for p in workers.values()}
        return workers if fresh else None

    def _kill_during(self, step: int, workers: dict[int, psutil.Process], progress: _Progress, child) -> None:
        rank = self.rng.randrange(self.nproc)
        fraction = self.rng.random()
        if self._wait_for(lambda: True if (progress.current() or 0) >= step else None, child) is None:
            return
        # a random point in the first half of the next step, at most max_delay_s in: a flat delay of
        # up to 2 s outlasted a fast machine's 1 s steps, and the run had ended before the kill
        # (CI: aimed at the final step, 1.7 s late); half a step leaves the rest of it as margin
        half_step = (progress.step_seconds() or self.max_delay_s / 2) / 2
        delay = fraction * min(self.max_delay_s, half_step)
        time.sleep(delay)
        kill = Kill(
            rank=rank,
            target_step=step,
            delay_s=round(delay, 3),
            steps_done=progress.current() or step,
            newest_checkpoint=_newest_step(self.out),
            partial_dirs=len(list((self.out / "checkpoints").glob("*.partial"))),
        )
        try:
            workers[rank].send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            return  # the run finished under us
        logger.info("killed rank %d (pid %d) at step %d", rank, workers[rank].pid, kill.steps_done)
        self.report.kills.append(kill)

    def _wait_for(self, condition, child: subprocess.Popen):
        """Poll ``condition`` until it returns something other than None (returned), or the run
        exits (None)."""
        while time.monotonic() < self._deadline:
            value = condition()
            if value is not None:
                return value
            if child.poll() is not None:
                return None
            time.sleep(_POLL_S)
        raise TimeoutError(
            f"the run under fault injection did not progress within {self.timeout_s:g} s; see {self.report.log}"
        )


def launch_command(
    config: str,
    overrides: Sequence[str],
    *,
    output_dir: Path,
    nproc: int,
    max_restarts: int = 0,
    launch_args: Sequence[str] = (),
) -> list[str]:
    """``hybridflow launch`` of this machine's run into ``output_dir`` (resuming if it holds checkpoints)."""
    return [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "launch",
        config,
        f"run.output_dir={output_dir}",
        "run.resume=auto",
        *overrides,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        *launch_args,
    ]


def run_uninterrupted(
    config: str,
    overrides: Sequence[str],
    *,
    output_dir: Path,
    nproc: int,
    launch_args: Sequence[str] = (),
    timeout_s: float = 1800.0,
) -> subprocess.CompletedProcess:
    """The reference: the same launch without faults; output captured."""
    cmd = launch_command(config, overrides, output_dir=output_dir, nproc=nproc, launch_args=launch_args)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--out", required=True, type=Path, help="run directory of the faulted run (fresh)")
    parser.add_argument("--faults", type=int, default=2, help="kills in a row (torchrun --max-restarts)")
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed in the report")
    parser.add_argument("--max-delay-s", type=float, default=2.0, help="random extra wait into the step")
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="an uninterrupted run's directory, run first (same code, same overrides) unless "
        "it already holds summary.json",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = load_config(args.config, args.overrides)
    nproc = cfg.actor.parallel.world_size
    if args.reference is not None and not (args.reference / "summary.json").is_file():
        done = run_uninterrupted(args.config, args.overrides, output_dir=args.reference, nproc=nproc)
        if done.returncode != 0:
            sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
            return 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    harness = FaultHarness(
        args.config,
        args.overrides,
        output_dir=args.out,
        nproc=nproc,
        steps=cfg.run.steps,
        faults=args.faults,
        seed=seed,
        max_delay_s=args.max_delay_s,
    )
    report = harness.run().as_dict()
    if args.reference is not None and report["returncode"] == 0:
        report["matches_reference"] = final_metrics(args.out) == final_metrics(args.reference)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    ok = report["returncode"] == 0 and not report["corrupt_checkpoints"] and report.get("matches_reference", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
