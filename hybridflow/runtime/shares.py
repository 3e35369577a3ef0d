"""Who holds which rollout rows: each data-parallel rank its share, never the whole batch.

```
a generate call's prompts 0 .. P-1 ──► DP rank p * dp // P owns prompt p and all n of its samples
   (contiguous blocks; a group never straddles ranks, so group statistics stay local);
   under token-budget micro-batches the same counts, chosen by tokens (``balanced_owners``)
every rank of a DP rank's model-parallel group (TP / PP peers) holds the same rows;
the first of them (the "leader") speaks for the rows in batch-wide sums
```

Batch-wide quantities (whitening statistics, reward means, the largest response) are sums over
the leaders, taken on a gloo group of all ranks: the runtime's fields live on the host, and the
device groups (NCCL on GPUs) take only device tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Shard", "balanced_owners", "owner", "single_process"]


def owner(prompt_index: int, num_prompts: int, dp_size: int) -> int:
    """The data-parallel rank that trains on the samples of ``prompt_index``."""
    return prompt_index * dp_size // max(num_prompts, 1)


def balanced_owners(tokens: list[int], dp_size: int) -> list[int]:
    """Each prompt's DP rank when the ranks should train on about equal tokens (token-budget
    micro-batches, ``packing.max_tokens_per_micro_batch``): ``tokens[p]`` is prompt p's tokens,
    all its samples together. The largest prompt goes first, each to the rank with the fewest
    tokens among those still short of their ``owner`` share of prompts, so every rank keeps
    the prompt count it has by default and a group still never straddles ranks. Ties go to the
    lower prompt index and rank: every rank computes the same answer from the same metadata."""
    quota = [0] * dp_size
    for p in range(len(tokens)):
        quota[owner(p, len(tokens), dp_size)] += 1
    load, count, owners = [0] * dp_size, [0] * dp_size, [0] * len(tokens)
    for p in sorted(range(len(tokens)), key=lambda p: (-tokens[p], p)):
        rank = min((r for r in range(dp_size) if count[r] < quota[r]), key=lambda r: (load[r], r))
        owners[p], load[rank], count[rank] = rank, load[rank] + tokens[p], count[rank] + 1
    return owners


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's place in the data-parallel split of the runtime's rows."""

    dp_rank: int
    dp_size: int
    leader: bool
    """The first rank of its model-parallel group: the one that counts its rows in batch sums."""
    group: Any = None
    """A gloo group over every rank (host tensors), or None in a single process."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the DP ranks (each counted once, through its leader)."""
        if self.group is None:
            return x
        total = x.clone() if self.leader else torch.zeros_like(x)
        dist.all_reduce(total, group=self.group)
        return total

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``x`` over every rank."""
        if self.group is None:
            return x
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def gather(self, rows: torch.Tensor, values: torch.Tensor, total: int) -> torch.Tensor:
        """The ``[total, ...]`` tensor whose rows ``rows`` are this rank's ``values`` (each DP
        rank's rows once; every position must be covered by some rank)."""
        out = values.new_zeros(total, *values.shape[1:])
        if self.group is None:
            out[rows] = values
            return out
        if self.leader:
            out[rows] = values
        return self.sum(out)


def single_process() -> Shard:
    """The shard of a process that holds the whole batch."""
    return Shard(dp_rank=0, dp_size=1, leader=True, group=None)
