"""``lora.push=adapter`` in ``EngineSync``: when the plan moves the base, and when only adapters go.

One process, no process groups: the base push (``_push_base``, the reshard plan) is replaced by a
recorder, the channel gathers this process's report alone, and the engine is a stand-in that
records what it loads. Whether a GPU colocated engine keeps its weights while the actor trains
(it does under ``lora.push=adapter``, so the base goes once there too) is the plan's answer.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.rollout.base import EngineLost, WeightPushReport
from hybridflow.runtime import sync as sync_module

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu_lora.yaml")


class _Engine:
    def __init__(self, lose_at: int | None = None) -> None:
        self.loaded, self.lose_at = [], lose_at

    def load_adapter(self, name, tensors, config) -> WeightPushReport:
        if len(self.loaded) + 1 == self.lose_at:
            raise EngineLost("process 7 (sglang::scheduler_TP0) was killed by SIGKILL during load_lora_adapter")
        self.loaded.append(name)
        return WeightPushReport(seconds=0.0, bytes_per_rank=(sum(t.nbytes for t in tensors.values()),), route="adapter")


def _sync(engine: _Engine) -> tuple[sync_module.EngineSync, list]:
    es = object.__new__(sync_module.EngineSync)
    es.cfg = load_config(QUICKSTART, ["lora.push=adapter", "lora.target_modules=[linear_qkv]"])
    es.engines, es.pushes, es._base_held = SimpleNamespace(engine=engine), 0, False
    es.pushes_adapters = True
    es.adapters = lambda: ({"lora_A": torch.zeros(4, 8), "lora_B": torch.zeros(8, 4)}, {"r": 4})
    es.channel = SimpleNamespace(gather=lambda mine: [mine], separate=False)
    es._replica = lambda: 0
    bases = []

    def push_base(verify):
        bases.append(verify)
        return sync_module._Pushed(0, 1000.0, 1000, 0, None)

    es._push_base = push_base
    return es, bases


@pytest.mark.claim("lora-adapter-push")
def test_the_base_goes_once_then_adapters_alone_and_again_after_an_engine_restart() -> None:
    engine = _Engine()
    es, bases = _sync(engine)
    first = es._push_once(True)[0]
    assert bases == [True] and first.engine_bytes == 1000.0 and first.adapter_bytes == 256.0
    for _ in range(2):
        es.pushes += 1
        later = es._push_once(False)[0]
        assert later.engine_bytes == 0.0 and later.adapter_bytes == 256.0
    assert bases == [True] and engine.loaded == ["policy_1", "policy_2", "policy_3"]
    es.engines_replaced()  # recovery.EngineRestarts.replace: a new engine is empty
    assert es._push_once(False)[0].engine_bytes == 1000.0 and bases == [True, False]


@pytest.mark.claim("lora-adapter-push")
def test_colocated_gpu_engines_keep_the_base_while_the_actor_trains_so_it_goes_once() -> None:
    from hybridflow.lowering import switch
    from hybridflow.memory import TRAINING, pool_memory

    merged = load_config(QUICKSTART, ["lora.target_modules=[linear_qkv]"])
    adapter = load_config(QUICKSTART, ["lora.push=adapter", "lora.target_modules=[linear_qkv]"])
    separate = load_config(
        QUICKSTART,
        ["lora.push=adapter", "lora.target_modules=[linear_qkv]", "rollout.placement=separate", "rollout.tp=1"],
    )
    assert sync_module.drops_weights(merged, gpu=True) and not sync_module.drops_weights(merged, gpu=False)
    assert not sync_module.drops_weights(adapter, gpu=True) and not sync_module.drops_weights(separate, gpu=True)
    # the plan's switches say so: generation -> training frees the KV cache alone, and the sync
    # resumes nothing; merged pushes free and take back the weights as well
    assert switch(adapter, "generate", "train").engine_release == ("kv_cache", "cuda_graph")
    assert switch(adapter, "train", "sync").engine_resume == ()
    assert switch(merged, "generate", "train").engine_release == ("weights", "kv_cache", "cuda_graph")
    assert switch(merged, "train", "sync").engine_resume == ("weights",)
    # and the memory estimate counts the resident base in the training phase
    roles = ("actor", "rollout")
    assert "engine weights" in pool_memory(adapter, roles, pool="gpus").phases[TRAINING]
    assert "engine weights" not in pool_memory(merged, roles, pool="gpus").phases[TRAINING]


@pytest.mark.parametrize("lose_at", [1, 2])
def test_an_engine_lost_while_loading_adapters_is_reported_and_gets_the_base_next(lose_at: int) -> None:
    es, bases = _sync(_Engine(lose_at=lose_at))
    results = [es._push_once(False)[0] for _ in range(lose_at)]
    assert results[-1].lost.startswith("process 7") and results[-1].adapter_bytes == 0.0
    es._push_once(False)  # the retry (after the restart) brings the base again
    assert len(bases) == 2  # the first push's, and the retry's


@pytest.mark.claim("lora-adapters-to-separate-engines")
def test_adapters_travel_to_separate_drivers_as_one_flat_buffer_per_dtype_and_come_back_whole() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.lora_A.weight": torch.randn(4, 8, generator=g),
        "a.lora_B.weight": torch.randn(8, 4, generator=g),
        "b.lora_A.weight": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "b.lora_B.weight": torch.randn(3, 2, generator=g),
    }
    layout = sync_module._layout(tensors, {"r": 4})
    flat = sync_module._flatten(tensors, layout, torch.device("cpu"))
    assert [(t.dtype, t.numel()) for t in flat] == [(torch.float32, 32 + 32 + 6), (torch.bfloat16, 6)]
    received = [torch.empty(n, dtype=d) for d, n in sync_module._flat_sizes(layout)]
    for buf, sent in zip(received, flat):
        buf.copy_(sent)
    back = sync_module._unflatten(received, layout)
    assert list(back) == list(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    # each its own storage: an engine that pickles one must not carry the whole buffer along
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in back.values())
