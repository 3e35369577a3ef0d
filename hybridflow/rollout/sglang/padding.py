"""Logical per-rank SGLang tensors -> the engine's actual (padded) parameter shapes.

The reshard planner (``reshard/sglang.py``) lays out each SGLang rank's parameters
unpadded: ``w13_weight [E_local, 2*I/moe_tp, H]``, ``w2_weight [E_local, H, I/moe_tp]``,
``gate_up_proj [2*I/tp, H]``, ``down_proj [H, I/tp]``; vocab rows are already padded to
SGLang's multiple of 64. A running engine may allocate more: ``load_format="direct"`` needs the
exact shape, and a wrong one kills the scheduler, so each tensor is expanded here first.

Padding seen on CPU (SGLang 0.5.23; ``configs/update_config.adjust_config_with_unaligned_cpu_tp``,
applied whenever ``device == "cpu"``, even at tp=1): ``moe_intermediate_size`` and
``intermediate_size`` are rounded up to a multiple of ``tp * 32``, so each rank holds
``P = round_up(I, 32 * tp) / tp`` intermediate rows, of which the planner fills ``I/tp``.
Zero rows and columns are exact: ``silu(0) * 0 = 0`` and a zero column of ``w2`` adds nothing.

    w13_weight    [E, 2*i, H] -> [E, 2*P, H]:  [gate i rows | 0 (P-i) | up i rows | 0 (P-i)]
    gate_up_proj     [2*i, H] -> [2*P, H]:     the same two halves
    w2_weight     [E, H, i]   -> [E, H, P]:    zero columns appended
    down_proj        [H, i]   -> [H, P]:       zero columns appended
    embed_tokens / lm_head [V, H] -> [V', H]:  zero rows appended (vocab padding)

Any other parameter must already have the engine's shape: a generic "pad what is short" rule
would silently accept a truncated tensor.

(SGLang's own full-tensor loader fills the padded rows differently -- rank 0 took a tiny
expert's whole intermediate dim, rank 1 only zeros -- which gives the same outputs after the
all-reduce.) Heads padded when ``num_heads % tp != 0`` change ``qkv_proj`` in three segments
and are not handled: ``to_engine_layout`` raises ValueError for such a shape.
"""

from __future__ import annotations

import torch

__all__ = ["FUSED_HALVES_SUFFIXES", "TAIL_PADDED_DIM", "to_engine_layout"]

FUSED_HALVES_SUFFIXES = ("w13_weight", "gate_up_proj.weight")
"""Parameters made of two stacked halves (gate, up) along their intermediate dim (dim -2)."""
TAIL_PADDED_DIM = {"w2_weight": -1, "down_proj.weight": -1, "embed_tokens.weight": 0, "lm_head.weight": 0}
"""Name suffix -> the one dim the engine may pad at its end."""


def to_engine_layout(name: str, logical: torch.Tensor, engine_shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """``logical`` (unpadded, as the planner lays it out) in the engine's ``engine_shape``.

    Returns ``logical`` itself when the shapes already match. Raises ValueError naming the
    parameter when the shape cannot be reached by the padding rules above.
    """
    engine_shape = tuple(engine_shape)
    if tuple(logical.shape) == engine_shape:
        return logical
    if name.endswith(FUSED_HALVES_SUFFIXES):
        _check_only_dim_grows(name, logical, engine_shape, logical.dim() - 2)
        return _pad_halves(name, logical, engine_shape)
    dim = next((d for suffix, d in TAIL_PADDED_DIM.items() if name.endswith(suffix)), None)
    if dim is None:
        raise ValueError(
            f"{name}: shape {tuple(logical.shape)} differs from the engine's {engine_shape}, and the engine "
            "pads no dim of this parameter (check the model and the engine's tp / ep)"
        )
    _check_only_dim_grows(name, logical, engine_shape, dim % max(logical.dim(), 1))
    out = logical.new_zeros(engine_shape)
    out.narrow(dim, 0, logical.shape[dim]).copy_(logical)
    return out


def _check_only_dim_grows(name: str, logical: torch.Tensor, engine_shape: tuple[int, ...], dim: int) -> None:
    other_dims_match = logical.dim() == len(engine_shape) and all(
        a == b for d, (a, b) in enumerate(zip(logical.shape, engine_shape)) if d != dim
    )
    if not other_dims_match or logical.shape[dim] > engine_shape[dim]:
        raise ValueError(
            f"{name}: shape {tuple(logical.shape)} cannot become the engine's {engine_shape} "
            f"(the engine pads only dim {dim} of this parameter, and only by growing it)"
        )


def _pad_halves(name: str, logical: torch.Tensor, engine_shape: tuple[int, ...]) -> torch.Tensor:
    dim = logical.dim() - 2  # [.., 2*i, H]
    if logical.shape[dim] % 2 or engine_shape[dim] % 2:
        raise ValueError(f"{name}: fused gate/up dim {dim} must be even, got {tuple(logical.shape)} -> {engine_shape}")
    half, padded_half = logical.shape[dim] // 2, engine_shape[dim] // 2
    out = logical.new_zeros(engine_shape)
    out.narrow(dim, 0, half).copy_(logical.narrow(dim, 0, half))
    out.narrow(dim, padded_half, half).copy_(logical.narrow(dim, half, half))
    return out
