"""``model.path`` loading benchmark: a multi-GB Hugging Face checkpoint onto 2 ranks, per layout.

    synthetic Qwen3-MoE checkpoint (benchmarks/convert.py's, bf16, 1 GB shards + index)
    per layout (EP=2, TP=2): torchrun 2 ranks, each
        idle RSS (imports, process groups)  ──► megatron-core policy (bf16 params, not loaded)
        page cache dropped ──► plain reads of exactly the byte ranges the loader reads (baseline)
        page cache dropped ──► load_hf_weights (megatron_adapters/pretrained.py)
        peak RSS (VmHWM) - idle RSS  vs  the rank's parameter bytes + 2 x buffer
    ──► JSON printed; --json PATH also writes it; the work directory is deleted

The baseline is what the loader cannot beat: the same bytes, read with ``os.preadv`` into one
reusable buffer of the same size, on both ranks at once. The page cache is dropped before each
phase (``posix_fadvise(DONTNEED)`` on every shard), so both read from the disk.

    .venv/bin/python benchmarks/load_pretrained.py [--json out.json] [--target-bytes 2500M]
        [--buffer-bytes 64M] [--layouts ep2,tp2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from benchmarks.output import emit, parse_bytes  # noqa: E402
from hfschema.files import write_atomic  # noqa: E402

LAYOUTS = {"ep2": dict(ep=2, dp=2), "tp2": dict(tp=2, etp=2)}
"""Two ranks each: experts split (attention replicated), or every tensor split (experts too, etp=2)."""


# ------------------------------------------------------------------------------- rank side


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _drop_page_cache(directory: Path) -> None:
    os.sync()
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _byte_ranges(policy, directory: Path, rank: int) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of every read ``load_hf_weights`` makes on this rank: the rows of
    each box it holds (the loader reads whole rows and keeps the box's columns)."""
    from megatron_adapters.safetensors_stream import SafetensorsReader
    from reshard.megatron import megatron_layout

    reader = SafetensorsReader(directory)
    held = megatron_layout(policy.model_config, policy.layout, dtype="float32").holdings(rank).holdings
    ranges = []
    for h in held:
        entry = reader.tensors[h.tensor]
        first, stop = h.region[0]
        ranges.append((entry.path, entry.start + first * entry.row_bytes, (stop - first) * entry.row_bytes))
    reader.close()
    return ranges


def _plain_read(ranges: list[tuple[Path, int, int]], buffer_bytes: int) -> int:
    buffer = memoryview(bytearray(buffer_bytes))
    fds: dict[Path, int] = {}
    done = 0
    try:
        for path, offset, length in ranges:
            fd = fds.setdefault(path, os.open(path, os.O_RDONLY))
            end = offset + length
            while offset < end:
                got = os.preadv(fd, [buffer[: min(buffer_bytes, end - offset)]], offset)
                offset, done = offset + got, done + got
    finally:
        for fd in fds.values():
            os.close(fd)
    return done


def _timed_on_all_ranks(step) -> tuple[float, object]:
    """Seconds until the slowest rank finished ``step`` (all start together)."""
    import torch
    import torch.distributed as dist

    from megatron_adapters.parallel import device

    dist.barrier()
    started = time.perf_counter()
    result = step()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), result


