"""A megatron-core policy: score tokens and train on them under any TP / PP / EP / ETP / DP layout.

```
global batch (every rank holds it)            MegatronPolicy
  input_ids [B, T], fields [B, ...]  ──►  this DP rank's rows ──► micro-batches (packing.enabled:
                                              │      one packed row each, ``packing.py``)
                                              │
               forward_backward_func (PP schedule, VPP chunks) ── GPTModel chunks (DDP)
                                              │ last pipeline stage: vocab-parallel logits
                       token log-probs + entropy (no full-vocab gather)
                     ┌────────────────────────┴─────────────────────────┐
             forward_logprobs:                                   train_step:
   broadcast from last stage, gather DP rows          loss_fn(logprobs, entropy, micro) ->
        -> [B, T] on every rank                       (loss sum, tokens, metrics); grads
                                                      averaged per token over the global
                                                      batch; DistributedOptimizer step
```

Position ``t`` of a returned ``[B, T]`` tensor scores token ``input_ids[:, t]`` given the tokens
before it; position 0 has no context and is 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.utils import get_pp_last_rank, is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection

from hfschema.layout import ParallelLayout
from hfschema.lora import LoRAConfig
from hfschema.model import ModelConfig
from hfschema.packing import PackingConfig
from hfschema.train import MoEConfig, TrainConfig
from hfschema.trainer import Batch, LossFn, StepResult
from moe.routes import UNROUTED

from . import device_guard, packing
from .logprobs import token_scores
from .lora import apply_lora, dropout_step
from .model import build_model_chunks
from .packing import FIRST_KEY, POSITIONS_KEY, SEGMENTS_KEY, PackPlan, uses_te_attention
from .parallel import device as rank_device
from .routing import ROUTES_KEY, VALID_KEY, RouterControl

logger = logging.getLogger(__name__)


def _optimizer_config(train: TrainConfig, params_dtype: torch.dtype) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=train.optimizer,
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        use_distributed_optimizer=train.use_distributed_optimizer,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSnapshot:
    """Host copies of a policy's training tensors (``MegatronPolicy.snapshot``)."""

    tensors: list
    """The live tensors, in order."""
    copies: list
    """Their values on the host when the snapshot was taken."""
    scheduler_steps: int
    """The learning-rate scheduler's step count."""


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron-core (chained) optimizer: they hold the main
    params and the moments."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained]


def _scheduler(optimizer, train: TrainConfig) -> OptimizerParamScheduler:
    decay_steps = max(train.lr_decay_steps, train.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if train.lr_warmup_steps else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=train.lr_schedule,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )


