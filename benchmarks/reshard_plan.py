"""Reshard planner benchmark: real MoE architectures, Megatron training -> SGLang rollout layouts.

    CASES (model x megatron layout x sglang settings x colocated/separate)
        -> one fresh worker process per case, pinned to one CPU core:
               build both layouts + plan_reshard   (timed: plan_seconds, plan_cpu_seconds)
               process 0's part of the executor's schedule, 64 and 256 MiB buckets
                                                   (rank_schedule_64mb, rank_schedule_256mb)
               plan_stats                          (timed apart: stats_seconds)
               peak RSS of the process (resource.getrusage ru_maxrss)
        -> {"cases": [...]} printed as JSON; --json PATH also writes it (tmp file + rename)

Architecture numbers are typed in below from the models' public Hugging Face configs. Weights
are bf16 (the float32 DeepSeek-V3 expert bias aside). Bandwidth model: see reshard.stats.

    .venv/bin/python benchmarks/reshard_plan.py [--json out.json] [--only deepseek]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from hfschema.files import write_atomic  # noqa: E402

from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.model import ModelConfig  # noqa: E402
from hfschema.sglang import SGLangSettings  # noqa: E402
from reshard import (  # noqa: E402
    Bandwidth,
    PipelineSplit,
    Topology,
    megatron_layout,
    plan_reshard,
    plan_stats,
    sglang_layout,
)

logger = logging.getLogger("reshard_plan")

MODELS: dict[str, ModelConfig] = {
    # deepseek-ai/DeepSeek-V3 config.json (MTP layer not counted)
    "DeepSeek-V3-671B": ModelConfig(
        family="deepseek_v3",
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_kv_heads=128,
        ffn_hidden_size=18432,
        vocab_size=129280,
        max_position_embeddings=4096,
        num_experts=256,
        moe_top_k=8,
        moe_ffn_hidden_size=2048,
        num_shared_experts=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        router_topk_scaling_factor=2.5,
        router_num_groups=8,
        router_group_topk=4,
        first_k_dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    # Qwen/Qwen3-235B-A22B config.json
    "Qwen3-235B-A22B": ModelConfig(
        family="qwen3_moe",
        hidden_size=4096,
        num_layers=94,
        num_attention_heads=64,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=151936,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=1536,
        qk_layernorm=True,
    ),
    # mistralai/Mixtral-8x22B-v0.1 config.json
    "Mixtral-8x22B": ModelConfig(
        family="mixtral",
        hidden_size=6144,
        num_layers=56,
        num_attention_heads=48,
        num_kv_heads=8,
        ffn_hidden_size=16384,
        vocab_size=32768,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=16384,
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "Qwen3-30B-A3B": ModelConfig(
        family="qwen3_moe",
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
        qk_layernorm=True,
    ),
}


@dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark case."""

    model: str
    """Key of MODELS."""
    source: ParallelLayout
    """Megatron layout."""
    destination: SGLangSettings
    """SGLang engines."""
    colocated: bool
    """Destination rank i on source rank i's device (else on their own nodes)."""
    split: PipelineSplit = field(default_factory=PipelineSplit)
    """Uneven pipeline stages of the source."""
    bandwidth: str = "config"
    """Key of LINKS: the link speeds the case is timed with."""

    @property
    def num_gpus(self) -> int:
        """Devices used by both sides."""
        if self.colocated:
            return max(self.source.world_size, self.destination.num_ranks)
        return self.source.world_size + self.destination.num_ranks


def _uneven(first: int, last: int) -> PipelineSplit:
    return PipelineSplit(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)


LINKS: dict[str, Bandwidth] = {
    # the config's defaults (rollout.intra_node_gbps / inter_node_gbps): NVLink, 200 Gb/s IB per GPU
    "config": Bandwidth(intra_node_gbps=200.0, inter_node_gbps=25.0),
    # H100 SXM: NVLink 4 at 450 GB/s per GPU per direction; one 400 Gb/s InfiniBand NIC per GPU
    "H100": Bandwidth(intra_node_gbps=450.0, inter_node_gbps=50.0),
}

