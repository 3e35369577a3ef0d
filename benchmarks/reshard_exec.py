"""Reshard executor benchmark: real gloo transfers on this CPU, four ways, on the same tensors.

    launcher ── torch.distributed.run --standalone --nproc-per-node=4 <this file> --worker OUT
                 │  (OMP_NUM_THREADS=1; process p plays Megatron rank p of TP2 x EP2, dp=2)
                 v
    source parameters: megatron_layout(model, TP2xEP2).param_shapes(p), filled from seeded
        canonical HF tensors (data-parallel copies agree). No megatron-core model is built:
        tests/reshard/test_executor.py checks the layout against a real one; here only the
        bytes matter, and two ~1 GB models of two layouts would dominate the run
    per case (destination layout x the processes playing its ranks):
        expected     canonical tensors sliced by the destination layout alone
        executor     plan_reshard (untimed) + reshard.executor.execute(bucket_bytes)
        baseline     verl / slime weight sync: per Megatron parameter all_gather over its TP
                     (dense) or EP x ETP (expert) group; process 0 assembles the full HF tensors
                     and broadcasts each to every engine process, which slices out its boxes
        megatron     megatron.core.resharding (Megatron -> Megatron case only):
                     build_centralized_reshard_plan (untimed) + execute_reshard_plan over
                     its GlooCopyService
        memcpy       process 0 alone (the others wait in a barrier): copy_ of `bytes` of bf16,
                     best of max(--repeats, 10) after a warm-up (cheap, and the noisiest figure)
        wire         gloo's own speed: process 0 sends process 1 as many bytes as the executor's
                     busiest sender sends, in bucket-sized messages (fraction_of_wire: how near
                     the executor runs to the transport it is given)
        each transfer: one warm-up pass into zeroed buffers, checked bit for bit against
        `expected`, then the best of --repeats timed passes (barrier ... barrier, on rank 0)
    rank 0 -> {"cases": [...]} -> printed as JSON; --json PATH also writes it (tmp file + rename)

The executor runs with ``bucket_bytes`` = --bucket-mb MiB (default: the config's
``rollout.reshard_bucket_mb``, 64 MiB), verification off; correctness is the warm-up check.
``bytes`` is what lands in destination buffers (every destination rank's boxes, local copies
included); every GB/s figure divides it by the seconds. Planning is left out of every timing:
both planners' plans are cached and reused by real refits.

megatron.core.resharding runs on nn.Modules holding the same tensors, with the attributes
megatron-core's parallel layers set (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, ``allreduce=False`` on experts), routed experts named as TEGroupedMLP
names them (``experts.linear_fc1.weight{j}``). Its planner reads an expert's global index from
that name only: under SequentialMLP names (``local_experts.{j}``) it matches experts across EP
ranks by their local index, and an EP change silently copies the wrong experts (tried: the check
fails). ``GlooCopyService()`` is built with ``torch.cuda.Stream`` stubbed out: its constructor
makes a CUDA stream (which fails without a CUDA driver) that ``run()`` never needs on the CPU.
SGLang destinations are not megatron-core modules, so it has no SGLang case.

    .venv/bin/python benchmarks/reshard_exec.py [--small] [--repeats 3] [--bucket-mb 64]
                                                [--only megatron] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hfschema.files import write_atomic  # noqa: E402
from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.model import ModelConfig  # noqa: E402
from hfschema.sglang import SGLangSettings  # noqa: E402
from hybridflow.config import RolloutConfig  # noqa: E402
from reshard.executor import ProcessMap, execute  # noqa: E402
from reshard.layouts import TensorLayout  # noqa: E402
from reshard.megatron import megatron_layout  # noqa: E402
from reshard.planner import plan_reshard  # noqa: E402
from reshard.regions import Region, num_elements  # noqa: E402
from reshard.sglang import sglang_layout  # noqa: E402
from reshard.topology import Device, Topology  # noqa: E402

logger = logging.getLogger("reshard_exec")

NUM_PROCESSES = 4
SOURCE = ParallelLayout(tp=2, ep=2, dp=2)
DTYPE = torch.bfloat16
SEED = 7

_QWEN3_MOE = dict(family="qwen3_moe", qk_layernorm=True, max_position_embeddings=4096)
MODELS: dict[str, ModelConfig] = {
    # ~0.80 GB in bf16: Qwen3-MoE shaped, 16 experts per layer
    "default": ModelConfig(
        **_QWEN3_MOE,
        hidden_size=1024,
        num_layers=12,
        num_attention_heads=16,
        num_kv_heads=4,
        head_dim=64,
        ffn_hidden_size=2816,
        vocab_size=32768,
        num_experts=16,
        moe_top_k=4,
        moe_ffn_hidden_size=512,
    ),
    # ~1.5 MB: the smoke test's
    "small": ModelConfig(
        **_QWEN3_MOE,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_size=256,
        vocab_size=1024,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=64,
    ),
}
"""Vocab sizes are multiples of 128 * tp, so TP2 and TP1 pad the vocab alike (megatron-core's
resharding checks local shapes against each other and does not know about padding)."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One destination of the TP2 x EP2 source."""

    name: str
    """Record name."""
    destination: SGLangSettings | ParallelLayout
    """SGLang engines or another Megatron layout."""
    processes: tuple[int, ...]
    """Process playing each destination rank."""


