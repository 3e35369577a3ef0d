"""The ``hybridflow`` command line.

    hybridflow plan CONFIG [key=value ...] [--world-size N] [--no-reshard] [--mermaid | --resolved]
                                           [--device-memory-gib G]
    hybridflow selftest CONFIG [key=value ...] [--steps N]
    hybridflow train CONFIG [key=value ...]
    hybridflow launch CONFIG [key=value ...] --nnodes N --nproc-per-node G [--node-rank R]
                             [--rdzv-endpoint HOST:PORT] [--max-restarts K] ...
    hybridflow slurm CONFIG [key=value ...] --nodes N --gpus-per-node G [--partition P --account A
                            --time T --qos Q --cpus-per-task C ...] [--submit | --dry-run]
    hybridflow convert hf-to-mcore --hf DIR --out DIR [--tp --pp --vpp --ep --etp] [--dtype D]
    hybridflow convert mcore-to-hf --mcore DIR --out DIR [--hf-config DIR] [--dtype D]
    hybridflow convert fsdp2-to-hf --checkpoint DIR --out DIR [--hf-config DIR]
    hybridflow samples RUN_DIR [--step N] [--heldout] [--pick best|worst|random|first] [-n N]
                               [--source DATA_SOURCE]

``plan`` is a dry run in one process: it loads the config and lowers it
(``hybridflow.lowering.lower``), which checks everything a run would check before starting a
process, then prints the answer first: whether the run fits, each pool's peak memory per GPU
(against ``--device-memory-gib``, default 80) and, where it does not fit, the settings that
would shrink it. Then the model's parameter counts, each enabled role's layout, the rollout
engines, the algorithm (estimator, loss, switches), the dataflow graph, the placement of roles
on GPU pools, the stages in order with the colocation switches between them, the memory table
per pool and phase, and the actor -> rollout weight sync planned from shapes (bytes, lower
bound, gather baseline, simulated time; ``--no-reshard`` skips it). ``--resolved`` prints only
the resolved YAML, ``--mermaid`` only the graph as a mermaid flowchart. Exit status: 0 when it
fits, 3 when it does not, 2 for a config error (a one-line message on stderr).

``selftest`` validates the config here, then starts one process per rank of the actor's
layout with torchrun (gloo on CPU, NCCL on GPUs) to train the actor a few steps on a synthetic
task, checkpoint it and reload it (``hybridflow/selftest.py``).

``plan`` also resolves ``reward.function``. ``train``, ``launch`` and ``slurm`` check the config
here first (``hybridflow.preflight``: reward, data files, engine, resume checkpoint), then hand
plain values (the actor's layout, the config path and overrides) to ``launch``, which starts
the processes.

``samples`` reads a run's directory only (no torch): its summary, which steps wrote samples and
the chosen samples of one step, each with its numbers, prompt and response.
"""

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
from argparse import SUPPRESS
from collections.abc import Sequence
from pathlib import Path

from hfschema.hf_config import DEFAULT_BUFFER_BYTES, DEFAULT_SHARD_BYTES
from hybridflow import __version__, lengths, sample_files
from hybridflow.config import HybridflowConfig, enabled_roles, load_config, to_yaml
from hybridflow.features import active_features
from hybridflow.host_memory import has_gpu_device, host_memory
from hybridflow.lowering import ExecutionPlan, lower, trainer_line, trainer_text
from hybridflow.model_size import count_parameters, format_count
from hybridflow.preflight import (
    check_engine_serves,
    check_runtime_support,
    check_separate_nodes,
    check_slurm_run,
    check_trainer_backends,
    more_ranks,
    preflight,
)
from hybridflow.rewards import check_reward
from hybridflow.sample_files import PICKS
from launch.multinode import LaunchSpec
from launch.slurm import SlurmJob

__all__ = ["main"]

EXIT_CONFIG_ERROR = 2
EXIT_DOES_NOT_FIT = 3
"""``plan``: the config is valid but a pool's peak memory exceeds its GPU (a script can tell it
from a config error)."""


def _field_defaults(cls: type, names: Sequence[str]) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name in names}


