"""The engine boundary: everything the runtime asks of a rollout engine is in the engine
protocols (``hybridflow/rollout/base.py``), checked two ways.

- Statically: every ``<...>engine.<method>(...)`` call in ``hybridflow/runtime`` names a method
  of ``ENGINE_PROTOCOLS``, and each built-in engine implements the protocols its routes need.
- In a run: a short quickstart whose engines reach the runtime behind ``tests.injection``'s
  ``ProtocolOnly`` proxy (the methods of the protocols the engine implements, nothing else)
  trains its steps, with SGLang (sliced pushes) and with the transformers engine (full pushes).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.rollout.base import (
    ENGINE_PROTOCOLS,
    AdapterReceiver,
    BackgroundGenerator,
    RolloutEngine,
    SlicedWeightReceiver,
    protocol_methods,
    require,
)
from tests.injection import ProtocolOnly, environment

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "hybridflow" / "runtime"


def _engine_calls() -> dict[str, list[str]]:
    """attribute -> where the runtime reads ``<x>.engine.attribute`` or ``engine.attribute`` (a call
    or not: a method passed on, a property read, count alike)."""
    calls: dict[str, list[str]] = {}
    for path in sorted(RUNTIME.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "engine":
                calls.setdefault(node.attr, []).append(f"{path.name}:{node.lineno}")
    return calls


def test_the_runtime_calls_nothing_on_an_engine_outside_the_protocols() -> None:
    allowed = {name for protocol in ENGINE_PROTOCOLS for name in protocol_methods(protocol)}
    calls = _engine_calls()
    assert {"generate", "push_weights", "push_rank_payloads", "load_adapter"} <= set(calls), calls  # it sees them
    outside = {name: where for name, where in calls.items() if name not in allowed}
    assert not outside, f"engine methods the runtime calls outside rollout.base's protocols: {outside}"


def test_each_built_in_engine_class_implements_the_protocols_of_its_routes() -> None:
    from hybridflow.rollout.hf_engine import HFEngine
    from hybridflow.rollout.sglang.engine import SGLangEngine

    def has(cls: type, protocol: type) -> bool:
        return all(callable(getattr(cls, name, None)) for name in protocol_methods(protocol))

    assert has(HFEngine, RolloutEngine) and not has(HFEngine, SlicedWeightReceiver)
    assert not has(HFEngine, BackgroundGenerator)  # generates in this process: submit() generates at once
    assert all(
        has(SGLangEngine, p) for p in (RolloutEngine, SlicedWeightReceiver, AdapterReceiver, BackgroundGenerator)
    )


def test_a_route_the_engine_cannot_take_is_named() -> None:
    class GenerateOnly:
        def generate(self, prompts, params): ...

    with pytest.raises(
        TypeError,
        match=r"^rollout.sync_route=sliced needs a rollout engine with rank_params, "
        r"push_rank_payloads, weight_digests \(SlicedWeightReceiver\); "
        r"GenerateOnly has not",
    ):
        require(GenerateOnly(), SlicedWeightReceiver, "rollout.sync_route=sliced")
    proxy = ProtocolOnly(GenerateOnly())
    assert proxy.implements == [] and not hasattr(proxy, "generate")  # not the whole protocol: nothing


@pytest.mark.claim("engine-protocol")
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["sglang", "hf"])
def test_a_run_whose_engines_have_only_the_protocols_methods_trains(tmp_path: Path, engine: str) -> None:
    out = tmp_path / "run"
    overrides = [
        "sft.steps=0",
        "run.steps=2",
        "run.checkpoint_every=0",
        "run.heldout_prompts=4",
        "run.heldout_every=0",
        "run.prompts_per_step=4",
        "rollout.n=2",
        "run.tracking.trackers=[]",
    ]
    if engine == "hf":
        overrides += ["rollout.engine=hf", "rollout.tp=1", "rollout.sync_route=full"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment(PROTOCOL_ONLY="1")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.cli",
            "train",
            "configs/quickstart_cpu.yaml",
            f"run.output_dir={out}",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    implements = {"sglang": "RolloutEngine, SlicedWeightReceiver, AdapterReceiver", "hf": "RolloutEngine"}[engine]
    # said while the engine starts: its log file (runtime.console), the rank's or the engine's
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert f"the {engine} engine reduced to {implements}" in logs, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["first_step_logprob_diff_max"] < 1e-3, summary
