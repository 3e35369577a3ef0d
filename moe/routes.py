"""Routing tables: the experts each token went to, in the trainer's order and in the router's.

```
rollout engine (R3)                                 actor's old-log-prob forward (R2)
RolloutSample.routed_experts [P+R-1, L, k]          each router records [N, k] (router order)
      │ rollout.tokens.pack_batch                         │ from_router_order, per layer
      ▼                                                   ▼
                batch["routed_experts"]  [B, T, L, k]   (UNROUTED = -1: no route)
      │ MegatronPolicy: this DP rank's rows, right padding of T to a TP multiple (-1), micro-batches
      ▼
micro table [b, T, L, k] ──to_router_order(layer l, this TP rank's sequence slice)──► target [N, k]
      │ fill_unrouted: positions without a route get a placeholder (see below)
      ▼
megatron-core RouterReplay.set_target_indices(target)   (one RouterReplay per MoE layer)
```

megatron-core's router sees the hidden states of a micro-batch as ``[S, b, H]`` and flattens
them sequence-major, so token ``n = s * b + j`` is row ``j`` at position ``s``. With sequence
parallelism (TP > 1) TP rank ``r`` holds positions ``[r * S, (r + 1) * S)`` of the padded
sequence ``T = tp * S``. Context parallelism would split positions into load-balanced chunks;
it is not supported here.

Positions without a route are the last token of each sample (it was never fed to the engine)
and right padding. Nothing the loss reads depends on them — attention is causal, so position
``t`` only influences positions after it, and none of those is a scored real token — so they get
the placeholder route ``0, 1, ..., k-1``. A missing route *before* a routed position in the same
row would change real tokens' log-probs, and is refused.

Legend: B rows, T positions, L MoE layers, k experts per token, b rows of a micro-batch,
S positions on this TP rank, N = S * b tokens in router order, E experts.
"""

from __future__ import annotations

import torch

__all__ = [
    "UNROUTED",
    "check_replay_device",
    "check_suffix_unrouted",
    "fill_unrouted",
    "from_router_order",
    "moe_layer_index",
    "to_router_order",
]

UNROUTED = -1
"""Table entry of a position that has no recorded route."""


def check_replay_device(mode: str, *, on_gpu: bool) -> None:
    """R3 needs an engine that returns routes: SGLang does so only on a GPU."""
    if mode == "r3" and not on_gpu:
        raise ValueError(
            "moe.routing_replay=r3 replays the experts chosen by the rollout engine, and SGLang "
            "returns routed experts only on a GPU (return_routed_experts is refused on CPU); on this "
            "machine use moe.routing_replay=r2 (routes recorded in the actor's old-log-prob forward "
            "and replayed in training)"
        )


def moe_layer_index(layer_number: int, first_k_dense: int) -> int | None:
    """Index into the L axis of a table for megatron's 1-based ``layer_number``; None if dense."""
    index = layer_number - 1 - first_k_dense
    return index if index >= 0 else None


def to_router_order(table_bTk: torch.Tensor, *, tp_size: int, tp_rank: int, sequence_parallel: bool) -> torch.Tensor:
    """One layer's ``[b, T, k]`` micro table as the ``[N, k]`` rows this rank's router sees."""
    rows, length, k = table_bTk.shape
    if sequence_parallel and tp_size > 1:
        if length % tp_size:
            raise ValueError(f"{length} positions do not split over tensor-parallel size {tp_size}")
        span = length // tp_size
        table_bTk = table_bTk[:, tp_rank * span : (tp_rank + 1) * span]
    return table_bTk.transpose(0, 1).reshape(-1, k)


def from_router_order(idx_Nk: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of ``to_router_order`` for this rank: ``[N, k]`` -> ``[b, S, k]``."""
    tokens, k = idx_Nk.shape
    if tokens % rows:
        raise ValueError(f"{tokens} router rows do not split into {rows} micro-batch rows")
    return idx_Nk.reshape(tokens // rows, rows, k).transpose(0, 1)


def check_suffix_unrouted(table_BTLk: torch.Tensor) -> None:
    """Refuse a table where a position without a route precedes a routed one in its row."""
    routed_BTL = (table_BTLk >= 0).all(dim=-1)
    # a routed position after an unrouted one: the running minimum drops below the value
    running_BTL = torch.cummin(routed_BTL.int(), dim=1).values
    bad = routed_BTL.int() > running_BTL
    if bad.any():
        row, pos, layer = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"routed_experts row {row}: position {pos} of MoE layer {layer} has a route but an "
            "earlier position has none; replay needs routes for every fed token (right padding only)"
        )


def fill_unrouted(target_Nk: torch.Tensor) -> torch.Tensor:
    """Placeholder experts ``0..k-1`` where a row has no route (see the module docstring)."""
    missing_N = (target_Nk < 0).any(dim=-1)  # no early exit on none missing: that would wait for the device
    k = target_Nk.shape[-1]
    placeholder_Nk = torch.arange(k, dtype=target_Nk.dtype, device=target_Nk.device).expand_as(target_Nk)
    return torch.where(missing_N[:, None], placeholder_Nk, target_Nk)