# launch / slurm options left out on the command line keep these dataclass defaults
LAUNCH_DEFAULTS = _field_defaults(LaunchSpec, ("rdzv_id", "max_restarts", "rdzv_wait_s", "join_timeout_s"))
SLURM_DEFAULTS = _field_defaults(SlurmJob, ("rdzv_port", "max_restarts", "signal_lead_s"))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training for MoE LLMs on megatron-core.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan", help="validate a config and say whether it fits: peak memory per GPU, layouts, stages, weight sync"
    )
    plan.add_argument("config", metavar="CONFIG", help="YAML config file, e.g. configs/quickstart_cpu.yaml")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. train.lr=3e-4")
    plan.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="check that the actor layout fills exactly N ranks",
    )
    plan.add_argument(
        "--no-reshard",
        action="store_true",
        help="skip planning the actor -> rollout weight sync (about 1 s for a 671B model)",
    )
    plan.add_argument(
        "--mermaid",
        action="store_true",
        help="print only the dataflow graph, as a mermaid flowchart",
    )
    plan.add_argument(
        "--resolved",
        action="store_true",
        help="print only the resolved config as YAML (loadable: `plan CONFIG --resolved > run.yaml`)",
    )
    plan.add_argument(
        "--device-memory-gib",
        type=float,
        default=80.0,
        metavar="G",
        help="memory of one GPU that the per-GPU estimate is checked against (default 80)",
    )
    plan.set_defaults(handler=_plan)
    selftest = commands.add_parser(
        "selftest", help="train the actor a few steps under its layout, checkpoint and reload it"
    )
    selftest.add_argument("config", metavar="CONFIG", help="YAML config file")
    selftest.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides")
    selftest.add_argument("--steps", type=int, default=8, metavar="N", help="training steps")
    selftest.set_defaults(handler=_selftest)
    train = commands.add_parser("train", help="run the config's job (SFT and/or RL) on every rank under torchrun")
    train.add_argument("config", metavar="CONFIG", help="YAML config file")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides")
    _add_verbose(train)
    train.set_defaults(handler=_train)
    _add_launch_parser(commands)
    _add_slurm_parser(commands)
    _add_convert_parser(commands)
    _add_samples_parser(commands)
    return parser


def _add_samples_parser(commands) -> None:
    samples = commands.add_parser(
        "samples", help="print a run's samples of a step (best, worst, random), its summary and where its files are"
    )
    samples.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory, e.g. runs/quickstart")
    samples.add_argument("--step", type=int, default=None, metavar="N", help="the step (default: the last)")
    samples.add_argument(
        "--heldout", action="store_true", help="the held-out generations of a scoring (step 0: before RL)"
    )
    samples.add_argument("--pick", default="best", choices=PICKS, help="which samples (default: best by reward)")
    samples.add_argument("-n", type=int, default=3, metavar="N", help="how many (default 3)")
    samples.add_argument("--source", default=None, metavar="DATA_SOURCE", help="only this data_source's rows")
    samples.add_argument("--seed", type=int, default=0, help="the seed of --pick random")
    samples.set_defaults(handler=_samples)


def _samples(args: argparse.Namespace) -> int:
    run = Path(args.run_dir)
    if not run.is_dir():
        raise ValueError(f"{run}: no such run directory")
    summary = run / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        held = f"held-out {_score(s.get('heldout_reward_after_sft'))} -> {_score(s.get('heldout_reward_after_rl'))}"
        print(f"run {s.get('run')} ({s.get('algorithm')}, {s.get('steps')} RL steps): {held}; {summary}")
    else:
        print(f"run {run}: no summary.json yet (running, or stopped before its end)")
    rl, held = sample_files.steps(run), sample_files.steps(run, heldout=True)
    print(f"samples: {run / sample_files.SAMPLES_DIR} (RL steps {sample_files.ranges(rl) or '-'}; "
          f"held-out scorings at steps {sample_files.ranges(held) or '-'})")  # fmt: skip
    path = sample_files.step_file(run, args.step, heldout=args.heldout)
    records = sample_files.read(path)
    shown = sample_files.pick(records, args.pick, args.n, source=args.source, seed=args.seed)
    mean = sum(r["reward"] for r in records) / max(len(records), 1)
    print(f"{path.name}: {len(records)} samples, mean reward {mean:.3f}; the {args.pick} {len(shown)}:")
    for record in shown:
        print("\n".join(sample_files.describe(record)))
    return 0


