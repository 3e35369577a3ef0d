"""A plain megatron-core training loop: the baseline the GPU check measures ``MegatronPolicy`` by.

Written the way a user of megatron-core alone writes it (the shape of Megatron-LM's
``pretrain_gpt``): the same ``GPTModel`` chunks, megatron-core's DDP, ``get_megatron_optimizer``
and ``forward_backward_func``, and the loss from the model's own vocab-parallel cross entropy
(``labels=``), without the policy's per-token log-prob / entropy bookkeeping, metric reductions
or finite-gradient check. ``scripts/gpu_check.py`` runs both on the same batches in one process;
the ratio of their step times is the policy's overhead.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Iterable, Mapping

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hfschema.train import TrainConfig

from .model import build_model_chunks
from .policy import _optimizer_config

__all__ = ["PlainTrainer"]


def synchronize() -> None:
    """Wait for the device (step timings must include the kernels, not only their launch)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _loss(mask_BS: torch.Tensor, loss_BS: torch.Tensor):
    loss = (loss_BS.float() * mask_BS).sum()
    tokens = mask_BS.sum()
    return loss, tokens.int(), {"lm loss": torch.stack([loss.detach(), tokens])}


class PlainTrainer:
    """One model (pp=1, one chunk) with DDP and megatron's optimizer; ``step`` trains one batch."""

    def __init__(
        self,
        model: ModelConfig,
        layout: ParallelLayout,
        train: TrainConfig,
        *,
        pg_collection: ProcessGroupCollection,
        params_dtype: torch.dtype,
    ) -> None:
        if layout.pp != 1:
            raise ValueError("the plain loop baseline runs pp=1 (one model chunk)")
        self.train = train
        chunk = build_model_chunks(model, layout, params_dtype=params_dtype, pg_collection=pg_collection)[0]
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=train.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(
            config=chunk.config, ddp_config=ddp, module=chunk, pg_collection=pg_collection
        )
        self.optimizer = get_megatron_optimizer(
            _optimizer_config(train, params_dtype),
            [self.model],
            use_gloo_process_groups=False,
            pg_collection=pg_collection,
        )
        chunk.config.finalize_model_grads_func = finalize_model_grads
        chunk.config.grad_scale_func = self.optimizer.scale_loss
        self.pg = pg_collection
        self.device = next(chunk.parameters()).device

    def _forward_step(self, data_iterator, model):
        micro = next(data_iterator)
        ids_BS = micro["input_ids"]
        positions_BS = torch.arange(ids_BS.shape[1], device=ids_BS.device).expand_as(ids_BS)
        labels_BS = torch.roll(ids_BS, shifts=-1, dims=1)
        mask_BS = torch.roll(micro["loss_mask"], shifts=-1, dims=1)  # position t predicts token t + 1
        mask_BS[:, -1] = 0
        return model(ids_BS, positions_BS, None, labels=labels_BS), partial(_loss, mask_BS)

    def step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """One optimizer step on ``batch``; returns its seconds (device work included)."""
        synchronize()
        started = time.perf_counter()
        on_device = {k: v.to(self.device) for k, v in batch.items()}
        size = self.train.micro_batch_size
        micros = [
            {k: v[i : i + size] for k, v in on_device.items()} for i in range(0, len(on_device["input_ids"]), size)
        ]
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(micros),
            model=self.model,
            num_microbatches=len(micros),
            seq_length=micros[0]["input_ids"].shape[1],
            micro_batch_size=size,
            forward_only=False,
            pg_collection=self.pg,
        )
        self.optimizer.step()
        synchronize()
        return time.perf_counter() - started

    def steps(self, batches: Iterable[Mapping[str, torch.Tensor]]) -> list[float]:
        """``step`` over each batch."""
        return [self.step(batch) for batch in batches]
