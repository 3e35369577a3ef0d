"""Render (and submit) the sbatch script of a hybridflow run.

    hybridflow slurm CONFIG [k=v ...] --nodes N --gpus-per-node G [--partition P ...] [--submit]
      │  checks first, in the calling process (hybridflow.preflight.check_slurm_run)
      └─ <run.output_dir>/hybridflow.sbatch           (written atomically, printed)
           #SBATCH --nodes=N --ntasks-per-node=1 --requeue --signal=B:USR1@lead ...
           head = first host of the allocation  (scontrol show hostnames)
           srun: one `hybridflow launch` per node ─► torchrun (c10d rendezvous on head:port)
                                                      └─ G ranks per node

A requeued job (``scontrol requeue``, preemption, a node failure with ``--requeue``) runs the
same script again: the run directory is fixed in it and ``run.resume=auto`` continues from the
newest complete checkpoint. Slurm signals the batch shell (``--signal=B:USR1@signal_lead_s``)
before the time limit; the script writes ``<run dir>/checkpoint.request``, the ranks save at the
end of their step (RL or SFT) and stop, and the script requeues the job, so a long run spans several
allocations instead of ending as TIMEOUT, and loses no step. SIGINT, SIGTERM and SIGHUP to the
script stop the launch on every node (``launch.reaper``); it exits with 128 + the signal. Logs go
to ``<run dir>/logs/slurm-<job id>.out``, appended across requeues.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hfschema.files import write_atomic
from hfschema.layout import ParallelLayout
from launch.multinode import check_process_count
from launch.reaper import REQUEST_FILE, STOP_GRACE_S

__all__ = ["SCRIPT_NAME", "SlurmJob", "nproc_per_node", "render_sbatch", "sbatch_for_run", "submit", "write_script"]

SCRIPT_NAME = "hybridflow.sbatch"
KILL_AFTER_S = int(STOP_GRACE_S) + 10
"""After INT/TERM/HUP, how long the script waits for the launch to stop (its own grace and
its SIGKILL) before it kills srun."""
_DIRECTIVE_VALUE = re.compile(r"^[^\s'\"\\]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """The allocation and the launch inside it; every field maps to a line of the script."""

    nodes: int
    """Nodes (``#SBATCH --nodes``); one ``hybridflow launch`` (torchrun) runs on each."""
    gpus_per_node: int
    """GPUs requested per node; 0: a CPU job, no GPU requested."""
    nproc_per_node: int
    """Ranks per node: one per GPU, or the actor's ranks / nodes on CPU."""
    job_name: str = "hybridflow"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    """Time limit, e.g. ``04:00:00``; the job requeues itself ``signal_lead_s`` before it."""
    qos: str | None = None
    cpus_per_task: int | None = None
    """CPUs for each node's task (torchrun and all its ranks)."""
    mem: str | None = None
    """Memory per node, e.g. ``0`` (all) or ``400G``."""
    rdzv_port: int = 29500
    """Port of the rendezvous store on the first node."""
    max_restarts: int = 0
    """Times torchrun restarts the workers within one allocation before the job fails."""
    signal_lead_s: int = 300
    """Seconds before the time limit at which the script asks for a checkpoint, then requeues the job."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra ``export NAME=VALUE`` lines (e.g. NCCL settings)."""
    extra_directives: tuple[str, ...] = field(default=())
    """More ``#SBATCH`` options verbatim, e.g. ``--constraint=h100``."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc_per_node < 1 or self.gpus_per_node < 0:
            raise ValueError(
                f"--nodes={self.nodes} and the processes per node ({self.nproc_per_node}) "
                f"must be >= 1, --gpus-per-node={self.gpus_per_node} >= 0"
            )
        if self.gpus_per_node and self.nproc_per_node != self.gpus_per_node:
            raise ValueError(
                f"--nproc-per-node={self.nproc_per_node} must equal --gpus-per-node="
                f"{self.gpus_per_node}: one rank per GPU"
            )
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"--cpus-per-task={self.cpus_per_task} must be >= 1")
        if not 0 < self.rdzv_port < 65536 or self.signal_lead_s < 0 or self.max_restarts < 0:
            raise ValueError("--rdzv-port must be in 1..65535, --signal-lead-s and --max-restarts >= 0")
        for name in ("job_name", "partition", "account", "time", "qos", "mem"):
            value = getattr(self, name)
            if value is not None and not _DIRECTIVE_VALUE.match(value):
                raise ValueError(
                    f"--{name.replace('_', '-')}={value!r}: an #SBATCH value cannot be empty "
                    "or hold spaces, quotes or backslashes"
                )
        for name, _ in self.env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"--env {name}=...: {name!r} is not an environment variable name")
        for option in self.extra_directives:
            if not option.startswith("--") or "\n" in option:
                raise ValueError(f"--sbatch-option={option!r} must be one long option, e.g. --constraint=h100")

    def check_layout(self, layout: ParallelLayout, more_ranks: int = 0) -> None:
        """The allocation must start exactly the ranks the actor's ``layout`` fills, and
        ``more_ranks`` more (separate engines, frozen models' own GPUs)."""
        per_node = "--gpus-per-node" if self.gpus_per_node else "--nproc-per-node"
        check_process_count(
            layout,
            f"--nodes={self.nodes}",
            f"{per_node}={self.nproc_per_node}",
            self.nodes * self.nproc_per_node,
            more_ranks,
        )


def _directives(job: SlurmJob, log_dir: Path, workdir: Path) -> list[str]:
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    named = {
        "cpus-per-task": job.cpus_per_task,
        "mem": job.mem,
        "partition": job.partition,
        "account": job.account,
        "qos": job.qos,
        "time": job.time,
    }
    options += [f"--{name}={value}" for name, value in named.items() if value is not None]
    options += [
        f"--chdir={workdir}",
        f"--output={log_dir}/slurm-%j.out",
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{job.signal_lead_s}",
        *job.extra_directives,
    ]
    return [f"#SBATCH {option}" for option in options]


def _environment(job: SlurmJob) -> list[str]:
    lines = ["export PYTHONUNBUFFERED=1   # log lines reach the job's log file as they are written"]
    if job.cpus_per_task is not None:
        # srun (Slurm >= 22.05) does not inherit sbatch's --cpus-per-task; this passes it on
        lines.append('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"')
    if not job.gpus_per_node:
        lines.append("export OMP_NUM_THREADS=1      # CPU ranks share the node's cores")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in job.env]
    return lines


def _launch_line(job: SlurmJob, *, python: str, config: Path, overrides: Sequence[str]) -> str:
    q = shlex.quote
    lines = [
        f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1",
        f"  {q(python)} -m hybridflow.cli launch {q(str(config))}",
        *(f"    {q(o)}" for o in overrides),
        f"    --nnodes {job.nodes} --nproc-per-node {job.nproc_per_node} --max-restarts {job.max_restarts}",
        # expanded by the batch shell at run time: the first node and this job's id
        f'    --rdzv-endpoint "$head_node:{job.rdzv_port}" --rdzv-id "$SLURM_JOB_ID" &',
    ]
    return " \\\n".join(lines)


_BODY = """\
set -euo pipefail

# The rendezvous store runs on the first node of the allocation; torchrun on every node meets there.
head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
echo "hybridflow: job $SLURM_JOB_ID (requeued ${{SLURM_RESTART_COUNT:-0}} times) on $SLURM_JOB_NODELIST;" \\
  "rendezvous $head_node:{port}; run dir {run_dir}"

{launch}
launcher=$!
requeue=0 stop_signal=0 deadline="" escalate=""

# Slurm sends USR1 to this shell {lead} s before the time limit: ask the ranks to checkpoint at the
# end of their step and stop (the request file), then requeue the job, which goes on from that
# checkpoint in a new allocation (same job id, same run directory). A step that does not end
# within {request_wait} s is cut short with SIGTERM (the launch's clean stop).
checkpoint_before_time_limit() {{
  echo "hybridflow: time limit in {lead} s; asking the run to checkpoint and stop, then requeueing job $SLURM_JOB_ID"
  echo "checkpoint at the next step boundary and stop" > {request}
  requeue=1 escalate=TERM deadline=$((SECONDS + {request_wait}))
}}
# INT, TERM, HUP: the launch stops every process of the job within its grace; SIGKILL after {kill_after} s.
stop_job() {{
  echo "hybridflow: SIG$2: stopping job $SLURM_JOB_ID"
  stop_signal=$1 escalate=KILL deadline=$((SECONDS + {kill_after}))
  kill -s TERM "$launcher" 2>/dev/null || true
}}
trap checkpoint_before_time_limit USR1
trap 'stop_job 2 INT' INT
trap 'stop_job 15 TERM' TERM
trap 'stop_job 1 HUP' HUP

# Polled, not a bare `wait`: a trap runs between two polls, and a deadline is kept.
while kill -0 "$launcher" 2>/dev/null; do
  if [ -n "$deadline" ] && [ "$SECONDS" -ge "$deadline" ]; then
    echo "hybridflow: the launch did not stop in time; sending it SIG$escalate"
    kill -s "$escalate" "$launcher" 2>/dev/null || true
    if [ "$escalate" = TERM ]; then escalate=KILL deadline=$((SECONDS + {kill_after})); else deadline=""; fi
  fi
  sleep 1
done
status=0
wait "$launcher" || status=$?
if [ "$stop_signal" -ne 0 ]; then
  exit $((128 + stop_signal))
fi
if [ "$requeue" -eq 1 ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""


def _request_wait_s(job: SlurmJob) -> int:
    """Seconds after the time-limit signal that the ranks get to checkpoint before SIGTERM:
    what is left of the lead once the launch's own stop (``KILL_AFTER_S``) and a margin fit."""
    return max(job.signal_lead_s - KILL_AFTER_S - 15, job.signal_lead_s // 2)


def render_sbatch(
    job: SlurmJob, *, config: Path, overrides: Sequence[str], run_dir: Path, workdir: Path, python: str = sys.executable
) -> str:
    """The sbatch script of a run (absolute paths: it is read on other nodes and after requeues)."""
    pinned = [*overrides, f"run.output_dir={run_dir}", "run.resume=auto"]
    header = [
        "#!/bin/bash",
        f"# hybridflow run {run_dir.name}: {job.nodes} node(s) x {job.nproc_per_node} rank(s)"
        + (f" on {job.gpus_per_node} GPU(s) each" if job.gpus_per_node else " on CPUs"),
        "# Rendered by `hybridflow slurm`; submit with: sbatch " + shlex.quote(str(run_dir / SCRIPT_NAME)),
        "# A requeue resumes this run directory from its newest complete checkpoint.",
    ]
    body = _BODY.format(
        port=job.rdzv_port,
        run_dir=shlex.quote(str(run_dir)),
        lead=job.signal_lead_s,
        request=shlex.quote(str(run_dir / REQUEST_FILE)),
        request_wait=_request_wait_s(job),
        kill_after=KILL_AFTER_S,
        launch=_launch_line(job, python=python, config=config, overrides=pinned),
    )
    return "\n".join([*header, *_directives(job, run_dir / "logs", workdir), "", *_environment(job), "", body])


def write_script(text: str, run_dir: Path) -> Path:
    """Write the script into the run directory (atomically) and create its log directory."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # sbatch does not create --output's folder
    path = run_dir / SCRIPT_NAME
    write_atomic(path, text)
    path.chmod(0o755)
    return path


def submit(script: Path) -> str:
    """``sbatch`` the script; returns the job id. ValueError (with sbatch's message) if refused."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ValueError(
            "--submit: sbatch is not installed on this machine; the script is written at "
            f"{script}; submit it from a Slurm login node with: sbatch {script}"
        ) from None
    if done.returncode != 0:
        raise ValueError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"


def nproc_per_node(
    layout: ParallelLayout, *, nodes: int, gpus_per_node: int, requested: int | None, more_ranks: int = 0
) -> int:
    """Ranks per node: ``requested``, else one per GPU, else (CPU) the actor's ``layout``'s ranks
    (and the ``more_ranks`` of their own) split evenly."""
    if requested is not None:
        return requested
    if gpus_per_node:
        return gpus_per_node
    world = layout.world_size + more_ranks
    if nodes < 1 or world % nodes:
        raise ValueError(
            f"--nodes={nodes} does not divide the {world} ranks of actor.parallel "
            f"({layout.describe()}); pass --nproc-per-node or change --nodes"
        )
    return world // nodes


def sbatch_for_run(
    job: SlurmJob, *, config: str, overrides: Sequence[str], output_dir: str, workdir: Path | None = None
) -> tuple[Path, str]:
    """The script of the run in ``output_dir`` (the config's ``run.output_dir``, relative to
    ``workdir``); returns (run dir, text). The caller checked the run first
    (``hybridflow.preflight.check_slurm_run``)."""
    config_path = Path(config)
    if not config_path.is_file():
        raise ValueError(f"config file not found: {config}")
    workdir = (workdir or Path.cwd()).resolve()
    run_dir = (workdir / output_dir).resolve()
    # the script pins these two itself: the run directory must not depend on where it runs
    kept = [o for o in overrides if o.partition("=")[0].strip() not in ("run.output_dir", "run.resume")]
    text = render_sbatch(job, config=config_path.resolve(), overrides=kept, run_dir=run_dir, workdir=workdir)
    return run_dir, text
