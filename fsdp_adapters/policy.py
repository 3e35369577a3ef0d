"""An FSDP2 policy: score tokens and train on them, with the megatron backend's contract.

```
global batch (every rank holds it)                FSDP2Policy
  input_ids [B, T], fields [B, ...]  ──►  this DP rank's rows ──► micro-batches
                                              │
              _Scorer (the FSDP root): the model's decoder ──► last hidden states
                 next-token log-probs + entropy, chunk by chunk (``scores.py``)
                     ┌────────────────────────┴─────────────────────────┐
             forward_logprobs:                                   train_step:
     all-gather DP rows -> [B, T] on every rank       loss_fn(logprobs, entropy, micro) ->
                                                      (loss sum, tokens, metrics); gradients
                                                      summed over micro-batches and DP ranks,
                                                      divided by the global batch's tokens;
                                                      clipped; AdamW at megatron's schedule
```

Position ``t`` of a returned ``[B, T]`` tensor scores token ``input_ids[:, t]`` given the tokens
before it; position 0 has no context and is 0 (as ``MegatronPolicy``). Rows are right-padded and
attention is causal, so padding changes no real token's score.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from hfschema import packing
from hfschema.packing import PackingConfig, PackPlan
from hfschema.ranks import device
from hfschema.train import TrainConfig
from hfschema.trainer import Batch, LossFn, StepResult, decays, lr_at

from . import ulysses
from .model import build_sharded
from .scores import CHUNK_TOKENS, chunked_scores
from .ulysses import gather_sequence, shard_sequence

__all__ = ["FSDP2Critic", "FSDP2Policy", "TrainingSnapshot"]


class _Window:
    """Which tokens of each row this rank runs the decoder on, and how its scores rejoin the row:
    all of them, or with a sequence-parallel group its slice (``ulysses``)."""

    def __init__(self, group=None) -> None:
        self.group = group

    def split(
        self, ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, labels: the next token of each position that has one; under sequence
        parallel every position of the slice, 0 past the row's end). ``positions_BT``: a packed
        row's (restarting at each sample; transformers then confines attention to each sample)."""
        if self.group is not None:
            return shard_sequence(ids_BT, self.group)
        if positions_BT is None:
            positions_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        return ids_BT, positions_BT, ids_BT[:, 1:]

    def join(self, scores_Bs: torch.Tensor, length: int) -> torch.Tensor:
        """Scores of positions 0..T-2 (each scoring the next token) as ``[B, T]``: position ``t``
        scores token ``t``, position 0 has no context and is 0."""
        whole = gather_sequence(scores_Bs, self.group) if self.group is not None else scores_Bs
        return torch.cat([whole.new_zeros(whole.shape[0], 1), whole[:, : length - 1]], dim=1)


