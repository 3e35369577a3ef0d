"""torchrun worker (4 processes, gloo): node-aware, relayed plans run by the executor.

Each case labels the 4 processes with a Topology, plans the reshard, and runs it with small
buckets (so multi-hop routes are pipelined over several rounds) and checksums on:

    two_nodes      Megatron DP2 on "node" 0 (processes 0-1) -> SGLang tp=1 x2 on "node" 1
                   (processes 2-3): each box enters node 1 once, and one rank forwards it
                   to the other over the intra-node link.
    chain          one Megatron rank (process 0, node 0) -> SGLang tp=1 x3 on nodes 1, 2, 3:
                   the model goes node to node through relays.
    colocated_pp   Megatron PP2 x DP2 on 2 nodes of 2 -> SGLang tp=2 x2, colocated: node 1
                   lacks stage 0, node 0 lacks stage 1; each crosses once and fans out.

Source parameters are the oracle's Megatron slices of a random checkpoint; every destination
buffer is compared element for element with the oracle's SGLang slices. Each process writes
``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.sglang import SGLangSettings  # noqa: E402
from reshard.executor import ProcessMap, execute  # noqa: E402
from reshard.megatron import megatron_layout  # noqa: E402
from reshard.planner import plan_reshard  # noqa: E402
from reshard.sglang import sglang_layout  # noqa: E402
from reshard.topology import Device, Topology  # noqa: E402
from tests.reshard import oracle  # noqa: E402
from tests.reshard.cases import TINY_MODELS  # noqa: E402


def _devices(*pairs: tuple[int, int]) -> tuple[Device, ...]:
    return tuple(Device(node=n, gpu=g) for n, g in pairs)


CASES = {
    "two_nodes": (
        ParallelLayout(dp=2),
        SGLangSettings(num_replicas=2),
        Topology(source=_devices((0, 0), (0, 1)), destination=_devices((1, 0), (1, 1))),
        ProcessMap(source=(0, 1), destination=(2, 3)),
    ),
    "chain": (
        ParallelLayout(),
        SGLangSettings(num_replicas=3),
        Topology(source=_devices((0, 0)), destination=_devices((1, 0), (2, 0), (3, 0))),
        ProcessMap(source=(0,), destination=(1, 2, 3)),
    ),
    "colocated_pp": (
        ParallelLayout(pp=2, dp=2),
        SGLangSettings(tp=2, num_replicas=2),
        Topology.colocated(4, gpus_per_node=2),
        ProcessMap(source=(0, 1, 2, 3), destination=(0, 1, 2, 3)),
    ),
}
MODEL = TINY_MODELS["qwen3_moe"]


def run_case(name: str, hf: dict) -> dict:
    layout, settings, topology, processes = CASES[name]
    source = megatron_layout(MODEL, layout, dtype="float32")
    destination = sglang_layout(MODEL, settings, dtype="float32")
    plan = plan_reshard(source, destination, topology, part_bytes=4096)  # several routes per need
    src_rank, dst_rank = processes.roles(dist.get_rank())
    params = {}
    if src_rank is not None:
        params = {
            k: torch.from_numpy(np.ascontiguousarray(v))
            for k, v in oracle.megatron_params(MODEL, layout, hf, src_rank).items()
        }
    buffers = {}
    if dst_rank is not None:
        buffers = {n: torch.zeros(s) for n, s in destination.param_shapes(dst_rank).items()}
    report = execute(plan, processes, sources=params, destinations=buffers, bucket_bytes=2048, verify=True)
    inter = plan.route_kind == 2
    result = {
        "report": report.as_dict(),
        "dst_rank": dst_rank,
        "relay_routes": int(plan.route_relay.sum()),
        "max_hop": plan.max_hop,
        "inter_relay_routes": int((plan.route_relay & inter).sum()),
        "inter_bytes": int(plan.route_nbytes()[inter].sum()),
    }
    if dst_rank is not None:
        want = oracle.sglang_params(MODEL, settings, hf, dst_rank)
        result["names_match"] = set(want) == set(buffers)
        result["mismatched"] = [
            n for n, v in want.items() if not torch.equal(buffers[n], torch.from_numpy(np.ascontiguousarray(v)))
        ]
    return result


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    hf = {k: v.astype(np.float32) for k, v in oracle.hf_checkpoint(MODEL, seed=7).items()}
    results = {name: run_case(name, hf) for name in CASES}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
