"""torchrun worker for the converter tests: converted checkpoints loaded into megatron-core.

Run as ``torchrun --standalone --nproc-per-node N convert_worker.py TASKS.json``. Each task names
a family, a layout (``spec``; dp fills the world), a converted checkpoint (``mcore_dir``) and a
directory to save the loaded policy to again (``resave_dir``, written by megatron-core itself).
Rank 0 writes ``{"logp": [B, T]}`` (the policy's log-probs on ``batch()``) to the task's
``out``; an exception is recorded there instead, so one failing family does not hide the others.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from hfschema.hf_config import read_model_config  # noqa: E402
from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from megatron_adapters import checkpoint, parallel  # noqa: E402
from megatron_adapters.export import global_named_parameters  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
from megatron_adapters.pretrained import load_hf_weights  # noqa: E402
from reshard.megatron import megatron_layout  # noqa: E402
from task_pool import run_tasks  # noqa: E402

SEED = 1234


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 sequences of 16 tokens (the same in the test, for transformers)."""
    g = torch.Generator().manual_seed(7)
    return {"input_ids": torch.randint(0, vocab, (4, 16), generator=g)}


def layout_for(spec: dict) -> ParallelLayout:
    fields = dict(spec)
    fields["dp"] = dist.get_world_size() // (fields.get("tp", 1) * fields.get("pp", 1))
    return ParallelLayout(**fields)


def load_and_score(hf_dir: str, spec: dict, mcore_dir: str, resave_dir: str) -> dict:
    model = read_model_config(hf_dir)
    layout = layout_for(spec)
    pg = parallel.initialize(layout, seed=SEED)
    policy = MegatronPolicy(
        model, layout, TrainConfig(micro_batch_size=1, global_batch_size=4), pg_collection=pg, trainable=False
    )
    checkpoint.load(policy, mcore_dir)
    logp, _ = policy.forward_logprobs(batch(model.vocab_size))
    checkpoint.save(policy, resave_dir)
    direct = MegatronPolicy(
        model,
        layout,
        TrainConfig(micro_batch_size=1, global_batch_size=4),
        pg_collection=pg,
        trainable=False,
        initialize=False,
    )  # as a run builds it
    report = load_hf_weights(direct, hf_dir, buffer_bytes=4096)  # small blocks: many reads per tensor
    direct_logp, _ = direct.forward_logprobs(batch(model.vocab_size))
    differs, shares = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(differs, _differing(policy, direct, model))
    dist.all_gather_object(shares, report.share_bytes)
    return {
        "logp": logp,
        "direct_logp": direct_logp,
        "direct_differs": sorted({n for d in differs for n in d}),
        "direct_share_bytes": shares,
    }


def _differing(converted: MegatronPolicy, direct: MegatronPolicy, model) -> list[str]:
    """Parameter boxes of this rank (those HF tensors map to: vocabulary padding aside) that
    differ between the two loads."""
    ours, theirs = global_named_parameters(converted), global_named_parameters(direct)
    held = megatron_layout(model, converted.layout, dtype="float32").holdings(dist.get_rank()).holdings
    differing = set()
    for h in held:
        box = tuple(slice(a, b) for a, b in h.param_region)
        if not torch.equal(ours[h.param][box], theirs[h.param][box]):
            differing.add(h.param)
    return sorted(differing)


def main() -> None:
    run_tasks(lambda task: load_and_score(**task))


if __name__ == "__main__":
    main()