class MegatronPolicy:
    """Model chunks of one role on this rank, with their optimizer and scheduler."""

    def __init__(
        self,
        model: ModelConfig,
        layout: ParallelLayout,
        train: TrainConfig,
        *,
        pg_collection: ProcessGroupCollection,
        params_dtype: torch.dtype = torch.float32,
        trainable: bool = True,
        moe: MoEConfig | None = None,
        lora: LoRAConfig | None = None,
        packing_config: PackingConfig | None = None,
        initialize: bool = True,
    ) -> None:
        self.initialize = initialize
        """False: built without random initialisation (zeros), for weights about to be loaded."""
        self.lora = lora if lora is not None and lora.enabled else None
        """The adapters' settings when this policy trains LoRA adapters on a frozen base."""
        if self.lora is not None and self.lora.lr is not None:
            train = dataclasses.replace(train, lr=self.lora.lr)
        self.model_config = model
        self.packing = packing_config or PackingConfig()
        """Sequence packing and token-budget micro-batches (``megatron_adapters.packing``)."""
        self.layout = layout
        self.train_config = train
        self.pg = pg_collection
        self.moe_config = moe
        self.device = rank_device()
        """Where this rank's chunks, batches and collective buffers live."""
        chunks = self._build_chunks(model, layout, params_dtype, pg_collection)
        self.config = chunks[0].config
        # packed rows: TE attention takes them as THD, megatron's local attention one sample at a time
        self._segmented = None if uses_te_attention(chunks) else packing.SegmentedAttention(chunks)
        # routing replay, router statistics, frozen router (before DDP: frozen weights get no grad buffer)
        self.routing: RouterControl | None = None
        if moe is not None and model.is_moe:
            tp_rank = pg_collection.tp.rank()
            self.routing = RouterControl(chunks, model, layout, moe, tp_rank=tp_rank, device=self.device)
        if self.lora is not None:  # before DDP: frozen weights get no grad buffer nor optimizer state
            apply_lora(chunks, self.lora)
        self.p2p = P2PCommunicator(pp_group=pg_collection.pp, config=self.config)
        self.optimizer = None
        self.scheduler = None
        self._offloaded = False
        if trainable:
            chunks = self._wrap_ddp(chunks, train)
            self.optimizer = get_megatron_optimizer(
                _optimizer_config(train, params_dtype),
                chunks,
                use_gloo_process_groups=False,
                pg_collection=self.pg,
            )
            self.scheduler = _scheduler(self.optimizer, train)
            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.grad_scale_func = self.optimizer.scale_loss
        self.chunks = chunks
        if self.routing is not None:
            self.routing.rebind(chunks)

    def _build_chunks(
        self,
        model: ModelConfig,
        layout: ParallelLayout,
        params_dtype: torch.dtype,
        pg_collection: ProcessGroupCollection,
    ) -> list:
        """The GPTModel chunks of this rank (the critic swaps the LM head for a value head)."""
        return build_model_chunks(
            model,
            layout,
            params_dtype=params_dtype,
            pg_collection=pg_collection,
            moe=self.moe_config,
            initialize=self.initialize,
        )

    def _wrap_ddp(self, chunks, train: TrainConfig) -> list[DistributedDataParallel]:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=train.use_distributed_optimizer,
        )
        return [
            DistributedDataParallel(
                config=self.config,
                ddp_config=ddp_config,
                module=chunk,
                # As Megatron-LM does: only the first VPP chunk is bucketed.
                disable_bucketing=index > 0,
                pg_collection=self.pg,
            )
            for index, chunk in enumerate(chunks)
        ]

    # ---------------------------------------------------------------------------- batching

    def _dp_rows(self, batch: Batch, local_rows: bool) -> dict[str, torch.Tensor]:
        """This data-parallel rank's rows on the rank's device: a contiguous share of the global
        ``batch``, or the whole of it when it holds this DP rank's rows already (``local_rows``).
        The one place a batch enters the trainer: it moves once, not per micro-batch."""
        if local_rows:
            return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        size, rank = self.pg.dp.size(), self.pg.dp.rank()
        rows = batch["input_ids"].shape[0]
        if rows % size:
            raise ValueError(f"batch of {rows} rows does not split over data-parallel size {size}")
        share = rows // size
        return {k: v[rank * share : (rank + 1) * share].to(self.device, non_blocking=True) for k, v in batch.items()}

    def _pad_sequence(self, batch: Batch) -> tuple[dict[str, torch.Tensor], int]:
        """Right-pad the sequence dim so sequence parallelism splits it evenly over TP."""
        seq = batch["input_ids"].shape[1]
        multiple = self.layout.tp * self.layout.cp
        pad = -seq % multiple
        if pad == 0:
            return dict(batch), seq
        padded = {}
        for key, value in batch.items():
            if value.dim() >= 2 and value.shape[1] == seq:
                shape = (value.shape[0], pad, *value.shape[2:])
                fill = UNROUTED if key == ROUTES_KEY else 0  # padding positions have no route
                value = torch.cat([value, value.new_full(shape, fill)], dim=1)
            padded[key] = value
        return padded, seq

    def _micro_batches(self, batch: Batch, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        rows = batch["input_ids"].shape[0]
        if rows % micro_batch_size:
            raise ValueError(f"{rows} rows per DP rank do not split into micro-batches of {micro_batch_size}")
        return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, rows, micro_batch_size)]

    # ---------------------------------------------------------------------------- packing

    def _packed_rows(self, batch: Batch, local_rows: bool) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """This DP rank's rows for packed passes; with a token budget and the global batch, shares
        of equal row counts and near-equal tokens (the row order of the shares is returned)."""
        size = self.pg.dp.size()
        if local_rows or self.packing.budget is None or size == 1:
            return self._dp_rows(batch, local_rows), None
        shares = packing.balance_shares(packing.sample_lengths(batch), size)
        pick = torch.tensor(shares[self.pg.dp.rank()])
        return {k: v[pick].to(self.device, non_blocking=True) for k, v in batch.items()}, sum(shares, [])

    def _plan(self, local: Batch, micro_rows: int) -> PackPlan:
        """Micro-batches of ``micro_rows`` rows, or filled up to the token budget in as many
        micro-batches as the busiest DP rank needs (every DP rank runs the same count)."""
        lengths = packing.sample_lengths(local)
        multiple = self.layout.tp * self.layout.cp
        budget = self.packing.budget
        if budget is None:
            plan = packing.plan_fixed(lengths, micro_rows, multiple=multiple)
        else:
            plan = packing.plan_budget(lengths, budget, multiple=multiple)
            count = torch.tensor([len(plan.micro_rows)], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.pg.dp)
            if int(count) > len(plan.micro_rows):
                plan = packing.plan_budget(lengths, budget, min_micro_batches=int(count), multiple=multiple)
        return plan.with_common_width() if self.layout.pp > 1 else plan  # stages exchange one shape

    def _packed_micros(self, kind: str, batch: Batch, micro_rows: int, record: bool, local_rows: bool):
        """Packed micro-batches of this rank's rows, the routing pass begun over them (tables in
        packed coordinates: one row per micro-batch); returns (micros, local rows, (plan, order))."""
        local, order = self._packed_rows(batch, local_rows)
        plan = self._plan(local, micro_rows)
        micros = [packing.pack(local, plan, i, fills={ROUTES_KEY: UNROUTED}) for i in range(len(plan.micro_rows))]
        if self.routing is None:
            if record or ROUTES_KEY in batch:
                raise ValueError(f"routing replay needs an MoE policy built with a moe config ({ROUTES_KEY})")
            return micros, local, (plan, order)
        for micro, rows in zip(micros, plan.micro_rows):  # the padding after the samples is no token
            micro.setdefault(VALID_KEY, micro[SEGMENTS_KEY] < len(rows))
        widest = max(plan.row_width(i) for i in range(len(micros)))
        self.routing.begin_pass(
            kind,
            rows=len(micros),
            length=widest,
            micro_rows=1,
            row_offset=0,
            record=record,
            routes=local.get(ROUTES_KEY),
            local_rows=True,
        )
        return micros, local, (plan, order)

    def _scoring_step(self, with_entropy: bool):
        """The forward-only step function of megatron's schedule that scores each micro-batch."""

        def step_fn(data_iterator, model):
            micro = next(data_iterator)

            def collect(logits_BSv, non_loss_data=True):
                return self._score(logits_BSv, micro, with_entropy)

            return self._forward(micro, model), collect

        return step_fn

    def _packed_logprobs(
        self, batch: Batch, micro_rows: int, with_entropy: bool, record: bool, local_rows: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs`` over packed micro-batches; recorded routes unpacked to rows."""
        micros, local, (plan, order) = self._packed_micros("logprob", batch, micro_rows, record, local_rows)

        outputs = self._run(micros, self._scoring_step(with_entropy), forward_only=True, collect=True)
        self._end_routing()
        shape = tuple(local["input_ids"].shape)
        if record:
            table = self.routing.recorded
            unpacked = packing.unpack(list(table.split(1)), plan, (*shape, *table.shape[2:]), fill=UNROUTED)
            self.routing.recorded = unpacked if local_rows else self._gather_rows(unpacked, order)
        scores = self._stack_last_stage(outputs, shape, shape[1], plan)
        return tuple((t if local_rows else self._gather_rows(t, order)).cpu() for t in scores)  # type: ignore[return-value]

    def _gather_rows(self, local: torch.Tensor, order: list[int] | None) -> torch.Tensor:
        """Every DP rank's rows in global order (``order``: the global row of each gathered one)."""
        gathered = self._gather_dp(local)
        if order is None:
            return gathered
        out = torch.empty_like(gathered)
        out[torch.tensor(order, device=gathered.device)] = gathered
        return out

    # ---------------------------------------------------------------------------- forward

    def _forward(self, micro: Batch, model) -> torch.Tensor:
        device_guard.check_on_device(micro, "MegatronPolicy model input")
        ids_BS = micro["input_ids"]
        positions_BS = torch.arange(ids_BS.shape[1], device=ids_BS.device).expand_as(ids_BS)
        packed, segments = None, contextlib.nullcontext()
        if SEGMENTS_KEY in micro:
            positions_BS = micro[POSITIONS_KEY]
            if self._segmented is None:
                packed = packing.packed_seq_params(micro[SEGMENTS_KEY])
            else:
                segments = self._segmented.active(packing.segment_lengths(micro[SEGMENTS_KEY]))
        with segments:
            if self.routing is None:
                return model(ids_BS, positions_BS, None, packed_seq_params=packed)
            self.routing.before_forward(model, micro)
            output = model(ids_BS, positions_BS, None, packed_seq_params=packed)
            self.routing.after_forward(model)
        return output

    def _begin_routing(
        self, kind: str, batch: Batch, local: Batch, seq: int, micro_rows: int, record: bool, local_rows: bool
    ) -> None:
        """Tell the router control where this rank's rows sit in the batch its tables cover: the
        global batch, or this DP rank's rows alone (``local_rows``)."""
        if self.routing is None:
            if record or ROUTES_KEY in batch:
                raise ValueError(f"routing replay needs an MoE policy built with a moe config ({ROUTES_KEY})")
            return
        share = local["input_ids"].shape[0]
        offset = 0 if local_rows else self.pg.dp.rank() * share
        self.routing.begin_pass(
            kind,
            rows=batch["input_ids"].shape[0],
            length=seq,
            micro_rows=micro_rows,
            row_offset=offset,
            record=record,
            routes=local.get(ROUTES_KEY),
            local_rows=local_rows,
        )

    def _end_routing(self) -> None:
        if self.routing is not None:
            self.routing.end_pass()

    def _scores(self, logits_BSv: torch.Tensor, micro: Batch, with_entropy: bool):
        """Log-prob of each next token and the entropy, shifted so index t scores token t."""
        tp_group = self.pg.tp
        vocab = self.model_config.vocab_size
        labels_BS = torch.roll(micro["input_ids"], shifts=-1, dims=1)
        logp_BS, ent_BS = token_scores(
            logits_BSv, labels_BS, vocab_size=vocab, tp_group=tp_group, with_entropy=with_entropy
        )
        logp_BS = _shift_right(logp_BS)
        return logp_BS, (_shift_right(ent_BS) if with_entropy else torch.zeros_like(logp_BS))

    def _score(self, logits_BSv: torch.Tensor, micro: Batch, with_entropy: bool):
        """``_scores``, with a packed row's sample starts and padding at 0 (no context there)."""
        first, second = self._scores(logits_BSv, micro, with_entropy)
        if FIRST_KEY not in micro:
            return first, second
        return first.masked_fill(micro[FIRST_KEY], 0.0), second.masked_fill(micro[FIRST_KEY], 0.0)

    def _run(self, micros, step_fn, *, forward_only: bool, collect: bool) -> list:
        forward_backward = get_forward_backward_func(self.layout.pp, self.layout.vpp if self.layout.vpp > 1 else None)
        chunks = len(self.chunks)
        iterators: Iterator | list[Iterator] = [iter(micros) for _ in range(chunks)] if chunks > 1 else iter(micros)
        return forward_backward(
            forward_step_func=step_fn,
            data_iterator=iterators,
            model=self.chunks if chunks > 1 else self.chunks[0],
            num_microbatches=len(micros),
            seq_length=micros[0]["input_ids"].shape[1],
            micro_batch_size=micros[0]["input_ids"].shape[0],
            forward_only=forward_only,
            collect_non_loss_data=collect,
            p2p_communicator=self.p2p,
            pg_collection=self.pg,
        )

    @torch.no_grad()
    def forward_logprobs(
        self,
        batch: Batch,
        *,
        micro_batch_size: int | None = None,
        with_entropy: bool = False,
        record_routes: bool = False,
        local_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy ``[B, T]`` of the global batch, returned on every rank, on the
        host: the runtime's fields live there and enter the trainer again through ``_dp_rows``.
        With ``local_rows`` the batch is this DP rank's rows and so are the results (every DP
        rank must then bring the same number of micro-batches).

        A batch with ``routed_experts`` ``[B, T, L, k]`` is scored with those experts (routing
        replay); ``record_routes`` keeps the experts the routers chose, as such a table, in
        ``self.routing.take_recorded()`` (on every rank)."""
        for chunk in self.chunks:
            chunk.eval()
        micro_rows = micro_batch_size or self.train_config.micro_batch_size
        if self.packing.enabled:
            return self._packed_logprobs(batch, micro_rows, with_entropy, record_routes, local_rows)
        padded, seq = self._pad_sequence(self._dp_rows(batch, local_rows))
        micros = self._micro_batches(padded, micro_rows)
        self._begin_routing("logprob", batch, padded, seq, micro_rows, record_routes, local_rows)

        outputs = self._run(micros, self._scoring_step(with_entropy), forward_only=True, collect=True)
        self._end_routing()
        local = self._stack_last_stage(outputs, padded["input_ids"].shape, seq)
        return tuple((t if local_rows else self._gather_dp(t)).cpu() for t in local)  # type: ignore[return-value]

    def _stack_last_stage(
        self, outputs, padded_shape, seq, plan: PackPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate (or unpack, with ``plan``) the last stage's micro-batch results and share
        them across the PP group."""
        rows, length = padded_shape
        both = torch.zeros(2, rows, length, device=self.device)
        if is_pp_last_stage(self.pg.pp):
            join = torch.cat if plan is None else partial(packing.unpack, plan=plan, shape=(rows, length))
            both[0] = join([logp for logp, _ in outputs])
            both[1] = join([ent for _, ent in outputs])
        if self.layout.pp > 1:
            src = get_pp_last_rank(self.pg.pp)
            dist.broadcast(both, src=src, group=self.pg.pp)
        return both[0, :, :seq], both[1, :, :seq]

    def _gather_dp(self, local: torch.Tensor) -> torch.Tensor:
        group = self.pg.dp
        size = dist.get_world_size(group)
        if size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    # ---------------------------------------------------------------------------- training

    def train_step(self, batch: Batch, loss_fn: LossFn, *, local_rows: bool = False) -> StepResult:
        """One optimizer step on the global batch with ``loss_fn`` (token-averaged); with
        ``local_rows``, ``batch`` is this DP rank's rows of it (as in ``forward_logprobs``)."""
        if self.optimizer is None:
            raise RuntimeError("this policy was built with trainable=False")
        if self._offloaded:
            raise RuntimeError("train_step while the training state is offloaded; call restore_training_state()")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.lora is not None and self.lora.dropout:
            dropout_step(self.chunks, self.scheduler.num_steps)
        if self.packing.enabled:
            micros, _, _ = self._packed_micros("train", batch, self.train_config.micro_batch_size, False, local_rows)
        else:
            padded, seq = self._pad_sequence(self._dp_rows(batch, local_rows))
            micros = self._micro_batches(padded, self.train_config.micro_batch_size)
            self._begin_routing(
                "train", batch, padded, seq, self.train_config.micro_batch_size, record=False, local_rows=local_rows
            )

        def step_fn(data_iterator, model):
            micro = next(data_iterator)

            def loss(logits_BSv):
                logp_BS, ent_BS = self._score(logits_BSv, micro, with_entropy=True)
                loss_sum, tokens, metrics = loss_fn(logp_BS, ent_BS, micro)
                weight = torch.as_tensor(metrics.pop("weight", tokens)).float()
                reported = {"loss": torch.stack([loss_sum.detach(), tokens.float()])}
                for name, value in metrics.items():
                    reported[name] = torch.stack([value.detach() * weight, weight])
                return loss_sum, tokens.int(), reported

            return self._forward(micro, model), loss

        outputs = self._run(micros, step_fn, forward_only=False, collect=False)
        self._end_routing()
        lr = self.optimizer.param_groups[0]["lr"]
        if not self._grads_finite():
            # A NaN/inf must never reach the weights (or a checkpoint written after this step).
            self.optimizer.zero_grad()
            result = self._step_result(outputs, float("nan"), lr)
            return dataclasses.replace(result, applied=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        if update_ok:
            self.scheduler.step(increment=1)
        return self._step_result(outputs, grad_norm, lr)

    def snapshot(self) -> "TrainingSnapshot":
        """A host copy of everything an optimizer step changes (weights, the optimizer's main
        params and moments, the scheduler's step), for ``rollback``: a training step of several
        updates is then all or nothing. Costs one host copy of the training state."""
        if self.optimizer is None or self._offloaded:
            raise RuntimeError("snapshot needs a trainable policy with its training state on the device")
        tensors = [p.data for chunk in self.chunks for p in chunk.parameters()]
        for inner in _torch_optimizers(self.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    tensors.append(p.data)
                    tensors += [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v)]
        unique = list({id(t): t for t in tensors}.values())  # an FP32 optimizer's params are the model's
        return TrainingSnapshot(
            tensors=unique,
            copies=[t.detach().to("cpu", copy=True) for t in unique],
            scheduler_steps=self.scheduler.num_steps,
        )

    def rollback(self, snap: "TrainingSnapshot") -> None:
        """Put back what ``snapshot`` copied (in place: views and buffers stay valid)."""
        with torch.no_grad():
            for tensor, copy in zip(snap.tensors, snap.copies):
                tensor.copy_(copy)
        self.scheduler.num_steps = snap.scheduler_steps
        self.scheduler.step(increment=0)  # the learning rate of that step again
        self.optimizer.zero_grad()

    # ---------------------------------------------------------------------------- colocation

    def offload_training_state(self) -> None:
        """Free the gradient buffers and move optimizer state to the host while the colocated
        engine generates (megatron-core's own RL offload: the buffers' storage is resized to 0,
        so every ``main_grad`` view stays valid and comes back zeroed)."""
        if self.optimizer is None or self._offloaded:
            return
        on_gpu = torch.cuda.is_available()
        for chunk in self.chunks:
            chunk.offload_grad_buffers(synchronize=on_gpu, empty_cache=on_gpu)
        if on_gpu:  # optimizer state already lives on the host otherwise
            self.optimizer.offload_to_cpu()
        self._offloaded = True

    def restore_training_state(self) -> None:
        """Undo ``offload_training_state`` before the next update."""
        if self.optimizer is None or not self._offloaded:
            return
        on_gpu = torch.cuda.is_available()
        for chunk in self.chunks:
            chunk.restore_grad_buffers(synchronize=on_gpu)
        if on_gpu:
            self.optimizer.restore_from_cpu()
        self._offloaded = False

    @property
    def training_state_offloaded(self) -> bool:
        """Whether gradients and optimizer state are off the device."""
        return self._offloaded

    def _grads_finite(self) -> bool:
        """Whether every rank's gradients are finite (megatron's fp32 optimizer would apply a NaN)."""
        bad = torch.zeros(1, device=self.device)
        for chunk in self.chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                bad += (~torch.isfinite(buffer.grad_data)).any()  # no host sync per buffer
        dist.all_reduce(bad)
        return bad.item() == 0  # the one host sync: every rank must agree to step

    def _step_result(self, outputs, grad_norm, lr) -> StepResult:
        """Token-weighted metric means over micro-batches and DP ranks, shared with all ranks."""
        # Only the last pipeline stage has outputs; it tells the other stages the metric names.
        names = self._broadcast_names(sorted(outputs[0]) if outputs else [])
        sums = torch.zeros(len(names), 2, device=self.device)
        for out in outputs:
            for i, name in enumerate(names):
                sums[i] += out[name]
        if self.layout.pp > 1:
            dist.all_reduce(sums, group=self.pg.pp)  # only the last stage holds non-zeros
        dist.all_reduce(sums, group=self.pg.dp)
        sums = sums.cpu()  # one host sync for every metric of the step
        means = {n: float(s[0] / s[1].clamp(min=1)) for n, s in zip(names, sums)}
        return StepResult(
            loss=means.pop("loss"),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(lr),
            num_tokens=int(sums[names.index("loss")][1]),
            metrics=means,
        )

    def _broadcast_names(self, names: list[str]) -> list[str]:
        if self.layout.pp == 1:
            return names
        box = [names]
        src = get_pp_last_rank(self.pg.pp)
        dist.broadcast_object_list(box, src=src, group=self.pg.pp)
        return box[0]


def _shift_right(scores_BS: torch.Tensor) -> torch.Tensor:
    """Index t of the result scores token t (predicted at t-1); index 0 is 0."""
    return torch.cat([scores_BS.new_zeros(scores_BS.shape[0], 1), scores_BS[:, :-1]], dim=1)
