"""Checkpoint converter benchmark: a synthetic Qwen3-MoE checkpoint (>= 4 GB), HF -> megatron -> HF.

    config sized to --target-bytes ──► random bf16 tensors written with safetensors (1 GB files)
        ──► plain copy of the same files, fsync'ed                          (copy_gbps)
        ──► child process: hf_to_mcore   (its peak RSS from os.wait4)       (hf_to_mcore_*)
        ──► child process: mcore_to_hf                                      (mcore_to_hf_*)
        ──► every tensor compared with the source, one at a time            (round_trip_bitwise)
        ──► JSON printed; --json PATH also writes it; the work directory is deleted

Throughput is HF tensor bytes over the conversion's own wall time (measured inside the child,
after its imports; outputs fsync'ed, dirty pages flushed before each step); the child's whole
wall time is reported beside it. Peak RSS is the child's ``ru_maxrss`` and is compared with the
checkpoint size (goal: at most 25%); an idle child that only imports the converter gives the
floor (the CUDA build of torch and megatron-core's imports), the rest is the working set, which
``--buffer-bytes`` bounds whatever the checkpoint size.

    .venv/bin/python benchmarks/convert.py [--json out.json] [--target-bytes 4500M] [--buffer-bytes 256M]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from benchmarks.output import emit, parse_bytes  # noqa: E402

logger = logging.getLogger("convert_bench")

DIMS = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,
    moe_intermediate_size=768,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=32000,
)
"""A Qwen3-MoE shape (Qwen3-30B-A3B's proportions, narrower); layers are added to reach the size."""


# --------------------------------------------------------------------------- synthetic model


def _layer_bytes() -> int:
    d = DIMS
    q, kv = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
    attention = (2 * q + 2 * kv) * d["hidden_size"] + 2 * d["head_dim"] + 2 * d["hidden_size"]
    experts = d["num_experts"] * 3 * d["moe_intermediate_size"] * d["hidden_size"]
    return 2 * (attention + experts + d["num_experts"] * d["hidden_size"])


def write_synthetic(path: Path, target_bytes: int) -> tuple[int, int]:
    """A HF directory of ~``target_bytes`` of random bf16 weights; returns (bytes, tensors)."""
    import torch
    from safetensors.torch import save_file

    from hybridflow.rollout.tiny import make_tiny_tokenizer

    head = 2 * 2 * DIMS["vocab_size"] * DIMS["hidden_size"]
    layers = max(1, math.ceil((target_bytes - head) / _layer_bytes()))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": layers,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "dtype": "bfloat16",
        **DIMS,
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    make_tiny_tokenizer(320).save_pretrained(str(path))
    from hfschema.hf_config import read_model_config
    from reshard.families import canonical_tensors

    tensors = canonical_tensors(read_model_config(path))
    total, shard, shard_bytes, index = 0, {}, 0, 0
    weight_map = {}
    generator = torch.Generator().manual_seed(0)
    for t in tensors:
        shard[t.name] = torch.randn(t.shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
        shard_bytes += shard[t.name].nbytes
        if shard_bytes >= 1 << 30 or t is tensors[-1]:
            index += 1
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            total += shard_bytes
            shard, shard_bytes = {}, 0
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total, len(tensors)


# ------------------------------------------------------------------------------ measurements


def _child(args: list[str]) -> dict:
    """Run this script's --child mode; return its JSON result with peak RSS and wall time.

    Dirty pages of the previous step are flushed first, so each step pays for its own writes."""
    os.sync()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"child {args[0]} failed with status {status}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    result.update(peak_rss_bytes=usage.ru_maxrss * 1024, process_seconds=time.perf_counter() - started)
    return result


def _run_child(argv: list[str]) -> None:
    """Child mode: one step, its result as one JSON line. Big work happens in children only:
    a child's ru_maxrss starts at its parent's resident size (fork), so the parent stays small."""
    kind, *rest = argv
    if kind == "make":
        nbytes, count = write_synthetic(Path(rest[0]), int(rest[1]))
        print(json.dumps({"nbytes": nbytes, "count": count}))
        return
    if kind == "compare":
        print(json.dumps({"bitwise": _bitwise_equal(Path(rest[0]), Path(rest[1]))}))
        return
    from megatron_adapters.convert import hf_to_mcore, mcore_to_hf

    if kind == "idle":
        print(json.dumps({"seconds": 0.0, "nbytes": 0}))
        return
    source, out, buffer_bytes = rest[0], rest[1], int(rest[2])
    convert = hf_to_mcore if kind == "hf-to-mcore" else mcore_to_hf
    report = convert(source, out, buffer_bytes=buffer_bytes)
    print(json.dumps({"seconds": report.seconds, "nbytes": report.nbytes, "lines": report.lines()}))


def _copy(source: Path, target: Path) -> float:
    """Plain copy of every file, fsync'ed like the converters' outputs; returns seconds."""
    os.sync()
    started = time.perf_counter()
    target.mkdir()
    for path in sorted(source.iterdir()):
        shutil.copyfile(path, target / path.name)
        with open(target / path.name, "rb+") as f:
            os.fsync(f.fileno())
    return time.perf_counter() - started


def _bitwise_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def index(path: Path) -> dict[str, Path]:
        out = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                out.update(dict.fromkeys(f.keys(), file))
        return out

    left, right = index(a), index(b)
    if sorted(left) != sorted(right):
        return False
    for name in left:
        with safe_open(str(left[name]), "pt") as f, safe_open(str(right[name]), "pt") as g:
            x, y = f.get_tensor(name), g.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)):
                return False
    return True


