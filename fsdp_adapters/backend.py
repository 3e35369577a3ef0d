"""The FSDP2 trainer backend: what the runtime calls (``hybridflow.runtime.trainers.TrainerBackend``)
for ``actor.backend: fsdp2``: transformers' own model class for the run's model directory,
sharded over the data-parallel ranks, with megatron's optimizer semantics.

What it does not train yet is refused here by name, and before any rank starts by
``hybridflow.preflight`` (reward models, a distillation teacher, LoRA, frozen models of another
layout).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfschema.layout import ParallelLayout
from hfschema.ranks import device as device  # the backend's own call: the rank's device
from hfschema.ranks import init_default_group
from hfschema.trainer import BACKEND_CALLS

__all__ = list(BACKEND_CALLS)


@dataclasses.dataclass(frozen=True)
class Groups:
    """The process group of an FSDP2 layout: every rank (data x sequence parallel)."""

    dp: Any
    """The ranks a model is sharded over (``torch.distributed.ProcessGroup``); a policy makes its
    sequence-parallel subgroups of it."""


def _refuse(what: str) -> None:
    raise ValueError(f"{what} is not built on actor.backend=fsdp2 yet; use actor.backend=megatron for it")


_sequence_parallel = 1
"""The actor layout's ``cp`` (Ulysses sequence parallel) since ``initialize``: the one global of
this backend, as megatron-core's parallel state is megatron's."""


def initialize(layout: ParallelLayout, *, seed: int, prefix: str) -> Groups:
    """The layout's group (every rank: FSDP2 shards over data x sequence parallel) and the seeded RNGs."""
    global _sequence_parallel
    init_default_group()
    layout.check_world_size(dist.get_world_size(), prefix=prefix)
    if layout.world_size != layout.dp * layout.cp:
        raise ValueError(f"{prefix}: {layout.describe()} splits the model beyond data and sequence parallel")
    torch.manual_seed(seed)
    _sequence_parallel = layout.cp
    return Groups(dp=dist.group.WORLD)


def teardown() -> None:
    """Nothing of the layout's is global but its sequence-parallel size."""
    global _sequence_parallel
    _sequence_parallel = 1


def data_coords() -> tuple[int, int, bool]:
    """(data-parallel rank, size, whether this rank leads its sequence-parallel group, the
    ``cp`` consecutive ranks that hold the same rows)."""
    sp = _sequence_parallel
    return dist.get_rank() // sp, dist.get_world_size() // sp, dist.get_rank() % sp == 0


def _compute_dtype() -> torch.dtype:
    """bf16 compute (fp32 parameters and reductions) on GPUs; fp32 on the CPU."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def build_policy(cfg, train, pg: Groups, *, model_dir: Path, trainable: bool = True, moe=None, lora=None):
    """``model_dir``'s transformers model, sharded over ``pg``: seeded random weights for a random
    model, else left for the loader (``load_pretrained``, a checkpoint) that follows."""
    from .policy import FSDP2Policy

    if lora is not None and lora.enabled:
        _refuse("lora.enabled=true")
    return FSDP2Policy(
        model_dir,
        train,
        group=pg.dp,
        trainable=trainable,
        compute_dtype=_compute_dtype(),
        offload=cfg.fsdp2.offload,
        activation_checkpointing=cfg.fsdp2.activation_checkpointing and trainable,
        init="empty" if cfg.model.pretrained else "random",
        seed=cfg.run.seed,
        layout=cfg.actor.parallel,
        sp=cfg.actor.parallel.cp,
        packing=cfg.packing,
    )


def build_frozen(architecture, cfg, layout: ParallelLayout, pg: Groups, *, model_dir: Path, scores: bool = False):
    """A frozen policy (the reference) of ``model_dir``, its weights left for the loader."""
    from .policy import FSDP2Policy

    if scores:
        _refuse("a reward model (reward_model.path)")
    return FSDP2Policy(
        model_dir,
        cfg.train,
        group=pg.dp,
        trainable=False,
        compute_dtype=_compute_dtype(),
        offload=cfg.fsdp2.offload,
        init="empty",
        layout=layout,
        sp=layout.cp,
        packing=cfg.packing,
    )


def build_critic(cfg, pg: Groups, *, model_dir: Path):
    """PPO's critic: ``model_dir``'s decoder under a value head, sharded as the actor; its
    transformer is copied from the actor next (``copy_weights``)."""
    from .policy import FSDP2Critic

    return FSDP2Critic(
        model_dir,
        cfg.train.for_critic(),
        group=pg.dp,
        compute_dtype=_compute_dtype(),
        offload=cfg.fsdp2.offload,
        activation_checkpointing=cfg.fsdp2.activation_checkpointing,
        seed=cfg.run.seed,
        layout=cfg.actor.parallel,
        sp=cfg.actor.parallel.cp,
        packing=cfg.packing,
    )


def build_reward_model(architecture, cfg, train, pg):
    _refuse("reward-model training (run.mode=rm)")


def load_score_body(model, source) -> None:
    _refuse("reward-model training (run.mode=rm)")


def load_reward_model(model, source) -> None:
    _refuse("a reward model (reward_model.path)")


def layout_groups(layout: ParallelLayout, *, prefix: str):
    _refuse(f"{prefix} other than actor.parallel")


def adapter_push(role) -> tuple[dict[str, torch.Tensor], dict]:
    _refuse("lora.push=adapter")
    raise AssertionError  # unreachable: _refuse raised


def save(role, directory: str | os.PathLike, *, with_optimizer: bool, step: int) -> Path:
    from . import checkpoint

    return checkpoint.save(role, directory, with_optimizer=with_optimizer, step=step)


def load(role, directory: str | os.PathLike, *, with_optimizer: bool = False) -> dict:
    """A checkpoint ``save`` wrote, under any data-parallel size."""
    from . import checkpoint

    return checkpoint.load(role, directory, with_optimizer=with_optimizer)


def load_pretrained(role, source) -> None:
    """A Hugging Face directory's weights (``hfschema.model_source.ModelSource``), each rank its rows."""
    from .model import load_hf_weights

    if source.kind != "hf":
        _refuse(f"starting from a {source.kind} checkpoint ({source.weights})")
    load_hf_weights(role.model, source.weights, role.group)


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config=None) -> int:
    """The model ``save`` wrote in ``checkpoint_dir`` as a Hugging Face directory; returns its bytes."""
    from .export import export_checkpoint

    return export_checkpoint(checkpoint_dir, out_dir, hf_config=hf_config)


def named_parameters(role, *, merge_adapters: bool = True) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter under its Hugging Face name (``reshard.fsdp.fsdp_layout``
    says which rows: the weight sync's source)."""
    return {name: param.to_local().detach() for name, param in role.model.named_parameters()}


def copy_weights(source, target) -> list[str]:
    """Every parameter ``target`` shares with ``source`` (same name and shape: the same shards of
    it, both over the same ranks) copied in; returns the names of ``target``'s left as they were
    (a critic's ``output_layer.``). The fp32 parameters are the optimizer's own: nothing to reload."""
    from hfschema.trainer import copy_matching

    return copy_matching(named_parameters(target), named_parameters(source))
