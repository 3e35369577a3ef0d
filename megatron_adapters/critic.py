"""The critic: the actor's megatron-core model with its LM head swapped for a value head.

```
GPTModel (same decoder, same layout)  ──  last stage: ValueHead instead of output_layer
   hidden [S/tp, B, H] (sequence parallel; [S, B, H] without) ──x · w, w [1, H] whole on every
         TP rank──► [S/tp, B, 1] ──gathered over the TP group along S (backward: split)──► V [S, B, 1]
```

The head is one ``[1, H]`` weight that every TP rank holds whole, as megatron-core holds its
replicated parameters (norms, routers): ``tensor_model_parallel=False``, so the grad norm counts
it once, and a replicated ``[1, H]`` tensor in dist checkpoints. Under sequence parallelism each
rank's gradient covers its part of the sequence; the weight is marked ``sequence_parallel`` so
megatron's ``finalize_model_grads`` sums them over TP, and every rank steps with the whole one.
So every TP size computes (and trains) what one process computes. Values come back aligned like
log-probs: position ``t`` holds V of the state in which token ``t`` was generated (the hidden
state at ``t - 1``). Everything else — micro-batching, pipeline schedule, DDP, the distributed
optimizer, dist checkpoints — is ``MegatronPolicy``'s; a critic checkpoint reloads under any
layout. The GPTModel is built untied whatever ``tie_word_embeddings`` says: the value head is no
copy of the word embeddings.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

from .parallel import device as rank_device
from .policy import MegatronPolicy, _shift_right

__all__ = ["MegatronCritic", "ValueHead"]


class ValueHead(MegatronModule):
    """Drop-in for GPTModel's ``output_layer`` returning values ``[S, B, 1]`` (and no bias)."""

    def __init__(self, config, tp_group) -> None:
        super().__init__(config)
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel  # GPTModel reads its output layer's flag
        self.weight = torch.nn.Parameter(self._initial_weight(config).to(rank_device()))
        set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)  # replicated over TP
        self.weight.sequence_parallel = config.sequence_parallel  # TP sums the per-part grads
        self.weight.is_embedding_or_output_parameter = True  # as megatron marks its output layer

    def _initial_weight(self, config) -> torch.Tensor:
        """Drawn as megatron's CPU initialisation draws a ``[1, H]`` master weight (the
        default generator, seeded alike on every rank), then rank 0's copy on the whole TP
        group, so the replicas are equal whatever each rank drew before."""
        weight = torch.zeros(1, config.hidden_size, dtype=torch.float)
        if config.perform_initialization:
            config.init_method(weight)
        weight = weight.to(config.params_dtype)
        if self.tp_group.size() > 1:
            weight = weight.to(rank_device())
            dist.broadcast(weight, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return weight

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: ARG002 (GPTModel's call)
        assert weight is None, "the value head has its own weight (the critic is built untied)"
        values_SB1 = F.linear(input_, self.weight)
        if self.sequence_parallel:  # every rank's loss sees every value; its grad is split back
            values_SB1 = gather_from_sequence_parallel_region(
                values_SB1, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return values_SB1, None


class MegatronCritic(MegatronPolicy):
    """A value model under any layout: ``forward_values`` and ``train_step`` on values."""

    def _build_chunks(self, model, layout, params_dtype, pg_collection) -> list:
        # No LM head, so nothing to tie: built tied, megatron-core would keep treating the head's
        # weight as the word embeddings' (all-reduce their grads across the first and last
        # stages under PP, tie their checkpoint keys) though the value head is [1, H].
        untied = dataclasses.replace(model, tie_word_embeddings=False)
        chunks = super()._build_chunks(untied, layout, params_dtype, pg_collection)
        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer = ValueHead(chunk.config, pg_collection.tp)
        return chunks

    def _scores(self, logits_BS1: torch.Tensor, micro, with_entropy: bool):
        values_BS = _shift_right(logits_BS1[..., 0].float())
        return values_BS, torch.zeros_like(values_BS)

    def forward_values(self, batch, *, micro_batch_size: int | None = None, local_rows: bool = False) -> torch.Tensor:
        """Values ``[B, T]`` of the global batch on every rank (of this DP rank's rows with
        ``local_rows``)."""
        values, _ = self.forward_logprobs(batch, micro_batch_size=micro_batch_size, local_rows=local_rows)
        return values
