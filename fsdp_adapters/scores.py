"""Next-token log-probs and entropy from the final hidden states, a chunk of tokens at a time.

``[tokens x vocab]`` logits in fp32 are the largest tensor of an RL step (32K tokens of a 150K
vocabulary: 19 GB). Here each chunk's logits are made from the hidden states and the output
embedding, scored (one softmax for both numbers, ``token_scores``), and let go; the backward pass
makes them again (activation checkpointing per chunk), so the peak is one chunk's, whatever the
sequence length.

Legend: N tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from hfschema.trainer import SCORE_CHUNK_TOKENS

__all__ = ["CHUNK_TOKENS", "chunked_scores", "token_scores"]

CHUNK_TOKENS = SCORE_CHUNK_TOKENS


def token_scores(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) per row, in fp32, from one log-softmax."""
    logp_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    picked_N = logp_NV.gather(-1, labels_N.unsqueeze(-1)).squeeze(-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return picked_N, entropy_N


def _chunk(hidden_NH, weight_VH, labels_N, vocab_size):
    logits_NV = hidden_NH @ weight_VH.t()
    return token_scores(logits_NV[:, :vocab_size], labels_N)


def chunked_scores(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    vocab_size: int,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) [N] of ``hidden_NH @ weight_VH.T``'s softmax over the first
    ``vocab_size`` columns (a padded output embedding's extra rows are no tokens)."""
    parts = []
    for begin in range(0, hidden_NH.shape[0], chunk_tokens):
        piece = slice(begin, begin + chunk_tokens)
        args = (hidden_NH[piece], weight_VH, labels_N[piece], vocab_size)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            parts.append(_chunk(*args))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
