"""Per-token log-probabilities and entropy over vocab-parallel logits.

Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary,
``logits_BSv`` with ``v = V_padded / tp``. Nothing here gathers the full vocabulary: the
softmax normaliser, the target logit and the entropy are reduced across the TP group as
scalars per token. Vocabulary padding rows (ids >= the real vocab size) are masked out, so the
numbers equal those of the unpadded Hugging Face model.

Legend: B batch, S sequence, v local vocab slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _mask_vocab_padding(logits_BSv: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    local = logits_BSv.shape[-1]
    start = dist.get_rank(tp_group) * local if tp_group is not None else 0
    if start + local <= vocab_size:
        return logits_BSv
    ids_v = torch.arange(start, start + local, device=logits_BSv.device)
    return logits_BSv.masked_fill(ids_v >= vocab_size, float("-inf"))


def token_logprobs(logits_BSv: torch.Tensor, labels_BS: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """log p(labels) under the full-vocabulary softmax, differentiable, in fp32."""
    logits_BSv = _mask_vocab_padding(logits_BSv.float(), vocab_size, tp_group)
    # megatron's kernel writes into its logits argument: give it a tensor of its own.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits_BSv.clone(), labels_BS)


def token_entropy(logits_BSv: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """Entropy of the full-vocabulary softmax at each position, differentiable, in fp32."""
    logits_BSv = _mask_vocab_padding(logits_BSv.float(), vocab_size, tp_group)
    max_BS = logits_BSv.detach().max(dim=-1).values
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(max_BS, op=dist.ReduceOp.MAX, group=tp_group)
    shifted_BSv = logits_BSv - max_BS.unsqueeze(-1)
    exp_BSv = shifted_BSv.exp()
    sum_BS = _tp_sum(exp_BSv.sum(dim=-1), tp_group)
    weighted_BSv = torch.where(exp_BSv > 0, exp_BSv * shifted_BSv, torch.zeros_like(exp_BSv))
    expected_shift_BS = _tp_sum(weighted_BSv.sum(dim=-1), tp_group) / sum_BS
    return sum_BS.log() - expected_shift_BS


def _tp_sum(local: torch.Tensor, tp_group) -> torch.Tensor:
    # All-reduce forward, identity backward: each rank's downstream loss is the same replica.
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return local
    return reduce_from_tensor_model_parallel_region(local, group=tp_group)