def _score(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _add_launch_parser(commands) -> None:
    launch = commands.add_parser("launch", help="run the job on one node of several: torchrun with a c10d rendezvous")
    launch.add_argument("config", metavar="CONFIG", help="YAML config file")
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides")
    launch.add_argument("--nnodes", type=int, required=True, metavar="N", help="nodes in the job")
    launch.add_argument(
        "--nproc-per-node",
        type=int,
        required=True,
        metavar="G",
        help="ranks on each node (one per GPU); N*G must fill the actor's layout",
    )
    launch.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's index; 0 hosts the rendezvous (default: whether HOST is this machine)",
    )
    launch.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous on the first node; required with --nnodes > 1",
    )
    launch.add_argument(
        "--rdzv-id",
        default=SUPPRESS,
        metavar="ID",
        help=f"job id shared by all nodes of the job (default {LAUNCH_DEFAULTS['rdzv_id']})",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=SUPPRESS,
        metavar="K",
        help="restart all workers up to K times after a failure; they resume "
        f"(default {LAUNCH_DEFAULTS['max_restarts']})",
    )
    launch.add_argument(
        "--rdzv-wait-s",
        type=float,
        default=SUPPRESS,
        metavar="S",
        help=f"seconds a node waits for the rendezvous endpoint to answer (default {LAUNCH_DEFAULTS['rdzv_wait_s']:g})",
    )
    launch.add_argument(
        "--join-timeout-s",
        type=float,
        default=SUPPRESS,
        metavar="S",
        help=f"seconds torchrun waits for all nodes to join (default {LAUNCH_DEFAULTS['join_timeout_s']:g})",
    )
    _add_verbose(launch)
    launch.set_defaults(handler=_launch)


def _add_verbose(command) -> None:
    command.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show megatron-core's and SGLang's own logs and warnings too (run.verbose=true); "
        "they are always in <run.output_dir>/logs/",
    )


def _add_slurm_parser(commands) -> None:
    slurm = commands.add_parser(
        "slurm", help="write the run's sbatch script (srun + torchrun per node, requeue-safe); --submit it"
    )
    slurm.add_argument("config", metavar="CONFIG", help="YAML config file")
    slurm.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides")
    slurm.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes to allocate")
    slurm.add_argument(
        "--gpus-per-node",
        type=int,
        required=True,
        metavar="G",
        help="GPUs per node, one rank each; 0 for a CPU job (no GPU requested)",
    )
    slurm.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="P",
        help="ranks per node (default: G, or on CPU the actor's ranks / N)",
    )
    for name, example in (
        ("partition", "gpu"),
        ("account", "proj123"),
        ("time", "04:00:00"),
        ("qos", "high"),
        ("mem", "0"),
    ):
        slurm.add_argument(f"--{name}", default=None, metavar=name.upper(), help=f"#SBATCH --{name}, e.g. {example}")
    slurm.add_argument(
        "--cpus-per-task", type=int, default=None, metavar="C", help="CPUs per node for its torchrun and ranks"
    )
    slurm.add_argument("--job-name", default=None, metavar="NAME", help="default: hybridflow-<run.name>")
    slurm.add_argument(
        "--rdzv-port",
        type=int,
        default=SUPPRESS,
        metavar="PORT",
        help=f"rendezvous port on the first node (default {SLURM_DEFAULTS['rdzv_port']})",
    )
    slurm.add_argument(
        "--max-restarts",
        type=int,
        default=SUPPRESS,
        metavar="K",
        help=f"torchrun restarts within one allocation (default {SLURM_DEFAULTS['max_restarts']})",
    )
    slurm.add_argument(
        "--signal-lead-s",
        type=int,
        default=SUPPRESS,
        metavar="S",
        help=f"requeue the job this many seconds before its time limit (default {SLURM_DEFAULTS['signal_lead_s']})",
    )
    slurm.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="export NAME=VALUE in the script (repeatable)"
    )
    slurm.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="--OPT=VAL",
        help="one more #SBATCH option, given as --sbatch-option=--constraint=h100 (repeatable)",
    )
    mode = slurm.add_mutually_exclusive_group()
    mode.add_argument("--submit", action="store_true", help="also sbatch the script and print the job id")
    mode.add_argument("--dry-run", action="store_true", help="only print the script; write nothing")
    slurm.set_defaults(handler=_slurm)


def _weights_line(model) -> str:
    """Where the run's weights come from, as planned."""
    if not model.path:
        return (
            "weights: random initialisation (model.init=random)"
            if model.init == "random"
            else "weights: random initialisation: no model.path is set (refused on GPUs and Slurm)"
        )
    if not os.path.exists(os.path.expanduser(model.path)):
        return f"weights: model.path={model.path} does not exist here: the shape is the config's model.* keys"
    return (
        f"weights: {model.path} ({'random init, its architecture' if model.init == 'random' else 'pretrained'}); "
        "shape from its config.json"
    )


