"""torchrun worker (2 processes, EP=2): the policy's safety switches.

``nan``: a loss that is NaN is not applied (every parameter bit-identical afterwards, the step
reported ``applied=False``), and the next finite step is. ``offload``: freeing the gradient
buffers and optimizer state between steps (what colocated generation does) leaves training
bit-identical to a policy that never offloaded, and the buffers really hold no storage while
offloaded. ``rollback``: two updates, then ``rollback`` to the snapshot taken before them:
weights, optimizer moments and learning rate are back, and training on from there is
bit-identical to a policy that never made those updates (what ``run.on_nan=skip`` relies on
to make a step of several updates all or nothing). Prints one ``OK <scenario>`` line per rank.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_adapters  # noqa: E402,F401
from families import tiny  # noqa: E402
from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from megatron_adapters import parallel  # noqa: E402
from megatron_adapters.export import global_named_parameters  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402

LAYOUT = ParallelLayout(ep=2, dp=2)


def _policy(pg) -> MegatronPolicy:
    torch.manual_seed(5)
    return MegatronPolicy(
        tiny("qwen3_moe"), LAYOUT, TrainConfig(micro_batch_size=2, global_batch_size=4, lr=1e-2), pg_collection=pg
    )


def _batch(step: int) -> dict:
    ids = torch.randint(0, 250, (4, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "loss_mask": torch.ones(4, 8)}


def _loss(logp, entropy, micro):
    return -(logp * micro["loss_mask"]).sum(), micro["loss_mask"].sum(), {}


def _nan_loss(logp, entropy, micro):
    loss, tokens, metrics = _loss(logp, entropy, micro)
    return loss * float("nan"), tokens, metrics


def _snapshot(policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in global_named_parameters(policy).items()}


def nan(pg) -> None:
    policy = _policy(pg)
    before = _snapshot(policy)
    result = policy.train_step(_batch(0), _nan_loss)
    assert not result.applied
    after = _snapshot(policy)
    assert all(torch.equal(before[k], after[k]) for k in before), "a NaN step changed the weights"
    assert policy.train_step(_batch(1), _loss).applied
    changed = _snapshot(policy)
    assert any(not torch.equal(before[k], changed[k]) for k in before)


def offload(pg) -> None:
    plain, switched = _policy(pg), _policy(pg)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(plain).values(), _snapshot(switched).values()))
    for step in range(3):
        plain.train_step(_batch(step), _loss)
        switched.offload_training_state()
        buffers = [b for c in switched.chunks for b in c.buffers + c.expert_parallel_buffers]
        assert all(b.grad_data.untyped_storage().size() == 0 for b in buffers)
        switched.restore_training_state()
        switched.train_step(_batch(step), _loss)
    a, b = _snapshot(plain), _snapshot(switched)
    assert all(torch.equal(a[k], b[k]) for k in a), "offloading changed training"


def rollback(pg) -> None:
    plain, undone = _policy(pg), _policy(pg)
    for policy in (plain, undone):
        policy.train_step(_batch(0), _loss)  # moments and a scheduler step exist before the snapshot
    snap = undone.snapshot()
    before = _snapshot(undone)
    undone.train_step(_batch(7), _loss)
    undone.train_step(_batch(8), _loss)
    assert any(not torch.equal(before[k], v) for k, v in _snapshot(undone).items())
    undone.rollback(snap)
    assert all(torch.equal(before[k], v) for k, v in _snapshot(undone).items()), "rollback left other weights"
    for step in (1, 2):
        a, b = plain.train_step(_batch(step), _loss), undone.train_step(_batch(step), _loss)
        assert a.lr == b.lr and a.grad_norm == b.grad_norm, (a, b)
    a, b = _snapshot(plain), _snapshot(undone)
    assert all(torch.equal(a[k], b[k]) for k in a), "training after a rollback differs"


if __name__ == "__main__":
    parallel.init_default_group()
    group = parallel.initialize(LAYOUT, seed=1)
    for name in sys.argv[1:]:
        {"nan": nan, "offload": offload, "rollback": rollback}[name](group)
        os.write(1, f"OK {name} rank {dist.get_rank()}\n".encode())
    parallel.teardown()
    dist.destroy_process_group()
