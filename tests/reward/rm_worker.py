"""torchrun worker of the reward-model tests: a sequence-classification directory under a layout.

Run as ``torchrun --standalone --nproc-per-node N rm_worker.py TASKS.json`` (``task_pool``). Each
task loads ``rm_dir`` (a transformers ``*ForSequenceClassification`` directory, or a megatron
checkpoint of one) into ``MegatronRewardModel`` under ``spec`` (dp fills the world), scores
``ids`` and, with ``save_dir``, saves the model with megatron-core's dist checkpointing (what
``run.mode=rm`` writes before its export). Rank 0 records ``{"scores": [B]}``.

With ``actor_spec``, megatron's global groups are those of that layout (a run's actor) and the
model is built and run on groups of its own (``parallel.layout_groups``), as a frozen model with
its own layout is; ``kind: teacher`` loads a causal LM the same way and records its log-probs.
"""

from __future__ import annotations

import os
import sys

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "megatron_adapters")))

from task_pool import run_tasks  # noqa: E402
from worker import layout_for  # noqa: E402

from hfschema.hf_config import SIDE_FILE_DIR, read_hf_config  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from megatron_adapters import checkpoint, parallel  # noqa: E402
from hfschema.model_source import reward_model_source, teacher_source  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
from megatron_adapters.pretrained import load_pretrained  # noqa: E402
from megatron_adapters.reward_model import MegatronRewardModel, load_reward_model  # noqa: E402


def _weights(folder, names):
    return [n for n in names if n.endswith(".safetensors") or n.endswith(".index.json")]


def _groups(task: dict):
    """The model's layout and its groups: megatron's global ones, or its own beside an actor's."""
    layout = layout_for(task["spec"])
    if "actor_spec" not in task:
        return layout, parallel.initialize(layout, seed=1234)
    parallel.initialize(layout_for(task["actor_spec"]), seed=1234)
    return layout, parallel.layout_groups(layout)


def score(task: dict) -> dict:
    if task.get("kind") == "teacher":
        return teacher_logprobs(task)
    source, model = reward_model_source(task["rm_dir"])
    layout, pg = _groups(task)
    rm = MegatronRewardModel(
        model, layout, TrainConfig(micro_batch_size=2, global_batch_size=4), pg_collection=pg, trainable=False
    )
    load_reward_model(rm, source)
    ids = torch.tensor(task["ids"])
    pad = read_hf_config(source.files).get("pad_token_id")
    scores = rm.forward_scores({"input_ids": ids}, pad)
    if task.get("save_dir"):  # config and tokenizer beside it, as hf-to-mcore keeps them
        checkpoint.save(rm, task["save_dir"])
        if dist.get_rank() == 0:
            shutil.copytree(source.files, Path(task["save_dir"]) / SIDE_FILE_DIR, ignore=_weights)
        dist.barrier()
    return {"scores": scores}


def teacher_logprobs(task: dict) -> dict:
    source, model = teacher_source(task["rm_dir"], read_hf_config(task["rm_dir"])["vocab_size"])
    layout, pg = _groups(task)
    teacher = MegatronPolicy(
        model, layout, TrainConfig(micro_batch_size=2, global_batch_size=4), pg_collection=pg, trainable=False
    )
    load_pretrained(teacher, source)
    logp, _ = teacher.forward_logprobs({"input_ids": torch.tensor(task["ids"])})
    return {"logprobs": logp}


if __name__ == "__main__":
    run_tasks(score)