def _plan_summary(cfg: HybridflowConfig, plan: ExecutionPlan) -> list[str]:
    counts = count_parameters(cfg.model)
    lines = [
        f"model {cfg.model.described}: {format_count(counts['total'])} parameters "
        f"({format_count(counts['active'])} active per token, "
        f"{format_count(counts['embedding'])} embedding)",
        _weights_line(cfg.model),
    ]
    lines += [trainer_line(cfg, name, layout) for name, layout in enabled_roles(cfg).items()]
    lines.append(f"rollout: {cfg.rollout.describe()}")
    lines.append(f"async_rl: {cfg.async_rl.describe()}")
    lines.append(f"features: {', '.join(active_features(cfg)) or 'none'} (hybridflow/features.py)")
    return lines + plan.spec.describe() + plan.describe()


def _plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    check_trainer_backends(cfg)
    check_engine_serves(cfg)
    if args.world_size is not None:
        cfg.actor.parallel.check_world_size(args.world_size, prefix="actor.parallel")
    if args.device_memory_gib <= 0:
        raise ValueError(f"--device-memory-gib={args.device_memory_gib:g} must be > 0")
    with_reshard = not (args.no_reshard or args.mermaid or args.resolved)
    plan = lower(cfg, with_reshard=with_reshard, device_memory_gib=args.device_memory_gib)
    check_runtime_support(cfg)  # a plan the runtime would not run is a claim without proof
    check_reward(cfg.reward)  # a misspelled reward would otherwise fail only after the SFT warm-up
    if args.mermaid:
        print(plan.graph.to_mermaid())
    elif args.resolved:
        print(to_yaml(cfg), end="")
    else:
        # the answer first; the details after it; the resolved YAML only when asked for
        host = [] if has_gpu_device() else [host_memory(cfg).line()]
        print("\n".join([*plan.verdict(), *host, "", *_plan_summary(cfg, plan)]))
        print(f"(the resolved config: hybridflow plan {args.config} ... --resolved)")
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def _selftest(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    check_trainer_backends(cfg)
    if args.steps < 2:
        raise ValueError(f"--steps={args.steps} must be >= 2 to see the loss move")
    nproc = cfg.actor.parallel.world_size
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "hybridflow.selftest",
        args.config,
        *args.overrides,
    ]
    env = {**os.environ, "HYBRIDFLOW_SELFTEST_STEPS": str(args.steps)}
    # Several ranks on few cores: one thread each avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"hybridflow selftest: {nproc} process(es), {trainer_text(cfg, cfg.actor.parallel)}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def _train(args: argparse.Namespace) -> int:
    from launch.torchrun import launch_train  # here: keeps `hybridflow plan` import-light

    cfg = load_config(args.config, args.overrides)
    preflight(cfg)
    return launch_train(
        cfg.actor.parallel,
        args.config,
        _with_lengths(cfg, args.overrides),
        rollout=cfg.rollout.describe(),
        trainer=trainer_text(cfg, cfg.actor.parallel),
        more_ranks=more_ranks(cfg),
        output_dir=cfg.run.output_dir,
    )


def _launch(args: argparse.Namespace) -> int:
    from launch.multinode import hosts_rendezvous, launch

    spec = LaunchSpec(
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        **_given(args, LAUNCH_DEFAULTS),
    )
    cfg = load_config(args.config, args.overrides)
    spec.check_layout(cfg.actor.parallel, more_ranks(cfg))
    check_separate_nodes(cfg, spec.nproc_per_node)
    preflight(cfg, command="launch", content=hosts_rendezvous(spec))  # one node reads the checkpoint through
    overrides = _with_lengths(cfg, args.overrides)
    return launch(spec, cfg.actor.parallel, args.config, overrides, output_dir=cfg.run.output_dir)


def _with_lengths(cfg: HybridflowConfig, overrides: Sequence[str]) -> list[str]:
    """``overrides`` and the data lengths this process decided (``hybridflow.lengths``): the ranks,
    on this machine, take them instead of deciding again, each loading the tokenizer (seconds on a
    busy CPU). Not for ``slurm``: a login node may not hold the data the nodes decide from."""
    d = cfg.data
    lengths = [f"data.max_prompt_length={d.max_prompt_length}", f"data.max_response_length={d.max_response_length}"]
    return [*overrides, *lengths]


