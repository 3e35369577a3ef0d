"""Save and load a policy through megatron-core dist checkpointing, atomically.

A checkpoint is a directory in megatron-core's ``torch_dist`` format holding the model (and,
optionally, the distributed optimizer's state in the layout-independent ``fully_reshardable``
form and the learning-rate schedule), plus ``hybridflow.json`` naming the layout it was saved
under. It is written into ``<dir>.tmp`` and renamed once every rank has finished, so a crash
never leaves a directory that looks complete; a loader only accepts directories with
``hybridflow.json``.

Any layout loads any checkpoint's weights (megatron reshards on load), and optimizer state
moves between layouts too, with and without expert parallelism: ``model.mark_expert_params``
puts routed experts in their own optimizer in every layout, so the dense + expert optimizer
chain has the same structure everywhere.

Saving is synchronous, so megatron's writer gets an in-process results queue
(``_in_process_results_queue``) instead of the spawn-context ``Manager`` process it would
start on each rank's first save, which re-imports the rank's main module (torch, megatron-core:
about 10 s of CPU per rank, per run).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from hfschema.files import publish_directory, write_atomic
from hfschema.lora import LoRAConfig
from hfschema.model_source import CHECKPOINT_META

from .lora import is_adapter
from .policy import MegatronPolicy

logger = logging.getLogger(__name__)

META_FILE = CHECKPOINT_META
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(policy: MegatronPolicy) -> dict:
    state = {}
    for index, chunk in enumerate(policy.chunks):
        module = getattr(chunk, "module", chunk)
        key = "model" if len(policy.chunks) == 1 else f"model{index}"
        state[key] = module.sharded_state_dict()
    return state


def _sharded_state(policy: MegatronPolicy, *, with_optimizer: bool, is_loading: bool) -> dict:
    state = _model_state(policy)
    if with_optimizer:
        if policy.optimizer is None:
            raise ValueError("with_optimizer=True needs a trainable policy")
        state["optimizer"] = policy.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    return state


def _meta(policy: MegatronPolicy, *, with_optimizer: bool, step: int) -> dict:
    return {
        "format": "megatron-core torch_dist",
        "layout": dataclasses.asdict(policy.layout),
        "expert_parallel": policy.layout.ep > 1,
        "with_optimizer": with_optimizer,
        "step": step,
        "lora": dataclasses.asdict(policy.lora) if policy.lora is not None else None,
        "scheduler": policy.scheduler.state_dict() if with_optimizer and policy.scheduler else None,
    }


def save(policy: MegatronPolicy, directory: str | os.PathLike, *, with_optimizer: bool = False, step: int = 0) -> Path:
    """Write ``policy`` to ``directory`` (collective: every rank of the job calls it)."""
    final = Path(directory)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    if with_optimizer:
        # Adam's state exists only after its first step; make it (zeros) so it is saved.
        _ensure_optimizer_state(policy)
    _in_process_results_queue()
    dist_checkpointing.save(_sharded_state(policy, with_optimizer=with_optimizer, is_loading=False), str(staging))
    dist.barrier()
    if rank == 0:
        write_atomic(staging / META_FILE, json.dumps(_meta(policy, with_optimizer=with_optimizer, step=step), indent=2))
        publish_directory(staging, final)
    dist.barrier()
    logger.info("saved checkpoint %s (optimizer=%s)", final, with_optimizer)
    return final


def _in_process_results_queue() -> None:
    """Give megatron's file writer a plain queue for its results, once a process.

    megatron-core 0.16.1 makes its results queue with ``mp.get_context("spawn").Manager()``
    (``filesystem_async._get_write_results_queue``), a server process that outlives the save,
    because an *asynchronous* save writes from another process. ``dist_checkpointing.save``
    without ``async_sharded_save`` writes in this process (``AsyncRequest.execute_sync``): the
    results are put and read here (``put`` then ``get_nowait``), which a ``queue.Queue`` serves."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def read_meta(directory: str | os.PathLike) -> dict:
    """The ``hybridflow.json`` of a complete checkpoint; ValueError names what is wrong."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory not found: {path}")
    meta = path / META_FILE
    if not meta.is_file():
        raise ValueError(f"{path} is not a complete hybridflow checkpoint: {META_FILE} is missing")
    return json.loads(meta.read_text())


def stored_lora(directory: str | os.PathLike) -> LoRAConfig | None:
    """The LoRA settings a checkpoint was trained with, None for one without adapters."""
    path = Path(directory)
    stored = read_meta(path).get("lora")
    if not stored:
        return None
    if isinstance(stored, dict):
        return LoRAConfig(**stored)
    # written before the settings were stored (``"lora": true``): the run's config beside it has them
    config = path.parent / "config.yaml"
    if not config.is_file():
        raise ValueError(
            f"{path / META_FILE} does not record the LoRA settings and {config} is missing; "
            "copy the run's config.yaml there"
        )
    return LoRAConfig(**yaml.safe_load(config.read_text())["lora"])


def load(
    policy: MegatronPolicy, directory: str | os.PathLike, *, with_optimizer: bool = False, base_of_lora: bool = False
) -> dict:
    """Load a checkpoint saved under any layout into ``policy``; returns its metadata. A policy
    with LoRA adapters loads a checkpoint without them as its base (fresh adapters, B = 0); a
    LoRA checkpoint loads into a policy without adapters only with ``base_of_lora`` (its frozen
    base weights, without what the adapters learned)."""
    meta = read_meta(directory)
    if meta.get("lora") and policy.lora is None and not base_of_lora:
        raise ValueError(
            f"{directory} holds LoRA adapters and this policy has none: loading it would drop what "
            "they learned; build the policy with its lora config (or pass base_of_lora=True for "
            "the frozen base alone)"
        )
    if with_optimizer:
        _require_optimizer_state(meta, directory)
        _ensure_optimizer_state(policy)
    state = _sharded_state(policy, with_optimizer=with_optimizer, is_loading=True)
    base_only = policy.lora is not None and not meta.get("lora")
    if base_only:  # a full model (the SFT warm-up) under fresh adapters: B = 0, the model as saved
        if with_optimizer:
            raise ValueError(
                f"{directory} was saved without LoRA adapters: its optimizer state is the full "
                "model's; load its weights only (with_optimizer=False)"
            )
        state = {k: {n: t for n, t in v.items() if not is_adapter(n)} for k, v in state.items()}
    loaded = dist_checkpointing.load(state, str(directory))
    for index, chunk in enumerate(policy.chunks):
        module = getattr(chunk, "module", chunk)
        key = "model" if len(policy.chunks) == 1 else f"model{index}"
        result = module.load_state_dict(loaded[key], strict=not base_only)
        if base_only and (result.unexpected_keys or not all(map(is_adapter, result.missing_keys))):
            raise ValueError(f"{directory} does not match this model beyond its adapters: {result}")
    if with_optimizer:
        policy.optimizer.load_state_dict(loaded["optimizer"])
        if meta.get("scheduler") and policy.scheduler is not None:
            policy.scheduler.load_state_dict(meta["scheduler"])
    elif policy.optimizer is not None:
        # weights only into a trainable policy: a mixed-precision optimizer's fp32 main params
        # still hold the initialisation, and its first step would write them back
        policy.optimizer.reload_model_params()
    dist.barrier()
    return meta


def _require_optimizer_state(meta: dict, directory) -> None:
    if not meta.get("with_optimizer"):
        raise ValueError(f"{directory} holds no optimizer state (saved with with_optimizer=False)")


def _ensure_optimizer_state(policy: MegatronPolicy) -> None:
    """Create Adam's exp_avg / exp_avg_sq / step entries (zeros) where they do not exist yet."""
    for opt in _leaf_optimizers(policy.optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if "exp_avg" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _leaf_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