def run(workdir: Path, target_bytes: int, buffer_bytes: int) -> dict:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        made = _child(["make", str(workdir / "hf"), str(target_bytes)])
        nbytes, count = made["nbytes"], made["count"]
        copy_seconds = _copy(workdir / "hf", workdir / "copy")
        shutil.rmtree(workdir / "copy")
        idle = _child(["idle"])
        to_mcore = _child(["hf-to-mcore", str(workdir / "hf"), str(workdir / "mcore"), str(buffer_bytes)])
        to_hf = _child(["mcore-to-hf", str(workdir / "mcore"), str(workdir / "back"), str(buffer_bytes)])
        bitwise = _child(["compare", str(workdir / "hf"), str(workdir / "back")])["bitwise"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "checkpoint_bytes": nbytes,
        "num_tensors": count,
        "buffer_bytes": buffer_bytes,
        "hf_to_mcore_peak_rss_bytes": to_mcore["peak_rss_bytes"],
        "mcore_to_hf_peak_rss_bytes": to_hf["peak_rss_bytes"],
        "hf_to_mcore_peak_rss_ratio": round(to_mcore["peak_rss_bytes"] / nbytes, 4),
        "mcore_to_hf_peak_rss_ratio": round(to_hf["peak_rss_bytes"] / nbytes, 4),
        "idle_process_peak_rss_bytes": idle["peak_rss_bytes"],
        "hf_to_mcore_rss_above_idle_bytes": to_mcore["peak_rss_bytes"] - idle["peak_rss_bytes"],
        "mcore_to_hf_rss_above_idle_bytes": to_hf["peak_rss_bytes"] - idle["peak_rss_bytes"],
        "benchmark_parent_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "hf_to_mcore_gbps": round(to_mcore["nbytes"] / to_mcore["seconds"] / 1e9, 3),
        "mcore_to_hf_gbps": round(to_hf["nbytes"] / to_hf["seconds"] / 1e9, 3),
        "copy_gbps": round(nbytes / copy_seconds / 1e9, 3),
        "hf_to_mcore_seconds": round(to_mcore["seconds"], 2),
        "mcore_to_hf_seconds": round(to_hf["seconds"], 2),
        "copy_seconds": round(copy_seconds, 2),
        "hf_to_mcore_process_seconds": round(to_mcore["process_seconds"], 2),
        "mcore_to_hf_process_seconds": round(to_hf["process_seconds"], 2),
        "round_trip_bitwise": bitwise,
        "reports": {"hf_to_mcore": to_mcore["lines"], "mcore_to_hf": to_hf["lines"]},
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _run_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the result here")
    parser.add_argument(
        "--target-bytes",
        type=parse_bytes,
        default=parse_bytes("4200M"),
        help="synthetic checkpoint size (default 4200M, i.e. > 4 GB)",
    )
    parser.add_argument(
        "--buffer-bytes", type=parse_bytes, default=parse_bytes("256M"), help="converter buffer (default 256M)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/hybridflow_convert_bench"),
        help="scratch directory (deleted at the end)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(args.workdir, args.target_bytes, args.buffer_bytes)
    emit(result, args.json)


if __name__ == "__main__":
    main()