CASES: tuple[Case, ...] = (
    Case(name="sglang_tp2_on_0_1", destination=SGLangSettings(tp=2), processes=(0, 1)),
    Case(name="sglang_tp2_on_2_3", destination=SGLangSettings(tp=2), processes=(2, 3)),
    Case(name="sglang_tp2_ep2_on_0_1", destination=SGLangSettings(tp=2, ep=2), processes=(0, 1)),
    Case(name="sglang_tp2_ep2_on_2_3", destination=SGLangSettings(tp=2, ep=2), processes=(2, 3)),
    Case(name="megatron_tp1_ep4", destination=ParallelLayout(tp=1, ep=4, dp=4), processes=(0, 1, 2, 3)),
)

DESTINATION_LAYOUTS: dict[type, Callable[..., TensorLayout]] = {
    SGLangSettings: sglang_layout,
    ParallelLayout: megatron_layout,
}
"""How each kind of destination describes its ranks' parameters."""

NO_MEGATRON_NOTE = (
    "megatron.core.resharding refits one megatron-core model into another (both sides "
    "nn.Modules with a pg_collection, matched by Megatron parameter name); SGLang's fused "
    "parameters (qkv_proj, gate_up_proj, w13_weight) are not a megatron-core model"
)


# ------------------------------------------------------------------ weights and buffers