CASES: tuple[Case, ...] = (
    # NeMo-RL's refit shape (docs/design-docs/nccl-reshard-refit.md: 2.4-2.8 s on 256 H100):
    # DeepSeek-V3 Megatron PP16 x EP16 -> 8 inference engines of 32 ranks, colocated
    Case(
        model="DeepSeek-V3-671B",
        source=ParallelLayout(pp=16, ep=16, dp=16),
        split=_uneven(4, 1),
        destination=SGLangSettings(tp=32, ep=32, num_replicas=8),
        colocated=True,
        bandwidth="H100",
    ),
    Case(
        model="DeepSeek-V3-671B",
        source=ParallelLayout(pp=16, ep=64, dp=64),
        split=_uneven(4, 1),
        destination=SGLangSettings(tp=8, ep=8, enable_dp_attention=True, dp_size=8, num_replicas=128),
        colocated=True,
    ),
    Case(
        model="DeepSeek-V3-671B",
        source=ParallelLayout(pp=16, ep=64, dp=64),
        split=_uneven(4, 1),
        destination=SGLangSettings(tp=8, ep=8, enable_dp_attention=True, dp_size=8, num_replicas=128),
        colocated=False,
    ),
    Case(
        model="DeepSeek-V3-671B",
        source=ParallelLayout(tp=2, pp=8, ep=32, dp=32),
        split=_uneven(7, 6),
        colocated=True,
        destination=SGLangSettings(tp=16, ep=16, enable_dp_attention=True, dp_size=16, num_replicas=32),
    ),
    Case(
        model="DeepSeek-V3-671B",
        source=ParallelLayout(pp=8, ep=32, dp=32),
        split=_uneven(7, 6),
        destination=SGLangSettings(tp=8, ep=8, num_replicas=32),
        colocated=True,
    ),
    Case(
        model="Qwen3-235B-A22B",
        source=ParallelLayout(tp=4, pp=4, ep=8, dp=8),
        split=_uneven(23, 23),
        destination=SGLangSettings(tp=8, ep=8, num_replicas=16),
        colocated=True,
    ),
    Case(
        model="Qwen3-235B-A22B",
        source=ParallelLayout(tp=4, pp=4, ep=8, dp=8),
        split=_uneven(23, 23),
        destination=SGLangSettings(tp=8, num_replicas=16),
        colocated=False,
    ),
    Case(
        model="Qwen3-235B-A22B",
        source=ParallelLayout(tp=2, pp=8, ep=16, dp=32),
        split=_uneven(10, 12),
        colocated=True,
        destination=SGLangSettings(tp=8, ep=8, enable_dp_attention=True, dp_size=8, num_replicas=64),
    ),
    Case(
        model="Mixtral-8x22B",
        source=ParallelLayout(tp=8, pp=4, ep=8, dp=2),
        destination=SGLangSettings(tp=8, num_replicas=8),
        colocated=True,
    ),
    Case(
        model="Mixtral-8x22B",
        source=ParallelLayout(tp=4, pp=2, ep=8, dp=16),
        destination=SGLangSettings(tp=8, ep=8, num_replicas=16),
        colocated=True,
    ),
    Case(
        model="Mixtral-8x22B",
        source=ParallelLayout(tp=8, pp=4, ep=8, dp=2),
        destination=SGLangSettings(tp=8, num_replicas=8),
        colocated=False,
    ),
    Case(
        model="Qwen3-30B-A3B",
        source=ParallelLayout(ep=8, dp=64),
        destination=SGLangSettings(tp=4, num_replicas=16),
        colocated=True,
    ),
    Case(
        model="Qwen3-30B-A3B",
        source=ParallelLayout(tp=2, pp=2, ep=8, dp=32),
        destination=SGLangSettings(tp=8, ep=8, num_replicas=16),
        colocated=True,
    ),
    Case(
        model="Qwen3-30B-A3B",
        source=ParallelLayout(tp=2, ep=8, dp=32),
        destination=SGLangSettings(tp=2, num_replicas=32),
        colocated=False,
    ),
    # separate placement with 8 and 32 engines per trainer set: how sync time grows with replicas
    Case(
        model="Qwen3-30B-A3B",
        source=ParallelLayout(tp=2, ep=8, dp=32),
        destination=SGLangSettings(tp=2, num_replicas=8),
        colocated=False,
    ),
    *(
        Case(
            model="Mixtral-8x22B",
            source=ParallelLayout(tp=8, pp=4, ep=8, dp=2),
            destination=SGLangSettings(tp=8, num_replicas=n),
            colocated=False,
        )
        for n in (32,)
    ),
    *(
        Case(
            model="Qwen3-235B-A22B",
            source=ParallelLayout(tp=4, pp=4, ep=8, dp=8),
            split=_uneven(23, 23),
            destination=SGLangSettings(tp=8, num_replicas=n),
            colocated=False,
        )
        for n in (8, 32)
    ),
    *(
        Case(
            model="DeepSeek-V3-671B",
            source=ParallelLayout(pp=8, ep=32, dp=32),
            split=_uneven(7, 6),
            destination=SGLangSettings(tp=8, ep=8, num_replicas=n),
            colocated=False,
        )
        for n in (8, 32)
    ),
)


def _topology(case: Case) -> Topology:
    src, dst = case.source.world_size, case.destination.num_ranks
    if case.colocated:
        return Topology.colocated(src, num_destination=dst)
    return Topology.separate(src, dst)