class _Scorer(nn.Module):
    """The FSDP root: the causal LM's decoder, then its output embedding through ``chunked_scores``
    (FSDP gathers the root's own parameters, embeddings and final norm, for this forward)."""

    def __init__(self, lm: nn.Module, chunk_tokens: int, window: _Window) -> None:
        super().__init__()
        self.lm, self.chunk_tokens, self.window = lm, chunk_tokens, window

    def forward(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None):
        ids, positions, labels = self.window.split(ids_BT, positions_BT)
        hidden_BsH = self.lm.get_decoder()(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        hidden_BsH = hidden_BsH[:, : labels.shape[1]]  # the last position scores nothing (no next token)
        logp_N, entropy_N = chunked_scores(
            hidden_BsH.reshape(-1, hidden_BsH.shape[-1]),
            self.lm.get_output_embeddings().weight,
            labels.reshape(-1),
            vocab_size=self.lm.config.vocab_size,
            chunk_tokens=self.chunk_tokens,
        )
        length = ids_BT.shape[1]
        logp, entropy = logp_N.view(labels.shape), entropy_N.view(labels.shape)
        return self.window.join(logp, length), self.window.join(entropy, length)


class FSDP2Policy:
    """One role's model on this rank, sharded over the data-parallel group, with its optimizer."""

    def __init__(
        self,
        path: str | Path,
        train: TrainConfig,
        *,
        group: dist.ProcessGroup | None = None,
        trainable: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        offload: bool = False,
        activation_checkpointing: bool = False,
        chunk_tokens: int = CHUNK_TOKENS,
        init: str = "load",
        seed: int = 0,
        layout=None,
        sp: int = 1,
        packing: PackingConfig | None = None,
    ) -> None:
        self.train_config = train
        self.sp = sp
        """Ulysses sequence-parallel size: each group of ``sp`` consecutive ranks holds the same
        rows and splits their tokens (the data-parallel size is the group's size / sp)."""
        self.source = Path(path)
        """The model directory it was built from (config.json, tokenizer): what its checkpoints and
        exports carry beside the weights."""
        self.group = group if group is not None else dist.group.WORLD
        self.device = device()
        self.layout = layout
        """The role's ``ParallelLayout`` (dp alone) when the runtime built it."""
        self.routing = None
        """No MoE routing replay or router statistics (dense models)."""
        self.packing = packing if packing is not None and packing.enabled else None
        """Samples packed into one row per micro-batch (``hfschema.packing``), or None."""
        if self.packing is not None and sp > 1:
            raise ValueError("packed rows are not split over sequence-parallel ranks in this version")
        mesh = DeviceMesh.from_group(self.group, device_type=self.device.type)
        window = _Window(_sequence_group(self.group, sp) if sp > 1 else None)
        self.scorer = build_sharded(
            self.source,
            mesh,
            self.device,
            compute_dtype=compute_dtype,
            offload=offload,
            activation_checkpointing=activation_checkpointing,
            wrap=lambda lm: self._root(lm, chunk_tokens, window),
            init=init,
            seed=seed,
        )
        self.model = self._trained(self.scorer)
        """The trained module under its Hugging Face names: the transformers model (its parameters
        are this rank's shards, as DTensors)."""
        if window.group is not None:
            ulysses.enable(self.scorer, self.model.config, window.group)
        self.optimizer = self._optimizer(train) if trainable else None
        self.steps = 0
        """Optimizer steps taken (the learning-rate schedule's position)."""
        self._offloaded = False

    @staticmethod
    def _root(lm: nn.Module, chunk_tokens: int, window: _Window) -> nn.Module:
        return _Scorer(lm, chunk_tokens, window)

    @staticmethod
    def _trained(root: nn.Module) -> nn.Module:
        return root.lm

    def _optimizer(self, train: TrainConfig) -> torch.optim.Optimizer:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": train.weight_decay},
            {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0},
        ]
        if train.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=lr_at(train, 0))
        return torch.optim.AdamW(
            groups, lr=lr_at(train, 0), betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps
        )

    # ---------------------------------------------------------------------------- rows

    def _dp_rows(self, batch: Batch, local_rows: bool) -> dict[str, torch.Tensor]:
        """This data-parallel rank's rows on the rank's device (a contiguous share of the global
        batch, or all of ``batch`` with ``local_rows``)."""
        if local_rows:
            return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        size, rank = self.group.size() // self.sp, self.group.rank() // self.sp
        rows = batch["input_ids"].shape[0]
        if rows % size:
            raise ValueError(f"batch of {rows} rows does not split over data-parallel size {size}")
        share = rows // size
        return {k: v[rank * share : (rank + 1) * share].to(self.device, non_blocking=True) for k, v in batch.items()}

    def _micros(self, local: Batch, micro_rows: int) -> tuple[list[dict[str, torch.Tensor]], PackPlan | None]:
        """This rank's micro-batches: ``micro_rows`` rows each, or packed (one row of samples each;
        with a token budget, as many as the busiest DP rank needs, so every rank runs the same
        count of FSDP's collectives) and the plan that unpacks them."""
        if self.packing is None:
            return self._micro_batches(local, micro_rows), None
        lengths = packing.sample_lengths(local)
        budget = self.packing.budget
        if budget is None:
            plan = packing.plan_fixed(lengths, micro_rows)
        else:
            plan = packing.plan_budget(lengths, budget)
            count = torch.tensor([len(plan.micro_rows)], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
            plan = packing.plan_budget(lengths, budget, min_micro_batches=int(count))
        return [packing.pack(local, plan, i, fills={}) for i in range(len(plan.micro_rows))], plan

    def _scores(self, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The scorer's two outputs on a micro-batch; a packed one's are 0 at each sample's first
        token (its context is another sample), as at position 0 of a row."""
        if self.packing is None:
            return self.scorer(micro["input_ids"])
        first, second = self.scorer(micro["input_ids"], micro[packing.POSITIONS_KEY])
        keep = ~micro[packing.FIRST_KEY]
        return first * keep, second * keep

    @staticmethod
    def _rows(parts: list[torch.Tensor], plan: PackPlan | None, local: Batch) -> torch.Tensor:
        """Micro-batches' scores as this rank's rows ``[b, T]``."""
        if plan is None:
            return torch.cat(parts)
        return packing.unpack(parts, plan, tuple(local["input_ids"].shape))

    @staticmethod
    def _micro_batches(batch: Batch, micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        rows = batch["input_ids"].shape[0]
        if rows % micro_batch_size:
            raise ValueError(f"{rows} rows per DP rank do not split into micro-batches of {micro_batch_size}")
        return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, rows, micro_batch_size)]

    def _gather_dp(self, local: torch.Tensor) -> torch.Tensor:
        if self.group.size() == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.group.size())]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts[:: self.sp])  # a sequence-parallel group's ranks hold the same rows

    # ---------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def forward_logprobs(
        self,
        batch: Batch,
        *,
        micro_batch_size: int | None = None,
        with_entropy: bool = False,
        local_rows: bool = False,
        record_routes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy (zeros unless ``with_entropy``) ``[B, T]`` of the global batch on
        every rank, on the host (``local_rows``: this rank's rows, as ``MegatronPolicy``).
        ``record_routes``: MoE routing replay, which a dense model has nothing to record for."""
        if record_routes:
            raise ValueError("routing replay records MoE routes: the FSDP2 backend trains dense models")
        self.scorer.eval()
        local = self._dp_rows(batch, local_rows)
        micros, plan = self._micros(local, micro_batch_size or self.train_config.micro_batch_size)
        scored = [self._scores(micro) for micro in micros]
        logp, entropy = (self._rows([s[i] for s in scored], plan, local) for i in (0, 1))
        if not with_entropy:
            entropy = torch.zeros_like(entropy)
        return tuple((t if local_rows else self._gather_dp(t)).cpu() for t in (logp, entropy))  # type: ignore[return-value]

    # ---------------------------------------------------------------------------- training

    def train_step(self, batch: Batch, loss_fn: LossFn, *, local_rows: bool = False) -> StepResult:
        """One optimizer step on the global batch with ``loss_fn`` (token-averaged over the global
        batch); with ``local_rows``, ``batch`` is this DP rank's rows of it."""
        if self.optimizer is None:
            raise RuntimeError("this policy was built with trainable=False")
        self.scorer.train()
        self.optimizer.zero_grad(set_to_none=True)
        micros, _ = self._micros(self._dp_rows(batch, local_rows), self.train_config.micro_batch_size)
        reported: dict[str, torch.Tensor] = {}
        for i, micro in enumerate(micros):
            self.scorer.set_requires_gradient_sync(i == len(micros) - 1)  # reduce once, after the last
            logp, entropy = self._scores(micro)
            loss_sum, tokens, metrics = loss_fn(logp, entropy, micro)
            loss_sum.backward()
            weight = torch.as_tensor(metrics.pop("weight", tokens)).float()
            _add(reported, "loss", torch.stack([loss_sum.detach(), torch.as_tensor(tokens).float()]))
            for name, value in metrics.items():
                _add(reported, name, torch.stack([value.detach() * weight, weight]))
        names = sorted(reported)
        sums = torch.stack([reported[n] for n in names]).to(self.device)
        dist.all_reduce(sums, group=self.group)
        sums = sums.cpu() / self.sp  # each rank of a sequence-parallel group counted its rows' whole loss
        tokens = float(sums[names.index("loss")][1])
        lr = lr_at(self.train_config, self.steps)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:  # FSDP averaged them over the DP ranks: make it the mean per token of the batch
            p.grad.mul_(self.group.size() / max(tokens, 1.0))
        grad_norm = self._clip(params)
        applied = bool(torch.isfinite(torch.as_tensor(grad_norm)))
        if applied:  # a NaN or inf gradient never reaches the weights
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        means = {n: float(s[0] / s[1].clamp(min=1)) for n, s in zip(names, sums)}
        return StepResult(
            loss=means.pop("loss"),
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=int(tokens),
            metrics=means,
            applied=applied,
        )

    # ---------------------------------------------------------------------------- undo, colocation

    def _training_tensors(self) -> list[torch.Tensor]:
        """This rank's shards of the weights and of the optimizer's moments."""
        tensors = [p.to_local() for p in self.model.parameters()]
        for state in self.optimizer.state.values():
            tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def snapshot(self) -> TrainingSnapshot:
        """A host copy of what an optimizer step changes (weight shards, moments, the schedule's
        position), for ``rollback``: a step of several updates is then all or nothing."""
        if self.optimizer is None or self._offloaded:
            raise RuntimeError("snapshot needs a trainable policy with its training state on the device")
        tensors = self._training_tensors()
        copies = [t.detach().to("cpu", copy=True) for t in tensors]
        return TrainingSnapshot(tensors=tensors, copies=copies, steps=self.steps, state_keys=self._state_keys())

    def rollback(self, snap: TrainingSnapshot) -> None:
        """Put back what ``snapshot`` copied, in place. Moments made after it (the first update
        of a fresh optimizer) are dropped, as they did not exist then."""
        for param in list(self.optimizer.state):
            if id(param) not in snap.state_keys:
                del self.optimizer.state[param]
        with torch.no_grad():
            for tensor, copy in zip(self._training_tensors(), snap.copies):
                tensor.copy_(copy)
        self.steps = snap.steps
        self.optimizer.zero_grad(set_to_none=True)

    def _state_keys(self) -> frozenset[int]:
        return frozenset(id(p) for p in self.optimizer.state)

    def offload_training_state(self) -> None:
        """The optimizer's moments to the host while a colocated engine generates (gradients are
        already freed after each step); a CPU run has nothing to move."""
        if self.optimizer is None or self._offloaded:
            return
        if self.device.type != "cpu":
            _move_state(self.optimizer, torch.device("cpu"))
        self._offloaded = True

    def restore_training_state(self) -> None:
        """Undo ``offload_training_state`` before the next update."""
        if self.optimizer is None or not self._offloaded:
            return
        if self.device.type != "cpu":
            _move_state(self.optimizer, self.device)
        self._offloaded = False

    @property
    def training_state_offloaded(self) -> bool:
        return self._offloaded

    def _clip(self, params: list[torch.Tensor]) -> float:
        """The global gradient norm before clipping (every rank agrees: the norm of the DTensor
        gradients is reduced over the mesh); clipped to ``clip_grad`` when that is set."""
        clip = self.train_config.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"), foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)


class _ValueScorer(nn.Module):
    """The critic's FSDP root: the causal LM's decoder under a one-column value head, named
    ``output_layer`` as megatron's critic names its own (the actor's transformer copies in by
    name; the head is what it leaves). Values come back aligned like log-probs: position ``t``
    holds V of the state in which token ``t`` was generated (the hidden state at ``t - 1``)."""

    def __init__(self, lm: nn.Module, window: _Window) -> None:
        super().__init__()
        self.model = lm.get_decoder()
        self.config = lm.config
        self.window = window
        self.output_layer = nn.Linear(lm.config.hidden_size, 1, bias=False, device="meta")

    def forward(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None):
        ids, positions, _ = self.window.split(ids_BT, positions_BT)
        hidden_BsH = self.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        values_BT = self.window.join(self.output_layer(hidden_BsH)[..., 0].float(), ids_BT.shape[1])
        return values_BT, torch.zeros_like(values_BT)


class FSDP2Critic(FSDP2Policy):
    """PPO's critic: the model's decoder under a value head; ``forward_values`` and ``train_step``
    on values (the loss function receives values where a policy's receives log-probs). Its
    transformer comes from the actor (``backend.copy_weights``); the head is drawn here, as
    megatron's critic draws its own: normal with the config's ``initializer_range``, one seeded
    draw every rank shares."""

    def __init__(self, path: str | Path, train: TrainConfig, **kwargs) -> None:
        super().__init__(path, train, init="empty", **kwargs)
        std = getattr(self.model.config, "initializer_range", 0.02)
        generator = torch.Generator().manual_seed(kwargs.get("seed", 0))
        head = torch.randn(1, self.model.config.hidden_size, generator=generator) * std
        set_model_state_dict(
            self.model, {"output_layer.weight": head}, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    @staticmethod
    def _root(lm: nn.Module, chunk_tokens: int, window: _Window) -> nn.Module:
        return _ValueScorer(lm, window)

    @staticmethod
    def _trained(root: nn.Module) -> nn.Module:
        return root

    def forward_values(self, batch: Batch, *, micro_batch_size: int | None = None, local_rows: bool = False):
        """Values ``[B, T]`` of the global batch on every rank (this DP rank's rows with ``local_rows``)."""
        return self.forward_logprobs(batch, micro_batch_size=micro_batch_size, local_rows=local_rows)[0]


@dataclasses.dataclass(frozen=True)
class TrainingSnapshot:
    """Host copies of an FSDP2 policy's training tensors (``FSDP2Policy.snapshot``)."""

    tensors: list
    copies: list
    steps: int
    state_keys: frozenset[int]
    """The parameters the optimizer held moments for when it was taken."""


def _sequence_group(group: dist.ProcessGroup, sp: int):
    """This rank's group of ``sp`` consecutive ranks of ``group`` (every rank of it calls this)."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) % sp:
        raise ValueError(f"sequence parallel size {sp} does not divide the {len(ranks)} ranks")
    mine, _ = dist.new_subgroups_by_enumeration([ranks[i : i + sp] for i in range(0, len(ranks), sp)])
    return mine


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _add(into: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    into[name] = into[name] + value.cpu() if name in into else value.cpu()