def _box(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    return tensor[tuple(slice(a, b) for a, b in region)]


def canonical_value(layout: TensorLayout, name: str) -> torch.Tensor:
    """Seeded random values of one canonical tensor (the same on every process and side)."""
    generator = torch.Generator().manual_seed(SEED * 2**32 + zlib.crc32(name.encode()))
    return torch.randn(layout.tensors[name].shape, generator=generator, dtype=DTYPE)


def filled_params(layout: TensorLayout, rank: int) -> dict[str, torch.Tensor]:
    """``rank``'s parameters with its canonical boxes filled in (padding left zero)."""
    params = {n: torch.zeros(s, dtype=DTYPE) for n, s in layout.param_shapes(rank).items()}
    by_tensor: dict[str, list] = {}
    for h in layout.holdings(rank).holdings:
        by_tensor.setdefault(h.tensor, []).append(h)
    for name, holdings in by_tensor.items():  # each canonical tensor made once
        value = canonical_value(layout, name)
        for h in holdings:
            dst = _box(params[h.param], h.param_region)
            dst.copy_(_box(value, h.region).reshape(dst.shape))
    return params


def needed_bytes(layout: TensorLayout) -> int:
    """Bytes of every destination rank's boxes."""
    return sum(layout.shard_nbytes(s) * len(s.ranks) for shards in layout.shards.values() for s in shards)


def _model_bytes(layout: TensorLayout) -> int:
    return sum(num_elements(tuple((0, n) for n in t.shape)) * t.itemsize for t in layout.tensors.values())


def checksum(buffers: Mapping[str, torch.Tensor]) -> float:
    """Sum of every destination element on every process (float64)."""
    total = torch.tensor([sum(float(b.double().sum()) for b in buffers.values())], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)


def all_equal(buffers: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> bool:
    """Every buffer equals its expectation bit for bit, on every process."""
    ok = buffers.keys() == expected.keys() and all(torch.equal(buffers[n], expected[n]) for n in expected)
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


# --------------------------------------------------------------------------- timing


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` passes, each between two barriers (rank 0's clock)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        run()
        dist.barrier()
        times.append(time.perf_counter() - started)
    return min(times)


def checked_then_timed(run: Callable[[], object], buffers, expected, repeats: int) -> dict:
    """Warm-up into zeroed buffers (checked), then the best timed pass."""
    for b in buffers.values():
        b.zero_()
    dist.barrier()
    run()
    ok = all_equal(buffers, expected)
    total = checksum(buffers)
    return {"ok": ok, "checksum": total, "seconds": best_seconds(run, repeats)}


MEMCPY_REPEATS = 10
"""At least this many memcpy passes: on a shared machine one pass in three can be slowed."""


def memcpy_seconds(nbytes: int, repeats: int) -> float | None:
    """Process 0 alone copies ``nbytes`` of bf16 once per pass; others wait (None there)."""
    seconds = None
    if dist.get_rank() == 0:
        src = torch.ones(nbytes // DTYPE.itemsize, dtype=DTYPE)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: first touch of the pages
        times = []
        for _ in range(max(repeats, MEMCPY_REPEATS)):
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
        seconds = min(times)
    dist.barrier()
    return seconds


def wire_seconds(nbytes: int, bucket_bytes: int, repeats: int) -> float | None:
    """gloo's own point-to-point speed here: process 0 sends ``nbytes`` to process 1 in
    bucket-sized messages (the others wait). The executor's busiest sender cannot beat it.
    None when the executor sends nothing (every box is local)."""
    if nbytes == 0:
        return None
    chunk = torch.ones(max(1, min(bucket_bytes, nbytes) // DTYPE.itemsize), dtype=DTYPE)

    def run() -> None:
        left = nbytes // DTYPE.itemsize
        while left > 0:
            part = chunk[: min(chunk.numel(), left)]
            if dist.get_rank() == 0:
                dist.send(part, 1)
            elif dist.get_rank() == 1:
                dist.recv(part, 0)
            left -= part.numel()

    run()  # warm-up
    return best_seconds(run, repeats)


# ------------------------------------------------------------------------- executor


def _topology(case: Case) -> Topology:
    # one Device per process: a destination rank sharing a process with a source rank copies
    return Topology(
        source=tuple(Device(node=0, gpu=p) for p in range(NUM_PROCESSES)),
        destination=tuple(Device(node=0, gpu=p) for p in case.processes),
    )


def executor_run(plan, processes: ProcessMap, sources, buffers, bucket_bytes: int, totals: dict) -> Callable[[], None]:
    """One pass of the project's executor; ``totals`` keeps the last report's counts."""

    def run() -> None:
        report = execute(plan, processes, sources=sources, destinations=buffers, bucket_bytes=bucket_bytes)
        counts = torch.tensor(
            [report.bytes_sent, report.bytes_copied_locally, report.peak_buffer_bytes, report.bytes_sent],
            dtype=torch.int64,
        )
        totals["rounds"] = report.rounds
        totals["counts"] = counts

    return run


def _executor_totals(totals: dict) -> dict:
    counts = totals["counts"].clone()
    peak = counts[2:].clone()
    dist.all_reduce(counts)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "executor_bytes_sent": int(counts[0]),
        "executor_bytes_copied_locally": int(counts[1]),
        "executor_peak_buffer_bytes": int(peak[0]),
        "executor_max_sent_bytes": int(peak[1]),
        "executor_rounds": totals["rounds"],
    }


# ------------------------------------------------------------------------- baseline


def _strided_group(inner: int, size: int):
    """This rank's group of ``size`` ranks ``inner`` apart (rank order, fastest axis first)."""
    groups = sorted(
        {tuple(r - r % (inner * size) + r % inner + inner * k for k in range(size)) for r in range(NUM_PROCESSES)}
    )
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="gloo")
    return mine


@dataclass(frozen=True, kw_only=True)
class GatherStep:
    """One Megatron parameter: gathered over ``group``, then its canonical tensors sent."""

    param: str
    group: dist.ProcessGroup | None
    """The gather group (None: the parameter is whole on every rank)."""
    members: tuple[int, ...]
    """Source ranks of the group, in group-rank order."""
    tensors: tuple[str, ...]
    """Canonical tensors completed by this gather (not sent by an earlier step)."""


class GatherBroadcast:
    """The verl / slime baseline: gather full HF tensors, send them whole to every engine rank.

    Megatron ranks order tp (dense grid) and etp x ep (expert grid) fastest, so a TP group is
    ``tp`` consecutive ranks and an expert-model-parallel group ``etp * ep`` of them.
    """

    def __init__(self, source: TensorLayout, layout: ParallelLayout) -> None:
        self.source = source
        self.held = [self._by_param(source, r) for r in range(NUM_PROCESSES)]
        expert_size = layout.etp * layout.ep
        self.groups = {  # size -> this process's group of that many consecutive ranks
            size: _strided_group(1, size) for size in sorted({layout.tp, expert_size}) if size > 1
        }
        self.sizes = {"dense": layout.tp, "expert": expert_size}
        self.steps = self._steps()

    @staticmethod
    def _by_param(layout: TensorLayout, rank: int) -> dict[str, list]:
        out: dict[str, list] = {p: [] for p in layout.param_shapes(rank)}
        for h in layout.holdings(rank).holdings:
            out[h.param].append(h)
        return out

    def _group_size(self, param: str) -> int:
        """EP x ETP for experts, TP for sharded dense parameters, 1 for whole ones (norms)."""
        holdings = self.held[0][param]
        if any(self.source.tensors[h.tensor].expert is not None for h in holdings):
            return self.sizes["expert"]
        whole = all(h.region == tuple((0, n) for n in self.source.tensors[h.tensor].shape) for h in holdings)
        return 1 if whole else self.sizes["dense"]

    def _steps(self) -> list[GatherStep]:
        me, params = dist.get_rank(), list(self.held[0])
        # every rank must post the same all_gathers in the same order (pp=1: same names)
        assert all(list(h) == params for h in self.held), "ranks hold different parameters"
        sent: set[str] = set()
        steps = []
        for param in params:
            size = self._group_size(param)
            # the tensors process 0 (the sender) completes: every process posts their broadcasts
            tensors = tuple(
                dict.fromkeys(h.tensor for m in range(size) for h in self.held[m][param] if h.tensor not in sent)
            )
            sent.update(tensors)
            base = me - me % size
            steps.append(
                GatherStep(
                    param=param, group=self.groups.get(size), members=tuple(range(base, base + size)), tensors=tensors
                )
            )
        return steps

    def run(self, sources, engine, counts: dict) -> None:
        """One pass: ``engine`` tells where the full tensors go and how they are sliced."""
        me = dist.get_rank()
        for step in self.steps:
            gathered = self._gather(sources[step.param], step, counts)
            for name in step.tensors:
                full = self._assemble(name, step, gathered) if me == 0 else None
                engine.receive(name, full, counts)

    @staticmethod
    def _gather(mine: torch.Tensor, step: GatherStep, counts: dict) -> list[torch.Tensor]:
        if step.group is None:
            return [mine]
        gathered = [torch.empty_like(mine) for _ in step.members]
        dist.all_gather(gathered, mine, group=step.group)
        counts["gather"] += mine.numel() * mine.element_size() * (len(step.members) - 1)
        return gathered

    def _assemble(self, name: str, step: GatherStep, gathered: list[torch.Tensor]) -> torch.Tensor:
        """The full canonical tensor from the gathered copies of ``step.param``."""
        full = torch.empty(self.source.tensors[name].shape, dtype=DTYPE)
        filled = 0
        for member, param in zip(step.members, gathered):
            for h in self.held[member][step.param]:
                if h.tensor == name:
                    dst = _box(full, h.region)
                    dst.copy_(_box(param, h.param_region).reshape(dst.shape))
                    filled += num_elements(h.region)
        assert filled == full.numel(), f"{name}: the gather did not complete it"
        return full


class Engines:
    """The engine side of the baseline: process 0 broadcasts, each engine rank slices."""

    def __init__(self, destination: TensorLayout, processes: tuple[int, ...], buffers: dict[str, torch.Tensor]) -> None:
        me = dist.get_rank()
        self.destination, self.buffers = destination, buffers
        self.receivers = sorted({0, *processes})
        self.group = dist.new_group(self.receivers, backend="gloo")  # collective
        self.is_engine = me in processes
        self.needs: dict[str, list] = {}
        if self.is_engine:
            for h in destination.holdings(processes.index(me)).holdings:
                self.needs.setdefault(h.tensor, []).append(h)

    def receive(self, name: str, full: torch.Tensor | None, counts: dict) -> None:
        """Broadcast ``name`` whole from process 0 and slice it into this rank's buffers."""
        me = dist.get_rank()
        if me not in self.receivers:
            return
        if full is None:
            full = torch.empty(self.destination.tensors[name].shape, dtype=DTYPE)
            counts["broadcast"] += full.numel() * full.element_size()
        dist.broadcast(full, src=0, group=self.group)
        for h in self.needs.get(name, ()):
            dst = _box(self.buffers[h.param], h.param_region)
            dst.copy_(_box(full, h.region).reshape(dst.shape))


def _baseline_totals(counts: dict) -> dict:
    t = torch.tensor([counts["gather"], counts["broadcast"]], dtype=torch.int64)
    dist.all_reduce(t)
    return {"baseline_gather_bytes": int(t[0]), "baseline_broadcast_bytes": int(t[1])}


# ------------------------------------------------------------- megatron.core.resharding

TP_ATTRIBUTES = {  # Placement.rule -> (partition_dim, partition_stride) set by megatron-core
    "qkv": (0, 1),
    "column": (0, 1),
    "vocab": (0, 1),
    "row": (1, 1),
    "gated_column": (0, 2),  # MLP builds fc1 with stride 2 when gated_linear_unit
    "expert_gated_column": (0, 2),
    "expert_row": (1, 1),
}
_SEQUENTIAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def te_grouped_name(name: str) -> str:
    """SequentialMLP ``experts.local_experts.{j}.linear_fc1.weight`` -> TEGroupedMLP
    ``experts.linear_fc1.weight{j}`` (other names unchanged)."""
    return _SEQUENTIAL_EXPERT.sub(r".experts.\2.weight\1", name)


def _param_rules(layout: TensorLayout) -> dict[str, tuple[str, bool]]:
    """Megatron parameter -> (its placement rule, whether it holds routed experts)."""
    out = {}
    for name, shards in layout.shards.items():
        tensor = layout.tensors[name]
        (rule,) = {pl.rule for pl in tensor.spec.megatron}  # untied families: one copy
        for s in shards:
            out[s.param] = (rule, tensor.expert is not None)
    return out


def megatron_module(layout: TensorLayout, params: Mapping[str, torch.Tensor], pg_collection):
    """An nn.Module holding ``params`` (shared storage) as megatron-core names and marks them."""
    root = torch.nn.Module()
    rules = _param_rules(layout)
    for name, tensor in params.items():
        *path, leaf = te_grouped_name(name).split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        param = torch.nn.Parameter(tensor, requires_grad=False)
        rule, expert = rules[name]
        if rule in TP_ATTRIBUTES:
            param.tensor_model_parallel = True
            param.partition_dim, param.partition_stride = TP_ATTRIBUTES[rule]
        if expert:
            param.allreduce = False  # megatron-core's expert mark (EP-sharded)
        module.register_parameter(leaf, param)
    root.pg_collection = pg_collection
    return root


def pg_collection(layout: ParallelLayout):
    """megatron-core's ProcessGroupCollection of ``layout`` (orders tp-cp-dp and etp-ep)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.tp = _strided_group(1, layout.tp)
    pgs.dp = _strided_group(layout.tp * layout.cp, layout.dp)
    pgs.expt_tp = _strided_group(1, layout.etp)
    pgs.ep = _strided_group(layout.etp, layout.ep)
    pgs.pp = _strided_group(layout.tp * layout.cp * layout.dp, layout.pp)
    return pgs


def gloo_copy_service():
    """megatron-core's GlooCopyService, its constructor's (unused on CPU) CUDA stream stubbed."""
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    with mock.patch.object(torch.cuda, "Stream", lambda *a, **k: None):
        return GlooCopyService()  # run() skips a None stream


def megatron_resharding(source, sources, destination, buffers, dst_layout: ParallelLayout):
    """(plan seconds, one-pass callable) of megatron.core.resharding on the same tensors."""
    from megatron.core.resharding import build_centralized_reshard_plan, execute_reshard_plan

    src = megatron_module(source, sources, pg_collection(SOURCE))
    dst = megatron_module(destination, buffers, pg_collection(dst_layout))
    service = gloo_copy_service()
    started = time.perf_counter()
    plan = build_centralized_reshard_plan(src, dst, num_experts=source.model.num_experts)
    plan_seconds = time.perf_counter() - started
    return plan_seconds, lambda: execute_reshard_plan(plan, src, dst, service=service)


# --------------------------------------------------------------------------- a case


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else round(nbytes / seconds / 1e9, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run_case(case: Case, model: ModelConfig, source: TensorLayout, sources, baseline, args) -> dict | None:
    """Every method on one case (collective); the record on rank 0, None elsewhere."""
    me = dist.get_rank()
    destination = DESTINATION_LAYOUTS[type(case.destination)](model, case.destination, dtype="bfloat16")
    dst_rank = case.processes.index(me) if me in case.processes else None
    expected = filled_params(destination, dst_rank) if dst_rank is not None else {}
    buffers = {n: torch.zeros_like(t) for n, t in expected.items()}
    record = {
        "name": case.name,
        "source": source.description,
        "destination": destination.description,
        "destination_processes": case.processes,
        "bytes": needed_bytes(destination),
        "model_bytes": _model_bytes(source),
        "bucket_bytes": args.bucket_mb << 20,
        "repeats": args.repeats,
    }
    ours = _executor_case(case, source, sources, destination, buffers, expected, args, record)
    theirs = _baseline_case(case, baseline, sources, destination, buffers, expected, args, record)
    mcore = _megatron_case(case, source, sources, destination, buffers, expected, args, record)
    record["memcpy_seconds"] = memcpy_seconds(record["bytes"], args.repeats)
    record["wire_seconds"] = wire_seconds(record["executor_max_sent_bytes"], record["bucket_bytes"], args.repeats)
    return _finish(record, ours, theirs, mcore) if me == 0 else None


def _executor_case(case, source, sources, destination, buffers, expected, args, record):
    started = time.perf_counter()
    plan = plan_reshard(source, destination, _topology(case))
    record["plan_seconds"] = round(time.perf_counter() - started, 3)
    processes = ProcessMap(source=tuple(range(NUM_PROCESSES)), destination=case.processes)
    totals: dict = {}
    run = executor_run(plan, processes, sources, buffers, record["bucket_bytes"], totals)
    result = checked_then_timed(run, buffers, expected, args.repeats)
    record.update(_executor_totals(totals))
    _log(case, "executor", result)
    return result


def _baseline_case(case, baseline, sources, destination, buffers, expected, args, record):
    engines = Engines(destination, case.processes, buffers)
    counts = {"gather": 0, "broadcast": 0}
    result = checked_then_timed(lambda: baseline.run(sources, engines, counts), buffers, expected, args.repeats)
    passes = args.repeats + 1  # the warm-up and the timed ones
    record.update(_baseline_totals({k: v // passes for k, v in counts.items()}))
    _log(case, "baseline", result)
    return result


def _megatron_case(case, source, sources, destination, buffers, expected, args, record):
    if not isinstance(case.destination, ParallelLayout):
        record["megatron_resharding_note"] = NO_MEGATRON_NOTE
        return None
    plan_seconds, run = megatron_resharding(source, sources, destination, buffers, case.destination)
    record["megatron_resharding_plan_seconds"] = round(plan_seconds, 3)
    record["megatron_resharding_note"] = (
        "megatron-core 0.16.1 build_centralized_reshard_plan + execute_reshard_plan over its "
        "GlooCopyService, on nn.Modules holding the same tensors (see the module docstring)"
    )
    result = checked_then_timed(run, buffers, expected, args.repeats)
    _log(case, "megatron.core.resharding", result)
    return result


def _finish(record: dict, ours: dict, theirs: dict, mcore: dict | None) -> dict:
    nbytes, ran = record["bytes"], [ours, theirs] + ([mcore] if mcore else [])
    record.update(
        {
            "executor_seconds": round(ours["seconds"], 6),
            "baseline_seconds": round(theirs["seconds"], 6),
            "megatron_resharding_seconds": round(mcore["seconds"], 6) if mcore else None,
            "memcpy_seconds": round(record["memcpy_seconds"], 6),
            "executor_gbps": _gbps(nbytes, ours["seconds"]),
            "baseline_gbps": _gbps(nbytes, theirs["seconds"]),
            "megatron_resharding_gbps": _gbps(nbytes, mcore["seconds"]) if mcore else None,
            "memcpy_gbps": _gbps(nbytes, record["memcpy_seconds"]),
            "speedup_vs_baseline": _ratio(theirs["seconds"], ours["seconds"]),
            "speedup_vs_megatron_resharding": _ratio(mcore["seconds"], ours["seconds"]) if mcore else None,
            "fraction_of_memcpy": _ratio(record["memcpy_seconds"], ours["seconds"]),
            "wire_seconds": round(record["wire_seconds"], 6) if record["wire_seconds"] else None,
            "fraction_of_wire": _ratio(record["wire_seconds"], ours["seconds"]),
            "checksums_ok": all(r["ok"] and r["checksum"] == ours["checksum"] for r in ran),
            "checksums": {
                "executor": ours["checksum"],
                "baseline": theirs["checksum"],
                "megatron_resharding": mcore["checksum"] if mcore else None,
            },
        }
    )
    return record


def _log(case: Case, what: str, result: dict) -> None:
    if dist.get_rank() == 0:
        logger.info("%s %s: %.3f s, bit-exact %s", case.name, what, result["seconds"], result["ok"])


# -------------------------------------------------------------------------- processes


def worker(args: argparse.Namespace) -> None:
    """One of the torchrun processes: every case, rank 0 writes the records."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it logs every pass at INFO
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != NUM_PROCESSES:
        raise ValueError(f"the worker needs {NUM_PROCESSES} processes, got {dist.get_world_size()}")
    model = MODELS["small" if args.small else "default"]
    source = megatron_layout(model, SOURCE, dtype="bfloat16")
    sources = filled_params(source, dist.get_rank())
    baseline = GatherBroadcast(source, SOURCE)
    records = []
    for case in CASES:
        if args.only in case.name:
            records.append(run_case(case, model, source, sources, baseline, args))
    if dist.get_rank() == 0:
        write_atomic(Path(args.worker), json.dumps({"cases": records}, indent=2) + "\n")
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> dict:
    """Run the workers under torchrun and return their JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cases.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={NUM_PROCESSES}",
            __file__,
            "--worker",
            str(out),
            "--repeats",
            str(args.repeats),
            "--bucket-mb",
            str(args.bucket_mb),
            "--only",
            args.only,
        ] + (["--small"] if args.small else [])
        # workers' output goes to stderr: stdout carries only the JSON
        subprocess.run(cmd, check=True, stdout=sys.stderr, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    """Launch the workers, print the JSON and write it to --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the JSON here (atomically)")
    parser.add_argument("--small", action="store_true", help="a ~1.5 MB model (smoke test)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes after the warm-up")
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=RolloutConfig().reshard_bucket_mb,
        help="executor bucket_bytes in MiB (default: rollout.reshard_bucket_mb)",
    )
    parser.add_argument("--only", default="", help="run cases whose name contains this text")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.bucket_mb < 1:
        parser.error("--repeats and --bucket-mb must be >= 1")
    if args.worker:
        worker(args)
        return
    text = json.dumps(launch(args), indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