def rank_main(directory: Path, layout_name: str, buffer_bytes: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from hfschema.hf_config import read_model_config
    from hfschema.layout import ParallelLayout
    from hfschema.train import TrainConfig
    from megatron_adapters import parallel
    from megatron_adapters.export import global_named_parameters
    from megatron_adapters.policy import MegatronPolicy
    from megatron_adapters.pretrained import load_hf_weights

    layout = ParallelLayout(**LAYOUTS[layout_name])
    pg = parallel.initialize(layout, seed=0)
    rank = dist.get_rank()
    idle = _rss("VmRSS")
    model = read_model_config(directory)
    policy = MegatronPolicy(
        model,
        layout,
        TrainConfig(micro_batch_size=1, global_batch_size=2),
        pg_collection=pg,
        trainable=False,
        params_dtype=torch.bfloat16,
        initialize=False,
    )
    share = sum(p.numel() * p.element_size() for p in global_named_parameters(policy).values())
    built = _rss("VmRSS")  # the policy's parameters (zeros, not initialised: as a pretrained run builds it)
    ranges = _byte_ranges(policy, directory, rank)
    if rank == 0:
        _drop_page_cache(directory)
    plain_seconds, plain_bytes = _timed_on_all_ranks(lambda: _plain_read(ranges, buffer_bytes))
    if rank == 0:
        _drop_page_cache(directory)
    load_seconds, report = _timed_on_all_ranks(lambda: load_hf_weights(policy, directory, buffer_bytes=buffer_bytes))
    if report.bytes_read != plain_bytes:
        raise AssertionError(f"the baseline read {plain_bytes} bytes, the loader {report.bytes_read}")
    mine = {"share": share, "above_idle": _rss("VmHWM") - idle, "bytes_read": report.bytes_read, "built": built - idle}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        write_atomic(
            out,
            json.dumps(
                {
                    "layout": f"{layout_name} ({layout.describe()})",
                    "buffer_bytes": buffer_bytes,
                    "load_seconds": round(load_seconds, 3),
                    "plain_read_seconds": round(plain_seconds, 3),
                    "rank_share_bytes": [m["share"] for m in everyone],
                    "rank_peak_rss_above_idle_bytes": [m["above_idle"] for m in everyone],
                    "rank_bytes_read": [m["bytes_read"] for m in everyone],
                    "rank_rss_after_build_above_idle_bytes": [m["built"] for m in everyone],
                }
            ),
        )
    dist.barrier()


# ------------------------------------------------------------------------------- driver


def _checkpoint(directory: Path, target_bytes: int) -> int:
    """The synthetic checkpoint, made in a child (its memory is not the driver's)."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
        "from benchmarks.convert import write_synthetic; "
        "print(write_synthetic(Path(sys.argv[1]), int(sys.argv[2]))[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory), str(target_bytes), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout.split()[-1])


def _case(directory: Path, layout: str, buffer_bytes: int, work: Path) -> dict:
    out = work / f"{layout}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--rank",
        str(directory),
        layout,
        str(buffer_bytes),
        str(out),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    return json.loads(out.read_text())


def run(target_bytes: int, buffer_bytes: int, layouts: list[str], work: Path) -> dict:
    directory = work / "hf"
    checkpoint_bytes = _checkpoint(directory, target_bytes)
    cases = []
    for layout in layouts:
        case = {**_case(directory, layout, buffer_bytes, work), "checkpoint_bytes": checkpoint_bytes}
        case["load_over_plain_read"] = round(case["load_seconds"] / case["plain_read_seconds"], 3)
        case["rss_within_share_plus_two_buffers"] = all(
            above <= share + 2 * buffer_bytes
            for above, share in zip(case["rank_peak_rss_above_idle_bytes"], case["rank_share_bytes"])
        )
        cases.append(case)
    return {"cases": cases}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        directory, layout, buffer_bytes, out = sys.argv[2:6]
        rank_main(Path(directory), layout, int(buffer_bytes), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--target-bytes", default="2500M", help="checkpoint size (default 2500M)")
    parser.add_argument("--buffer-bytes", default="64M", help="the loader's read block (default 64M)")
    parser.add_argument("--layouts", default="ep2,tp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--workdir", help="where the checkpoint is written (default: a temporary directory)")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    work = Path(tempfile.mkdtemp(prefix="load_pretrained_", dir=args.workdir))
    try:
        result = run(parse_bytes(args.target_bytes), parse_bytes(args.buffer_bytes), layouts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.json)


if __name__ == "__main__":
    main()
