"""A reward model: the critic's megatron-core model, read at each sequence's last token.

```
HF *ForSequenceClassification dir ── read_model_config ──► ScoreModelConfig (head "score")
   (score.weight [1, H], num_labels=1)      load_hf_weights: the canonical mapping, score.weight ──►
                                            output_layer.weight (the critic's value head, whole on
                                            every TP rank), each rank its own slices
a run.mode=rm checkpoint / hf-to-mcore ──── checkpoint.load (any layout)
        ids [B, T] ──► values [B, T] (unshifted: t = after reading token t) ──► pool_last ──► [B]
```

Pooling is transformers': the score of a row is the value at its last token that is not the
padding id (``pad_token_id`` of the model's config.json), so a reward model trained with
transformers scores the same sequences the same way here, whatever layout holds it. Training
(``run.mode=rm``, ``hybridflow.runtime.rm_train``) uses the Bradley-Terry loss below on pairs laid
out chosen, rejected, chosen, ... so that both rows of a pair sit in one micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfschema.model_source import ModelSource
from hfschema.trainer import LAST_KEY, bradley_terry_loss  # the shared contract; re-exported

from .critic import MegatronCritic

__all__ = [
    "LAST_KEY",
    "MegatronRewardModel",
    "bradley_terry_loss",
    "last_token_mask",
    "load_reward_model",
]


class MegatronRewardModel(MegatronCritic):
    """A sequence-classification model under any layout: ``forward_scores`` and, trainable,
    ``train_step`` with ``bradley_terry_loss``."""

    def _scores(self, logits_BS1: torch.Tensor, micro, with_entropy: bool):
        values_BS = logits_BS1[..., 0].float()  # not shifted: the score reads the whole sequence
        return values_BS, torch.zeros_like(values_BS)

    def forward_scores(self, batch, pad_id: int | None, *, local_rows: bool = False) -> torch.Tensor:
        """Score ``[B]`` of each row of ``batch`` (``input_ids`` right-padded with ``pad_id``, or
        cut at ``lengths`` [B] when the batch has them), on the host."""
        lengths = batch.get("lengths")
        inputs = {"input_ids": batch["input_ids"]}
        values, _ = self.forward_logprobs(inputs, local_rows=local_rows)
        mask = last_token_mask(batch["input_ids"], pad_id, lengths)
        return (values * mask).sum(dim=1)


def last_token_mask(ids_BT: torch.Tensor, pad_id: int | None, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` one-hot of the token each row is scored at: the last one within ``lengths``
    (all columns when None) whose id is not ``pad_id``, as transformers' sequence classification
    pools (its last column when the row is all padding)."""
    rows, cols = ids_BT.shape
    positions = torch.arange(cols).expand(rows, cols)
    real = torch.ones_like(ids_BT, dtype=torch.bool) if pad_id is None else ids_BT != pad_id
    if lengths is not None:
        real &= positions < lengths.view(-1, 1)
    last = torch.where(real, positions, -1).amax(dim=1)
    last = torch.where(last < 0, cols - 1, last)
    return F.one_hot(last, cols).float()


def load_reward_model(rm: MegatronRewardModel, source: ModelSource) -> None:
    """Fill ``rm`` from a checked source (``hfschema.model_source.reward_model_source``): each
    rank reads its own slices."""
    if source.kind == "mcore":
        from . import checkpoint

        checkpoint.load(rm, source.weights)
        return
    from .pretrained import load_hf_weights

    load_hf_weights(rm, source.weights)
