"""benchmarks/reshard_plan.py: one small case in-process, and the atomic JSON writer."""

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "reshard_plan.py"
REQUIRED = {"model", "source", "destination", "num_gpus", "plan_seconds", "peak_rss_bytes",
            "bytes", "lower_bound_bytes", "baseline_bytes", "simulated_seconds"}


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


def test_small_case_record_and_atomic_write(tmp_path):
    bench = _module()
    case = next(c for c in bench.CASES if c.model == "Mixtral-8x22B")
    record = bench.run_case(case)
    assert REQUIRED <= set(record)
    assert record["bytes"] == record["lower_bound_bytes"]
    assert record["baseline_bytes"] >= 7 * record["bytes"]  # SGLang tp=8
    out = tmp_path / "sub" / "bench.json"
    bench._write_atomically(out, json.dumps({"cases": [record]}))
    assert json.loads(out.read_text())["cases"][0]["model"] == "Mixtral-8x22B"
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]
