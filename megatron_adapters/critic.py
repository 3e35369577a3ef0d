"""The critic: the actor's megatron-core model with its LM head swapped for a value head.

```
GPTModel (same decoder, same layout)  ──  last stage: ValueHead instead of output_layer
   hidden [S, B, H] ──ColumnParallelLinear(H -> tp), one column per TP rank──► [S, B, 1] local
                    ──sum over the TP group (all-reduce; its backward is the identity)──► V
```

Summing one column per TP rank is one linear head (its weight is the sum of the columns), so
every TP size computes the same kind of function and each rank trains its own column. Values
come back aligned like log-probs: position ``t`` holds V of the state in which token ``t`` was
generated (the hidden state at ``t - 1``). Everything else — micro-batching, pipeline schedule,
DDP, the distributed optimizer, dist checkpoints — is ``MegatronPolicy``'s; a critic checkpoint
reloads under the same TP size (the head's global shape is ``[tp, H]``). The GPTModel is built
untied whatever ``tie_word_embeddings`` says: the value head is no copy of the word embeddings.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from .policy import MegatronPolicy, _shift_right

__all__ = ["MegatronCritic", "ValueHead"]


class ValueHead(ColumnParallelLinear):
    """Drop-in for GPTModel's ``output_layer`` returning values ``[S, B, 1]``."""

    def __init__(self, config, tp_group) -> None:
        super().__init__(config.hidden_size, tp_group.size(), config=config, init_method=config.init_method,
                         bias=False, gather_output=False, tp_group=tp_group)

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: ARG002 (GPTModel's call)
        local_SB1, _ = super().forward(input_)
        return reduce_from_tensor_model_parallel_region(local_SB1, group=self.tp_group), None


class MegatronCritic(MegatronPolicy):
    """A value model under any layout: ``forward_values`` and ``train_step`` on values."""

    def _build_chunks(self, model, layout, params_dtype, pg_collection) -> list:
        # No LM head, so nothing to tie: built tied, megatron-core would keep treating the head's
        # weight as the word embeddings' (all-reduce their grads across the first and last
        # stages under PP, tie their checkpoint keys) though the value head is [tp, H].
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
