"""The ``hybridflow`` command line.

    hybridflow plan CONFIG [key=value ...] [--world-size N] [--no-reshard]
    hybridflow selftest CONFIG [key=value ...] [--steps N]
    hybridflow train CONFIG [key=value ...]

``plan`` is a dry run in one process: it loads and validates the config, then prints
the resolved YAML, the model's parameter counts, each enabled role's layout, the rollout
engines, and the actor -> rollout weight sync planned from shapes (bytes, lower bound,
gather baseline, simulated time; ``--no-reshard`` skips it). Config errors exit with
status 2 and a one-line message on stderr.

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
from hybridflow.model_size import count_parameters, format_count
from hybridflow.weight_sync import describe_weight_sync

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


def _plan_summary(cfg: HybridflowConfig) -> list[str]:
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
    return lines


def _plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.world_size is not None:
        cfg.actor.parallel.check_world_size(args.world_size, prefix="actor.parallel")
    lines = _plan_summary(cfg)
    if not args.no_reshard:
        lines += describe_weight_sync(cfg)
    print(to_yaml(cfg), end="")
    # the summary is printed as YAML comments so the whole output stays loadable
    print("\n".join(f"# {line}" for line in lines))
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
