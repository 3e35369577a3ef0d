"""The megatron-core trainer backend: what the runtime calls to set up the actor's layout, build its
trainer roles, save, load and export them, and read their weights for the engines
(``hybridflow.runtime.trainers.TrainerBackend`` is the contract; ``actor.backend: megatron``).

Importing it imports megatron-core (``parallel``: every rank sets up its groups; a rank's main
imports the backend before it freezes its imports' objects). Each other call imports what it needs
when called: a rank that never converts or pushes adapters does not pay for those modules' imports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hfschema.layout import ParallelLayout
from hfschema.trainer import BACKEND_CALLS
from megatron_adapters import parallel

__all__ = list(BACKEND_CALLS)


def device() -> torch.device:
    return parallel.device()


def init_default_group(timeout_minutes: int = 10, **joined: Any) -> None:
    parallel.init_default_group(timeout_minutes, **joined)


def initialize(layout: ParallelLayout, *, seed: int, prefix: str):
    """The layout's process groups (megatron-core's ``ProcessGroupCollection``) and the seeded RNGs."""
    return parallel.initialize(layout, seed=seed, prefix=prefix)


def teardown() -> None:
    """The layout's process groups go (the default group stays)."""
    parallel.teardown()


def data_coords() -> tuple[int, int, bool]:
    return parallel.data_coords()


def build_policy(cfg, train, pg, *, model_dir: Path, trainable: bool = True, moe=None, lora=None):
    """A megatron-core policy of ``cfg.model`` (which ``model_dir`` describes) under the actor's
    layout (``moe``: the RL actor's routing replay, router statistics and router settings; ``lora``:
    its adapters). A pretrained model's policy is not randomly initialised: its weights are loaded next."""
    from megatron_adapters.policy import MegatronPolicy

    return MegatronPolicy(
        cfg.model,
        cfg.actor.parallel,
        train,
        pg_collection=pg,
        trainable=trainable,
        moe=moe,
        lora=lora,
        packing_config=cfg.packing,
        initialize=not cfg.model.pretrained,
    )


def build_critic(cfg, pg, *, model_dir: Path):
    """PPO's critic: the actor's transformer under a one-column value head, on the actor's layout."""
    from megatron_adapters.critic import MegatronCritic

    return MegatronCritic(
        cfg.model, cfg.actor.parallel, cfg.train.for_critic(), pg_collection=pg, packing_config=cfg.packing
    )


def build_frozen(architecture, cfg, layout: ParallelLayout, pg, *, model_dir: Path, scores: bool = False):
    """A frozen model of ``architecture`` (``model_dir``'s) under ``layout`` and its groups ``pg``, without gradients
    or optimizer, its weights left for the loader: a policy (reference, teacher), or with ``scores``
    a reward model (a one-label score head)."""
    from megatron_adapters.policy import MegatronPolicy
    from megatron_adapters.reward_model import MegatronRewardModel

    kind = MegatronRewardModel if scores else MegatronPolicy
    return kind(
        architecture, layout, cfg.train, pg_collection=pg, trainable=False, packing_config=cfg.packing, initialize=False
    )


def build_reward_model(architecture, cfg, train, pg):
    """A trainable reward model (the actor's layout, a one-label score head): ``run.mode=rm``."""
    from megatron_adapters.reward_model import MegatronRewardModel

    return MegatronRewardModel(architecture, cfg.actor.parallel, train, pg_collection=pg, packing_config=cfg.packing)


def load_score_body(model, source) -> None:
    """A causal LM directory's weights into a reward model, its fresh score head kept."""
    from megatron_adapters.pretrained import load_hf_weights

    load_hf_weights(model, source.weights, skip=("score.weight",))
    model.optimizer.reload_model_params()  # the optimizer's fp32 main copies follow


def layout_groups(layout: ParallelLayout, *, prefix: str):
    """Process groups of another layout over the same ranks (a frozen model's own layout)."""
    return parallel.layout_groups(layout, prefix=prefix)


def load_reward_model(model, source) -> None:
    """A sequence-classification directory's weights into ``build_frozen(scores=True)``'s model."""
    from megatron_adapters.reward_model import load_reward_model as load_scores

    load_scores(model, source)


def save(role, directory: str | os.PathLike, *, with_optimizer: bool, step: int) -> Path:
    from megatron_adapters import checkpoint

    return checkpoint.save(role, directory, with_optimizer=with_optimizer, step=step)


def load(role, directory: str | os.PathLike, *, with_optimizer: bool = False) -> dict:
    """A checkpoint ``save`` wrote, under any layout."""
    from megatron_adapters import checkpoint

    return checkpoint.load(role, directory, with_optimizer=with_optimizer)


def load_pretrained(role, source) -> None:
    """A Hugging Face directory's weights (``hfschema.model_source.ModelSource``), each rank its slices."""
    from megatron_adapters.pretrained import load_pretrained as load_slices

    load_slices(role, source)


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config=None) -> int:
    """The model ``save`` wrote in ``checkpoint_dir`` as a Hugging Face directory (``hf_config``: a
    directory with the config.json to write instead of the checkpoint's); returns its bytes."""
    from megatron_adapters.convert import mcore_to_hf

    return mcore_to_hf(checkpoint_dir, out_dir, hf_config=hf_config).nbytes


def named_parameters(role, *, merge_adapters: bool = True) -> dict[str, torch.Tensor]:
    """This rank's parameters under their global megatron-core names (the weight sync's source)."""
    from megatron_adapters.export import global_named_parameters

    return global_named_parameters(role, merge_adapters=merge_adapters)


def copy_weights(source, target) -> list[str]:
    """Every parameter ``target`` shares with ``source`` (same name and shape) copied in; returns
    the names of ``target``'s left as they were (a critic's ``output_layer.``)."""
    from hfschema.trainer import copy_matching

    skipped = copy_matching(named_parameters(target), named_parameters(source))
    if target.optimizer is not None:  # main params of a mixed-precision optimizer follow the copy
        target.optimizer.reload_model_params()
    return skipped


def adapter_push(role) -> tuple[dict[str, torch.Tensor], dict]:
    """The LoRA adapters as the engines load them (tensors, PEFT config)."""
    from megatron_adapters.peft_io import adapter_push as push

    return push(role)
