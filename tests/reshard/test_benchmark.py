"""benchmarks/reshard_plan.py: one small case in-process, and the atomic JSON writer the benchmarks share."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hfschema.files import write_atomic

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "reshard_plan.py"
REQUIRED = {
    "model",
    "source",
    "destination",
    "num_gpus",
    "plan_seconds",
    "peak_rss_bytes",
    "bytes",
    "lower_bound_bytes",
    "baseline_bytes",
    "simulated_seconds",
}


def _module():
    spec = importlib.util.spec_from_file_location("reshard_plan", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cases_cover_four_models_64_to_2048_gpus():
    bench = _module()
    models = {c.model for c in bench.CASES}
    assert models == set(bench.MODELS) and len(models) == 4
    for model in models:
        assert sum(c.model == model for c in bench.CASES) >= 3
    gpus = [c.num_gpus for c in bench.CASES]
    assert min(gpus) == 64 and max(gpus) == 2048
    assert {c.colocated for c in bench.CASES} == {True, False}


def test_nemo_rl_shape_and_replica_sweeps_are_cases():
    bench = _module()
    nemo = [c for c in bench.CASES if c.bandwidth == "H100"]
    assert len(nemo) == 1 and nemo[0].model == "DeepSeek-V3-671B"
    assert (nemo[0].source.pp, nemo[0].source.ep, nemo[0].source.world_size) == (16, 16, 256)
    assert (nemo[0].destination.tp, nemo[0].destination.num_replicas) == (32, 8)
    assert bench.LINKS["H100"].intra_node_gbps == 450.0 and bench.LINKS["H100"].inter_node_gbps == 50.0
    separate = {(c.model, c.destination.num_replicas) for c in bench.CASES if not c.colocated}
    for model in ("Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3-671B"):
        assert {(model, 8), (model, 32)} <= separate


@pytest.mark.claim("reshard-node-aware-bounds")
def test_small_case_record_and_atomic_write(tmp_path):
    bench = _module()
    case = next(c for c in bench.CASES if c.model == "Mixtral-8x22B")
    record = bench.run_case(case)
    assert REQUIRED <= set(record)
    assert record["bytes"] == record["lower_bound_bytes"]
    assert record["inter_node_bytes"] == record["node_lower_bound_bytes"]
    assert record["goals"]["node_ratio_is_1"] and record["time_ratio"] >= 1.0
    assert bench.summary([record])["max_node_ratio"] == 1.0
    assert record["baseline_bytes"] >= 7 * record["bytes"]  # SGLang tp=8
    out = tmp_path / "sub" / "bench.json"
    write_atomic(out, json.dumps({"cases": [record]}))  # what main() writes --json with
    assert json.loads(out.read_text())["cases"][0]["model"] == "Mixtral-8x22B"
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]
