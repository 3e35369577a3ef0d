"""The ``hybridflow`` command line.

    hybridflow plan CONFIG [key=value ...] [--world-size N] [--no-reshard] [--mermaid]
                                           [--device-memory-gib G]
    hybridflow selftest CONFIG [key=value ...] [--steps N]
    hybridflow train CONFIG [key=value ...]

``plan`` is a dry run in one process: it loads the config and lowers it
(``hybridflow.lowering.lower``), which checks everything a run would check before starting a
process, then prints the resolved YAML followed by, as YAML comments: the model's parameter
counts, each enabled role's layout, the rollout engines, the algorithm (estimator, loss,
switches), the dataflow graph, the placement of roles on GPU pools, the stages in order with
the colocation switches between them, the estimated memory per GPU per phase with its peak
(against ``--device-memory-gib``, default 80), and the actor -> rollout weight sync planned
from shapes (bytes, lower bound, gather baseline, simulated time; ``--no-reshard`` skips it).
``--mermaid`` prints only the graph as a mermaid flowchart. Config errors exit with status 2
and a one-line message on stderr.

``selftest`` validates the config here, then starts one process per rank of the actor's
layout with torchrun (gloo on CPU, NCCL on GPUs) to train the actor a few steps on a synthetic
task, checkpoint it and reload it (``megatron_adapters/selftest.py``).
"""

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from hybridflow import __version__
from hybridflow.config import HybridflowConfig, enabled_roles, load_config, to_yaml
from hybridflow.lowering import ExecutionPlan, lower
from hybridflow.model_size import count_parameters, format_count

__all__ = ["main"]

EXIT_CONFIG_ERROR = 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow", description="RL post-training for MoE LLMs on megatron-core."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan", help="validate a config and print its resolved form, model size and layouts"
    )
    plan.add_argument(
        "config", metavar="CONFIG", help="YAML config file, e.g. configs/quickstart_cpu.yaml"
    )
    plan.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. train.lr=3e-4"
    )
    plan.add_argument(
        "--world-size", type=int, default=None, metavar="N",
        help="check that the actor layout fills exactly N ranks",
    )
    plan.add_argument(
        "--no-reshard", action="store_true",
        help="skip planning the actor -> rollout weight sync (about 1 s for a 671B model)",
    )
    plan.add_argument(
        "--mermaid", action="store_true",
        help="print only the dataflow graph, as a mermaid flowchart",
    )
    plan.add_argument(
        "--device-memory-gib", type=float, default=80.0, metavar="G",
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
    train = commands.add_parser(
        "train", help="run the config's job (SFT and/or RL) on every rank under torchrun"
    )
    train.add_argument("config", metavar="CONFIG", help="YAML config file")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides")
    train.set_defaults(handler=_train)
    return parser


def _plan_summary(cfg: HybridflowConfig, plan: ExecutionPlan) -> list[str]:
    counts = count_parameters(cfg.model)
    lines = [
        f"model {cfg.model.family}: {format_count(counts['total'])} parameters "
        f"({format_count(counts['active'])} active per token, "
        f"{format_count(counts['embedding'])} embedding)"
    ]
    for name, layout in enabled_roles(cfg).items():
        vocab = layout.padded_vocab_size(cfg.model)
        lines.append(f"{name}: {layout.describe()}; padded vocab {vocab}")
    lines.append(f"rollout: {cfg.rollout.describe()}")
    return lines + plan.spec.describe() + plan.describe()


def _plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.world_size is not None:
        cfg.actor.parallel.check_world_size(args.world_size, prefix="actor.parallel")
    if args.device_memory_gib <= 0:
        raise ValueError(f"--device-memory-gib={args.device_memory_gib:g} must be > 0")
    with_reshard = not (args.no_reshard or args.mermaid)
    plan = lower(cfg, with_reshard=with_reshard, device_memory_gib=args.device_memory_gib)
    if args.mermaid:
        print(plan.graph.to_mermaid())
        return 0
    print(to_yaml(cfg), end="")
    # the summary is printed as YAML comments so the whole output stays loadable
    print("\n".join(f"# {line}" for line in _plan_summary(cfg, plan)))
    return 0


def _selftest(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.steps < 2:
        raise ValueError(f"--steps={args.steps} must be >= 2 to see the loss move")
    nproc = cfg.actor.parallel.world_size
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "megatron_adapters.selftest",
        args.config, *args.overrides,
    ]
    env = {**os.environ, "HYBRIDFLOW_SELFTEST_STEPS": str(args.steps)}
    # Several ranks on few cores: one thread each avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"hybridflow selftest: {nproc} process(es), {cfg.actor.parallel.describe()}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def _train(args: argparse.Namespace) -> int:
    from launch.torchrun import launch_train  # here: keeps `hybridflow plan` import-light

    cfg = load_config(args.config, args.overrides)
    return launch_train(cfg, args.config, args.overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"hybridflow {args.command}: error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