def _given(args: argparse.Namespace, defaults: dict[str, object]) -> dict[str, object]:
    """The options of ``defaults`` given on the command line (the rest keep the dataclass default)."""
    return {name: getattr(args, name) for name in defaults if hasattr(args, name)}


def _env_pairs(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    pairs = tuple(item.partition("=")[::2] for item in items)
    for item, (name, _) in zip(items, pairs):
        if "=" not in item or not name:
            raise ValueError(f"--env {item!r} must look like NAME=VALUE")
    return pairs


def _slurm(args: argparse.Namespace) -> int:
    from launch import slurm

    cfg = load_config(args.config, args.overrides)
    job = slurm.SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        nproc_per_node=slurm.nproc_per_node(
            cfg.actor.parallel,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            requested=args.nproc_per_node,
            more_ranks=more_ranks(cfg),
        ),
        job_name=args.job_name or f"hybridflow-{cfg.run.name}",
        partition=args.partition,
        account=args.account,
        time=args.time,
        qos=args.qos,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        env=_env_pairs(args.env),
        extra_directives=tuple(args.sbatch_option),
        **_given(args, SLURM_DEFAULTS),
    )
    check_slurm_run(cfg, job, dry_run=args.dry_run)
    run_dir, text = slurm.sbatch_for_run(
        job, config=args.config, overrides=args.overrides, output_dir=cfg.run.output_dir
    )
    print(text, end="")
    if args.dry_run:
        return 0
    path = slurm.write_script(text, run_dir)
    # status lines are comments, so the whole output stays a valid script
    print(f"# written to {path}", flush=True)
    if args.submit:
        job_id = slurm.submit(path)
        print(f"# submitted batch job {job_id}; log: {run_dir / 'logs'}/slurm-{job_id}.out")
    return 0


