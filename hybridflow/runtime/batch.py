"""Tensor plumbing between rollouts, the trainer and the estimators.

```
RolloutBatch ──pack_batch (right padding)──► [B, T] input_ids, response_mask, logprobs, ...
                                              │
     estimators work on responses aligned at column 0:   to_response ──► [B, R]
     losses work on the trainer's [B, T] layout:          from_response ◄── [B, R]
                                              │
     pad_rows: zero-mask rows so every DP rank runs the same micro-batches
```

Right padding keeps every real token where causal attention sees only real tokens before it,
which is what makes the trainer's log-probs equal the engine's. Legend: B samples, T prompt +
response columns, R response columns.
"""

from __future__ import annotations

import torch

__all__ = ["from_response", "pad_rows", "response_index", "to_response"]


def response_index(prompt_lengths_B: torch.Tensor, num_response: int) -> torch.Tensor:
    """[B, R] column of each response position in the [B, T] layout."""
    return prompt_lengths_B[:, None] + torch.arange(num_response)[None, :]


def to_response(x_BT: torch.Tensor, prompt_lengths_B: torch.Tensor, num_response: int) -> torch.Tensor:
    """The response part of each row, aligned at column 0 (``[B, R]``; beyond T reads as 0)."""
    index_BR = response_index(prompt_lengths_B, num_response)
    padded = torch.cat([x_BT, x_BT.new_zeros(x_BT.shape[0], num_response)], dim=1)
    return padded.gather(1, index_BR)


def from_response(x_BR: torch.Tensor, prompt_lengths_B: torch.Tensor, length: int) -> torch.Tensor:
    """Place ``[B, R]`` response values back at their ``[B, T]`` columns (zeros elsewhere)."""
    num_response = x_BR.shape[1]
    out = x_BR.new_zeros(x_BR.shape[0], length + num_response)
    out.scatter_(1, response_index(prompt_lengths_B, num_response), x_BR)
    return out[:, :length]


def pad_rows(
    batch: dict[str, torch.Tensor], multiple: int, *, rows: int | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """Append copies of row 0 with every mask zeroed until the rows divide by ``multiple`` (or
    number ``rows``, when given: another DP rank may hold more); zero rows when there is none.

    The copies carry no response tokens, so they add nothing to any loss or token count.
    Returns the padded batch and the number of real rows.
    """
    real = batch["input_ids"].shape[0]
    target = -(-real // multiple) * multiple if rows is None else rows
    if target < real:
        raise ValueError(f"cannot pad {real} rows to {target}")
    extra = target - real
    if extra == 0:
        return batch, real
    padded = {}
    for key, value in batch.items():
        if real == 0:
            filler = value.new_zeros(extra, *value.shape[1:])
        else:
            filler = value[:1].expand(extra, *value.shape[1:]).clone()
        if key.endswith("mask") or key in ("advantages", "returns", "token_weights"):
            filler = torch.zeros_like(filler)
        padded[key] = torch.cat([value, filler])
    return padded, real
