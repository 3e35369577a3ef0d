"""Per-rank payloads: checked and laid out before sharing, and opened by another process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
import torch.multiprocessing

from hybridflow.rollout.sglang import handles

# the engine-side view of rank 0 of a tp=2 CPU engine: moe intermediate 32 per rank padded to 64
PARAMS = {
    "model.layers.0.mlp.experts.w2_weight": {"shape": [4, 16, 64], "dtype": "float32"},
    "model.layers.0.self_attn.o_proj.weight": {"shape": [16, 8], "dtype": "bfloat16"},
}

# Another Python process, unrelated to this one (not a multiprocessing child), opens a handle
# with SGLang's own restricted unpickler and reports what it saw.
RECEIVER = textwrap.dedent("""
    import io, sys
    from sglang.srt.utils.common import SafeUnpickler
    tensor = SafeUnpickler(io.BytesIO(sys.stdin.buffer.read())).load()
    print(tuple(tensor.shape), str(tensor.dtype), tensor[1, 2].item(), tensor[-1, -1].item())
""")


def _shm_managers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "torch_shm_manager"]


@pytest.mark.claim("push-by-handles")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_tensor_travels_by_value_without_torch_shared_memory_manager(dtype):
    """A CPU share carries its data (torch's file_system sharing once timed out under CI load)."""
    before = torch.multiprocessing.get_sharing_strategy()
    managers = _shm_managers()
    owner = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256).to(dtype)
    handle = handles.share(owner)
    assert torch.multiprocessing.get_sharing_strategy() == before
    assert _shm_managers() == managers  # no torch_shm_manager was started for it
    assert len(handle) > owner.nbytes  # the data itself
    out = subprocess.run([sys.executable, "-c", RECEIVER], input=handle, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    expected = f"(256, 256) {dtype} {owner[1, 2].item()} {owner[-1, -1].item()}"
    assert out.stdout.decode().strip().splitlines()[-1] == expected


def test_prepare_pads_casts_and_counts_the_engine_bytes():
    tensors = {
        "model.layers.0.mlp.experts.w2_weight": torch.ones(4, 16, 32),  # planner layout: unpadded
        "model.layers.0.self_attn.o_proj.weight": torch.ones(16, 8, dtype=torch.float32),
    }
    payload, kept = handles.prepare_rank_payload(0, tensors, PARAMS)
    assert payload.rank == 0 and set(payload.handles) == set(tensors)
    assert [tuple(t.shape) for t in kept] == [(4, 16, 64), (16, 8)]
    assert kept[0][..., 32:].abs().sum() == 0 and kept[0][..., :32].sum() == 4 * 16 * 32
    assert kept[1].dtype == torch.bfloat16
    assert payload.nbytes == 4 * 16 * 64 * 4 + 16 * 8 * 2


@pytest.mark.parametrize(
    "tensors,match",
    [
        ({"model.layers.0.mlp.experts.w13_weight": torch.ones(4, 64, 16)}, "rank 1.*not a parameter"),
        ({"model.layers.0.self_attn.o_proj.weight": torch.ones(16, 9)}, "rank 1.*o_proj"),
        ({"model.layers.0.mlp.experts.w2_weight": torch.ones(4, 16, 80)}, "rank 1.*w2_weight"),
        ({}, "no tensors for engine rank 1"),
    ],
)
def test_bad_tensors_are_refused_before_anything_is_shared(tensors, match, monkeypatch):
    shared = []
    monkeypatch.setattr(handles, "share", lambda t: shared.append(t) or b"")
    with pytest.raises(ValueError, match=match):
        handles.prepare_rank_payload(1, tensors, PARAMS)
    assert shared == []