def run_case(case: Case) -> dict:
    """Plan one case in this process and return its JSON record."""
    model = MODELS[case.model]
    wall, cpu = time.perf_counter(), time.process_time()
    source = megatron_layout(model, case.source, split=case.split)
    destination = sglang_layout(model, case.destination)
    plan = plan_reshard(source, destination, _topology(case))
    plan_seconds, plan_cpu = time.perf_counter() - wall, time.process_time() - cpu
    plan_rss = _peak_rss()
    rank_part = _rank_part(plan, case)
    wall = time.perf_counter()
    bandwidth = LINKS[case.bandwidth]
    stats = plan_stats(plan, bandwidth=bandwidth)
    record = {
        "model": case.model,
        "source": source.description,
        "destination": destination.description,
        "topology": "colocated" if case.colocated else "separate",
        "num_gpus": case.num_gpus,
        "plan_seconds": round(plan_seconds, 3),
        "plan_cpu_seconds": round(plan_cpu, 3),
        "stats_seconds": round(time.perf_counter() - wall, 3),
        "peak_rss_bytes": plan_rss,
        **rank_part,
        **stats.as_dict(),
        "links": case.bandwidth,
        "intra_node_gbps": bandwidth.intra_node_gbps,
        "inter_node_gbps": bandwidth.inter_node_gbps,
        "goals": {
            "node_ratio_is_1": stats.inter_node_bytes == stats.node_lower_bound_bytes,
            "time_ratio_at_most_1_10": stats.time_ratio <= 1.10,
        },
    }
    if not case.colocated:  # what relays buy: the same plan with every node fed by the trainer
        direct = plan_stats(plan_reshard(source, destination, _topology(case), max_relays=0), bandwidth=bandwidth)
        record["without_relays_simulated_seconds"] = round(direct.simulated_seconds, 4)
    record["ratio_to_lower_bound"] = round(record["ratio_to_lower_bound"], 6)
    record["baseline_ratio"] = round(record["baseline_ratio"], 3)
    record["simulated_seconds"] = round(record["simulated_seconds"], 4)
    return record


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_part(plan, case: Case) -> dict:
    """What one process derives next, at its first weight push: its part of the executor's
    schedule (``reshard.executor.schedule``) at the config's bucket (``rollout.reshard_bucket_mb``,
    64 MiB) and at 256 MiB, for process 0. Each is derived in a forked child, so its peak memory
    above the plan's is its own."""
    from reshard.executor import ProcessMap

    source, destination = plan.source.num_ranks, plan.destination.num_ranks
    first = 0 if case.colocated else source
    processes = ProcessMap(source=tuple(range(source)), destination=tuple(first + r for r in range(destination)))
    return {f"rank_schedule_{mb}mb": _in_child(plan, processes, mb << 20) for mb in (64, 256)}


def _in_child(plan, processes, bucket_bytes: int) -> dict:
    from reshard.executor import schedule

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: derive, report, leave without the parent's exit handlers
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from the present one
        before, cpu = _status_bytes("VmRSS"), time.process_time()
        steps = schedule(plan, processes, bucket_bytes=bucket_bytes, process=0)
        record = {
            "cpu_seconds": round(time.process_time() - cpu, 3),
            "added_peak_rss_bytes": _status_bytes("VmHWM") - before,
            "rounds": len(steps.rounds),
            "own_messages": sum(len(r) for r in steps.rounds),
        }
        os.write(write, json.dumps(record).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def summary(cases: list[dict]) -> dict:
    """The issue's goals over the cases run: worst ratios, and NeMo-RL's shape under H100 links."""
    nemo = [c for c in cases if c["links"] == "H100"]
    return {
        "max_node_ratio": max((c["node_ratio"] for c in cases), default=None),
        "max_time_ratio": max((c["time_ratio"] for c in cases), default=None),
        "nemo_rl_shape_simulated_seconds": nemo[0]["simulated_seconds"] if nemo else None,
        "all_goals_met": all(all(c["goals"].values()) for c in cases)
        and all(c["simulated_seconds"] < 1.0 for c in nemo),
    }


def _worker(index: int) -> None:
    """Run case ``index`` pinned to one core; print its record as JSON."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print(json.dumps(run_case(CASES[index])))


def _run_in_fresh_process(index: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", str(index)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Run the selected cases, one fresh process each, and print / write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the JSON here (atomically)")
    parser.add_argument("--only", default="", help="run cases whose model contains this text")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = []
    for i, case in enumerate(CASES):
        if args.only.lower() in case.model.lower():
            cases.append(_run_in_fresh_process(i))
            c = cases[-1]
            logger.info(
                "%s %s -> %s (%s): planned in %.2f s, %.0f MB; network %.2fx the node bound, "
                "simulated %.3g s = %.3fx the time bound; baseline %.2fx",
                c["model"],
                c["source"],
                c["destination"],
                c["topology"],
                c["plan_seconds"],
                c["peak_rss_bytes"] / 2**20,
                c["node_ratio"],
                c["simulated_seconds"],
                c["time_ratio"],
                c["baseline_ratio"],
            )
    text = json.dumps({"cases": cases, "summary": summary(cases)}, indent=2)
    print(text)
    if args.json:
        write_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
