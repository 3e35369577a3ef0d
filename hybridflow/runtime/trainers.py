"""The trainer backends the runtime runs, by the name a role's ``backend`` setting gives, and what
the runtime calls on one (``TrainerBackend``). The runtime reaches a trainer only through here: a
second trainer is a package of its own and a line in ``TRAINERS``, not branches in the stages.

A backend is a module (imported when first asked for: a process that never trains does not import
megatron-core) with the functions of ``TrainerBackend``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from hybridflow.config import HybridflowConfig

__all__ = ["TRAINERS", "TrainerBackend", "trainer", "trainer_of"]

TRAINERS = {"megatron": "megatron_adapters.backend", "fsdp2": "fsdp_adapters.backend"}
"""Name -> the module of a backend ``hybridflow train`` runs."""


class TrainerBackend(Protocol):
    """What the runtime calls on a trainer backend (``megatron_adapters/backend.py``,
    ``fsdp_adapters/backend.py``). ``model_dir``: the model's directory (config.json, tokenizer),
    which FSDP2 builds transformers' class from; megatron builds from the ``ModelConfig`` (``cfg.model``,
    ``architecture``) that describes it."""

    def device(self) -> torch.device: ...
    def init_default_group(self, timeout_minutes: int = 10, **joined: Any) -> None: ...
    def initialize(self, layout, *, seed: int, prefix: str) -> Any: ...
    def teardown(self) -> None: ...
    def data_coords(self) -> tuple[int, int, bool]: ...
    def build_policy(self, cfg, train, pg, *, model_dir: Path, trainable: bool = True, moe=None, lora=None) -> Any: ...
    def build_critic(self, cfg, pg, *, model_dir: Path) -> Any: ...
    def build_frozen(self, architecture, cfg, layout, pg, *, model_dir: Path, scores: bool = False) -> Any: ...
    def build_reward_model(self, architecture, cfg, train, pg) -> Any: ...
    def load_score_body(self, model, source) -> None: ...
    def layout_groups(self, layout, *, prefix: str) -> Any: ...
    def load_reward_model(self, model, source) -> None: ...
    def save(self, role, directory: str | os.PathLike, *, with_optimizer: bool, step: int) -> Path: ...
    def load(self, role, directory: str | os.PathLike, *, with_optimizer: bool = False) -> dict: ...
    def load_pretrained(self, role, source) -> None: ...
    def export_hf(self, checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config=None) -> int: ...
    def named_parameters(self, role, *, merge_adapters: bool = True) -> dict[str, torch.Tensor]: ...
    def copy_weights(self, source, target) -> list[str]: ...
    def adapter_push(self, role) -> tuple[dict[str, torch.Tensor], dict]: ...


def trainer(name: str) -> TrainerBackend:
    """The backend registered as ``name``; ValueError lists the ones that run."""
    if name not in TRAINERS:
        raise ValueError(f"unknown trainer backend {name!r}; hybridflow train runs: {', '.join(TRAINERS)}")
    module: ModuleType = importlib.import_module(TRAINERS[name])
    return module  # type: ignore[return-value]  # a module with the Protocol's functions


def trainer_of(cfg: HybridflowConfig, role: str = "actor") -> TrainerBackend:
    """The backend of ``role``: its own ``backend`` setting, else the actor's."""
    return trainer(getattr(cfg, role).backend or cfg.actor.backend)
