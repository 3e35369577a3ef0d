"""torchrun worker for the critic equivalence tests: a critic started from the actor's checkpoint.

Run as ``torchrun --standalone --nproc-per-node N critic_worker.py TASKS.json`` (``task_pool``).
Each ``critic`` task builds the actor under one layout, saves its initial weights (one process)
or loads the ones saved (other layouts), starts a critic from them the way the runtime does
(``hybridflow.runtime.worker._copy_weights``: the actor's transformer under a fresh value head),
records the fresh value head (its draws depend on the pipeline layout, not on TP), sets it to
fixed values and records the values, one value-loss step (loss, grad norm) and the values after
it; then (tied cases) it saves the critic with its optimizer state and resumes a fresh one from
that, and (other layouts) loads the one-process critic's checkpoint. ``sequence_parallel=False``
builds TP without sequence parallelism, which megatron-core allows for dense models though the
project's layouts always turn it on with TP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from families import tiny  # noqa: E402
from task_pool import run_tasks  # noqa: E402
from worker import SEED, TRAIN, batch, layout_for  # noqa: E402

from hfschema.layout import ParallelLayout  # noqa: E402
from hybridflow.runtime.trainers import trainer  # noqa: E402
from hybridflow.runtime.worker import _copy_weights  # noqa: E402
from megatron_adapters import checkpoint, parallel  # noqa: E402
from megatron_adapters import model as model_builder  # noqa: E402
from megatron_adapters.critic import MegatronCritic  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402


def _data(vocab: int) -> dict[str, torch.Tensor]:
    data = batch(vocab)
    data["returns"] = torch.randn(data["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    return data


def _value_loss(values, _unused, micro):
    mask = micro["loss_mask"]
    return ((values - micro["returns"]) ** 2 * mask).sum(), mask.sum(), {}


def _set_head(critic: MegatronCritic) -> list[torch.Tensor]:
    """Fixed value-head weights ([1, H] on every TP rank); returns copies of the fresh ones."""
    fresh = []
    for chunk in critic.chunks:
        if chunk.module.post_process:
            head = chunk.module.output_layer.weight
            fresh.append(head.detach().clone().cpu())
            g = torch.Generator().manual_seed(5)
            head.data.copy_(0.1 * torch.randn(head.shape, generator=g))
    critic.optimizer.reload_model_params()
    return fresh


@contextlib.contextmanager
def _without_sequence_parallel(off: bool):
    """Models built inside have TP without sequence parallelism (``off``)."""
    original = model_builder.transformer_config

    def config(*args, **kwargs):
        built = original(*args, **kwargs)
        built.sequence_parallel = False
        return built

    model_builder.transformer_config = config if off else original
    try:
        yield
    finally:
        model_builder.transformer_config = original


def critic(
    family: str, spec: dict, init_dir: str, tie: bool, save: bool, resume: bool, sequence_parallel: bool = True
) -> dict:
    with _without_sequence_parallel(not sequence_parallel):
        return _critic(family, spec, init_dir, tie, save, resume)


def _critic(family: str, spec: dict, init_dir: str, tie: bool, save: bool, resume: bool) -> dict:
    """Values, a value-loss step and the values after it, of a critic started from the actor;
    with ``resume``, also a save and a resume of the critic (``_resumed``) and, under a layout
    other than one process, the one-process critic's checkpoint loaded (``_from_reference``)."""
    model = dataclasses.replace(tiny(family), tie_word_embeddings=tie)
    layout = layout_for(spec)
    layout.check_model(model)
    pg = parallel.initialize(layout, seed=SEED)
    actor = MegatronPolicy(model, layout, TRAIN, pg_collection=pg)
    if save:
        checkpoint.save(actor, init_dir)
    else:
        checkpoint.load(actor, init_dir)
    value_model = MegatronCritic(model, layout, TRAIN, pg_collection=pg)
    skipped = _copy_weights(trainer("megatron"), actor, value_model)
    fresh = _set_head(value_model)
    data = _data(model.vocab_size)
    values = value_model.forward_values(data)
    result = value_model.train_step(data, _value_loss)
    after = value_model.forward_values(data)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"skipped": skipped, "fresh_head": fresh})
    out = {
        "values": values,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "applied": result.applied,
        "after": after,
        "ranks": per_rank,
    }
    if not resume:
        return out
    if not save:
        out.update(_from_reference(model, layout, pg, data, init_dir))
    return {**out, **_resumed(value_model, model, layout, pg, data, init_dir)}


def _save_dir(init_dir: str, layout: ParallelLayout) -> str:
    """Where a critic trained under ``layout`` saves itself (the one process's: ``ParallelLayout()``)."""
    return f"{init_dir}_critic_tp{layout.tp}_pp{layout.pp}_vpp{layout.vpp}_ep{layout.ep}"


def _from_reference(model, layout, pg, data, init_dir: str) -> dict:
    """The one-process critic's checkpoint (after its step, with optimizer state) under this
    layout: its values and the next step's loss."""
    loaded = MegatronCritic(model, layout, TRAIN, pg_collection=pg)
    checkpoint.load(loaded, _save_dir(init_dir, ParallelLayout()), with_optimizer=True)
    return {
        "reference_values": loaded.forward_values(data),
        "reference_next_loss": loaded.train_step(data, _value_loss).loss,
    }


def _resumed(value_model: MegatronCritic, model, layout, pg, data, init_dir: str) -> dict:
    """Save the critic with its optimizer state, resume a fresh one from it: its values and the
    next step's loss, beside the original's next step."""
    save_dir = _save_dir(init_dir, layout)
    checkpoint.save(value_model, save_dir, with_optimizer=True, step=1)
    resumed = MegatronCritic(model, layout, TRAIN, pg_collection=pg)
    checkpoint.load(resumed, save_dir, with_optimizer=True)
    values = resumed.forward_values(data)
    return {
        "resumed_values": values,
        "resumed_next_loss": resumed.train_step(data, _value_loss).loss,
        "next_loss": value_model.train_step(data, _value_loss).loss,
    }


if __name__ == "__main__":
    run_tasks(lambda task: {"critic": critic}[task.pop("kind")](**task))
