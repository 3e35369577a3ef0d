"""Routing tables between the trainer's [B, T, L, k] layout and megatron's router order."""

from __future__ import annotations

import pytest
import torch

from moe.routes import (
    check_replay_device,
    check_suffix_unrouted,
    fill_unrouted,
    from_router_order,
    moe_layer_index,
    to_router_order,
)


def _table(rows: int, length: int) -> torch.Tensor:
    """[b, T, 1]: 10 * row + position, so every entry names its place."""
    return (10 * torch.arange(rows)[:, None] + torch.arange(length)[None, :])[..., None]


def test_router_order_is_sequence_major():
    # megatron flattens [S, b] hidden states: token n = s * b + j
    assert to_router_order(_table(2, 3), tp_size=1, tp_rank=0, sequence_parallel=False)[:, 0].tolist() == [
        0,
        10,
        1,
        11,
        2,
        12,
    ]


def test_sequence_parallel_takes_this_ranks_positions():
    ordered = to_router_order(_table(2, 4), tp_size=2, tp_rank=1, sequence_parallel=True)
    assert ordered[:, 0].tolist() == [2, 12, 3, 13]
    with pytest.raises(ValueError, match="do not split"):
        to_router_order(_table(2, 3), tp_size=2, tp_rank=0, sequence_parallel=True)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_from_router_order_inverts(tp_rank: int):
    table = torch.randint(0, 8, (3, 6, 2))
    ordered = to_router_order(table, tp_size=2, tp_rank=tp_rank, sequence_parallel=True)
    assert torch.equal(from_router_order(ordered, 3), table[:, 3 * tp_rank : 3 * tp_rank + 3])


def test_moe_layer_index_skips_dense_layers():
    assert [moe_layer_index(n, first_k_dense=1) for n in (1, 2, 3)] == [None, 0, 1]


def test_unrouted_positions_get_a_placeholder():
    target = torch.tensor([[3, 1], [-1, -1], [2, 0]])
    assert fill_unrouted(target).tolist() == [[3, 1], [0, 1], [2, 0]]


def test_a_missing_route_before_a_routed_position_is_refused():
    table = torch.zeros(2, 4, 1, 2, dtype=torch.long)
    table[0, 3] = -1  # right padding: fine
    check_suffix_unrouted(table)
    table[1, 1] = -1
    with pytest.raises(ValueError, match="row 1: position 2"):
        check_suffix_unrouted(table)


def test_r3_on_cpu_points_to_r2():
    check_replay_device("r3", on_gpu=True)
    check_replay_device("r2", on_gpu=False)
    with pytest.raises(ValueError, match="moe.routing_replay=r2"):
        check_replay_device("r3", on_gpu=False)