def _byte_size(text: str) -> int:
    """``1073741824``, ``256M`` or ``1G`` (binary units) as a positive number of bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 1073741824, 256M, 1G)")
    return int(digits) * scale


def _add_convert_options(parser: argparse.ArgumentParser, dtype_help: str) -> None:
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (written as DIR.tmp, then renamed)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help=dtype_help)
    parser.add_argument(
        "--buffer-bytes",
        type=_byte_size,
        default=DEFAULT_BUFFER_BYTES,
        metavar="N",
        help=f"tensor data held in memory at a time (default {DEFAULT_BUFFER_BYTES >> 20}M)",
    )
    parser.add_argument(
        "--checksums", action="store_true", help="also verify the CRC32 of every tensor by reading the output back"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def _add_convert_parser(commands) -> None:
    convert = commands.add_parser("convert", help="convert checkpoints between Hugging Face and megatron-core")
    directions = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = directions.add_parser("hf-to-mcore", help="Hugging Face safetensors -> megatron-core torch_dist")
    to_mcore.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face model directory")
    for axis, text in (
        ("tp", "tensor"),
        ("pp", "pipeline"),
        ("vpp", "virtual pipeline"),
        ("ep", "expert"),
        ("etp", "expert tensor"),
    ):
        to_mcore.add_argument(
            f"--{axis}",
            type=int,
            default=1,
            metavar="N",
            help=f"{text}-parallel size the checkpoint is for (checked against the model)",
        )
    _add_convert_options(to_mcore, "store tensors in this dtype (default: as in the HF files)")
    to_mcore.set_defaults(handler=_convert_hf_to_mcore)
    to_hf = directions.add_parser("mcore-to-hf", help="megatron-core torch_dist -> Hugging Face safetensors")
    to_hf.add_argument("--mcore", required=True, metavar="DIR", help="megatron-core checkpoint directory")
    hf_config_help = (
        "HF directory whose config.json and tokenizer to use (default: the ones hf-to-mcore "
        "stored in the checkpoint, or the run's model/ for a checkpoint in its run directory)"
    )
    to_hf.add_argument("--hf-config", default=None, metavar="DIR", help=hf_config_help)
    to_hf.add_argument(
        "--shard-bytes",
        type=_byte_size,
        default=DEFAULT_SHARD_BYTES,
        metavar="N",
        help=f"largest safetensors shard (default {DEFAULT_SHARD_BYTES >> 20}M)",
    )
    to_hf.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's checkpoint: write W + (alpha/r) B A for every adapted weight",
    )
    _add_convert_options(to_hf, "write tensors in this dtype (default: as stored)")
    to_hf.set_defaults(handler=_convert_mcore_to_hf)
    to_peft = directions.add_parser(
        "mcore-to-peft", help="a LoRA run's checkpoint -> its adapters as Hugging Face PEFT files"
    )
    to_peft.add_argument("--mcore", required=True, metavar="DIR", help="the LoRA run's actor checkpoint directory")
    to_peft.add_argument("--hf-config", default=None, metavar="DIR", help=hf_config_help)
    to_peft.add_argument("--out", required=True, metavar="DIR", help="output directory (PEFT adapter)")
    to_peft.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    to_peft.set_defaults(handler=_convert_mcore_to_peft)
    fsdp_to_hf = directions.add_parser("fsdp2-to-hf", help="an FSDP2 run's checkpoint -> Hugging Face safetensors")
    fsdp_to_hf.add_argument("--checkpoint", required=True, metavar="DIR", help="the FSDP2 run's actor checkpoint")
    fsdp_to_hf.add_argument(
        "--hf-config",
        default=None,
        metavar="DIR",
        help="HF directory whose config.json and tokenizer to use (default: the ones the checkpoint carries)",
    )
    fsdp_to_hf.add_argument("--out", required=True, metavar="DIR", help="output directory (written as DIR.tmp)")
    fsdp_to_hf.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    fsdp_to_hf.set_defaults(handler=_convert_fsdp2_to_hf)


def _convert_hf_to_mcore(args: argparse.Namespace) -> int:
    from hfschema.hf_config import read_model_config

    read_model_config(args.hf)  # a bad config.json is refused before megatron-core loads (seconds)
    from megatron_adapters.convert import hf_to_mcore  # here: keeps other commands torch-free

    report = hf_to_mcore(
        args.hf,
        args.out,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        etp=args.etp,
        dtype=args.dtype,
        buffer_bytes=args.buffer_bytes,
        checksums=args.checksums,
        overwrite=args.overwrite,
    )
    print("\n".join(report.lines()))
    return 0


def _convert_fsdp2_to_hf(args: argparse.Namespace) -> int:
    from fsdp_adapters.export import export_checkpoint

    nbytes = export_checkpoint(args.checkpoint, args.out, hf_config=args.hf_config, overwrite=args.overwrite)
    print(f"fsdp2-to-hf: {args.checkpoint} -> {args.out} ({nbytes / 1e6:.1f} MB of weights)")
    return 0


def _refuse_an_fsdp2_checkpoint(directory: str) -> None:
    """A converter of megatron checkpoints given an FSDP2 run's: the direction that reads it."""
    from fsdp_adapters.checkpoint import TRAINER_FILE

    if (Path(directory) / TRAINER_FILE).is_file():
        raise ValueError(
            f"--mcore {directory} is an FSDP2 checkpoint (actor.backend=fsdp2); convert it with "
            f"hybridflow convert fsdp2-to-hf --checkpoint {directory} --out DIR"
        )


def _convert_mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_adapters.convert import mcore_to_hf

    _refuse_an_fsdp2_checkpoint(args.mcore)
    report = mcore_to_hf(
        args.mcore,
        args.out,
        hf_config=args.hf_config,
        dtype=args.dtype,
        buffer_bytes=args.buffer_bytes,
        shard_bytes=args.shard_bytes,
        checksums=args.checksums,
        overwrite=args.overwrite,
        merge_lora=args.merge_lora,
    )
    print("\n".join(report.lines()))
    return 0


def _convert_mcore_to_peft(args: argparse.Namespace) -> int:
    from megatron_adapters.convert import mcore_to_peft

    report = mcore_to_peft(args.mcore, args.out, hf_config=args.hf_config, overwrite=args.overwrite)
    print("\n".join(report.lines()))
    return 0


class _Decisions(logging.Handler):
    """What the config loader decided for the user (the data lengths) as a line of this command's
    output on the standard error it has at that moment, not a log record only ``--verbose`` shows."""

    def __init__(self, command: str) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(f"hybridflow {command}: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # the flag is the setting's short form: the ranks read the config
        args.overrides = [*args.overrides, "run.verbose=true"]
    decisions, handler = logging.getLogger(lengths.__name__), _Decisions(args.command)
    decisions.addHandler(handler)
    decisions.setLevel(logging.INFO)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"hybridflow {args.command}: error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        decisions.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
