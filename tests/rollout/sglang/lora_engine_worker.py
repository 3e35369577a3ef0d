"""Run by ``test_lora_adapter.py`` as its own process: one OpenMP thread, so that the CPU engine's
processes are forked (``hybridflow/rollout/sglang/cpu.py``), which is where they can serve LoRA.

Starts an engine with ``lora_args`` on the base model, then generates greedily four times: with
no adapter, after ``load_adapter`` of the first PEFT directory, after loading the second (which
replaces the first), and after unloading that one. Writes each phase's responses and log-probs.
"""

from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)


def main(spec_path: str) -> None:
    from safetensors.torch import load_file

    from hybridflow.rollout import SamplingParams, make_engine
    from hybridflow.rollout.sglang.engine import lora_args

    spec = json.loads(open(spec_path).read())
    adapters = [
        (load_file(f"{d}/adapter_model.safetensors"), json.loads(open(f"{d}/adapter_config.json").read()))
        for d in spec["adapters"]
    ]
    config = adapters[0][1]
    engine = make_engine(
        "sglang",
        model_path=spec["model"],
        tp=spec["tp"],
        **lora_args(rank=config["r"], target_modules=config["target_modules"], on_cpu=True),
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=spec["max_new"])
    phases, pushes = {}, []

    def run(phase: str) -> None:
        batch = engine.generate(spec["prompts"], greedy)
        phases[phase] = [{"response": list(s.response_ids), "logprobs": list(s.logprobs)} for s in batch.samples]

    try:
        run("base")
        for index, (tensors, adapter_config) in enumerate(adapters):
            report = engine.load_adapter(f"step{index + 1}", tensors, adapter_config)
            pushes.append({"seconds": report.seconds, "bytes": report.bytes_per_rank[0], "route": report.route})
            run(f"adapter{index + 1}")
        engine.unload_adapter(f"step{len(adapters)}")
        run("unloaded")
    finally:
        engine.shutdown()
    with open(spec["out"], "w") as out:
        json.dump({"phases": phases, "pushes": pushes}, out)


if __name__ == "__main__":
    main(sys.argv[1])
