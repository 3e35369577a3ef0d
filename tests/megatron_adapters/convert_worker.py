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
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
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
    policy = MegatronPolicy(model, layout, TrainConfig(micro_batch_size=1, global_batch_size=4),
                            pg_collection=pg, trainable=False)
    checkpoint.load(policy, mcore_dir)
    logp, _ = policy.forward_logprobs(batch(model.vocab_size))
    checkpoint.save(policy, resave_dir)
    return {"logp": logp}


def main() -> None:
    run_tasks(lambda task: load_and_score(**task))


if __name__ == "__main__":
    main()
