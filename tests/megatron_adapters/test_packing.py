"""The packer and the token-budget planner, without processes: every row exactly once, budgets
kept, micro-batches and data-parallel shares balanced, packed rows that unpack to their rows."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_adapters.packing import (
    FIRST_KEY,
    POSITIONS_KEY,
    SEGMENTS_KEY,
    balance_shares,
    pack,
    packed_seq_params,
    plan_budget,
    plan_fixed,
    sample_lengths,
    segment_lengths,
    unpack,
)


def _long_tail(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16, 512) * (8 if rng.random() < 0.05 else 1) for _ in range(count)]


def test_lengths_end_at_the_last_marked_token() -> None:
    ids = torch.ones(3, 6, dtype=torch.long)
    response = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert sample_lengths({"input_ids": ids, "response_mask": response}) == [4, 0, 6]
    assert sample_lengths({"input_ids": ids, "response_mask": response, "attention_mask": attention}) == [5, 0, 6]
    assert sample_lengths({"input_ids": ids}) == [6, 6, 6]


def test_fixed_plan_keeps_the_unpacked_micro_batches() -> None:
    plan = plan_fixed([5, 0, 3, 4], 2, multiple=2)
    assert plan.micro_rows == ((0,), (2, 3))  # a row of no tokens is left out, the count kept
    assert [plan.row_width(i) for i in range(2)] == [6, 8]
    with pytest.raises(ValueError, match="micro-batches of 3"):
        plan_fixed([1, 2, 3, 4], 3)


@pytest.mark.parametrize("seed", range(5))
def test_budget_plan_covers_every_row_within_the_budget(seed: int) -> None:
    lengths = _long_tail(64, seed)
    budget = max(lengths) + 100
    plan = plan_budget(lengths, budget, multiple=2)
    rows = sorted(r for micro in plan.micro_rows for r in micro)
    assert rows == list(range(64))
    assert all(plan.row_width(i) <= budget for i in range(len(plan.micro_rows)))
    loads = [plan.tokens(i) for i in range(len(plan.micro_rows))]
    assert max(loads) - min(loads) <= max(lengths)  # LPT: spread within the longest row
    assert len(plan.micro_rows) <= 2 * -(-sum(lengths) // budget) + 1


def test_budget_plan_runs_as_many_micro_batches_as_asked() -> None:
    plan = plan_budget([10, 10, 10], 64, min_micro_batches=5)
    assert len(plan.micro_rows) == 5
    assert sorted(len(m) for m in plan.micro_rows) == [0, 0, 1, 1, 1]  # empty ones pad the count
    assert plan.row_width(plan.micro_rows.index(())) == 1


def test_budget_smaller_than_a_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="packing.max_tokens_per_micro_batch=9"):
        plan_budget([4, 10], 9)


def test_common_width_for_pipeline_stages() -> None:
    plan = plan_budget([7, 3, 2], 8, multiple=2).with_common_width()
    assert {plan.row_width(i) for i in range(len(plan.micro_rows))} == {8}
    assert plan.processed_tokens() == 8 * len(plan.micro_rows)


@pytest.mark.parametrize("seed", range(3))
def test_data_parallel_shares_are_equal_in_rows_and_close_in_tokens(seed: int) -> None:
    lengths = _long_tail(32, seed)
    shares = balance_shares(lengths, 4)
    assert sorted(sum(shares, [])) == list(range(32))
    assert {len(s) for s in shares} == {8}
    totals = [sum(lengths[r] for r in s) for s in shares]
    assert max(totals) - min(totals) <= max(lengths)
    with pytest.raises(ValueError, match="data-parallel size 3"):
        balance_shares(lengths, 3)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 25).reshape(3, 8)
    mask = torch.tensor([[0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]]).float()
    routes = torch.arange(3 * 8 * 2 * 1).reshape(3, 8, 2, 1)
    return {"input_ids": ids, "loss_mask": mask, "routed_experts": routes, "positive": torch.tensor([1.0, 0.0, 2.0])}


def test_pack_gathers_tokens_and_their_routes_and_unpacks_back() -> None:
    batch = _batch()
    plan = plan_fixed(sample_lengths(batch), 3, multiple=4)
    micro = pack(batch, plan, 0, fills={"routed_experts": -1})
    assert plan.lengths == (3, 8, 4)
    assert micro["input_ids"].shape == (1, 16)
    assert micro["input_ids"][0, :15].tolist() == [1, 2, 3, *range(9, 17), 17, 18, 19, 20]
    assert micro[POSITIONS_KEY][0].tolist() == [0, 1, 2, *range(8), 0, 1, 2, 3, 0]
    assert micro[SEGMENTS_KEY][0].tolist() == [0] * 3 + [1] * 8 + [2] * 4 + [3]
    assert micro[FIRST_KEY][0].nonzero().flatten().tolist() == [0, 3, 11, 15]
    assert micro["positive"][0].tolist() == [1.0] * 3 + [0.0] * 8 + [2.0] * 4 + [0.0]
    assert micro["routed_experts"].shape == (1, 16, 2, 1)
    assert micro["routed_experts"][0, -1].flatten().tolist() == [-1, -1]
    assert torch.equal(micro["routed_experts"][0, 3], batch["routed_experts"][1, 0])
    back = unpack([micro["routed_experts"]], plan, batch["routed_experts"].shape, fill=-1)
    kept = torch.tensor(plan.lengths)[:, None] > torch.arange(8)[None, :]
    assert torch.equal(back[kept], batch["routed_experts"][kept])
    assert (back[~kept] == -1).all()


def test_segments_are_the_samples_then_the_padding() -> None:
    assert segment_lengths(torch.tensor([[0, 0, 0, 1, 1, 2]])) == [3, 2, 1]


def test_thd_params_hold_the_cumulative_lengths() -> None:
    params = packed_seq_params(torch.tensor([[0, 0, 0, 1, 1, 2]]))
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == 3
