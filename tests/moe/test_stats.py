"""Router statistics against values worked out by hand on small routing tables."""

from __future__ import annotations

import math

import pytest
import torch

from moe.stats import (
    RouterStats,
    load_imbalance,
    router_entropy,
    router_probs,
    routing_map_topk,
    summarise,
    tokens_per_expert,
    topk_differs,
)

# 4 tokens, E=4, k=2: expert 0 gets 4 assignments, 1 gets 2, 2 and 3 one each
EXPERTS_NK = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 0]])


def test_tokens_per_expert_and_imbalance():
    counts = tokens_per_expert(EXPERTS_NK, 4)
    assert counts.tolist() == [4.0, 2.0, 1.0, 1.0]
    peak, cv = load_imbalance(counts)
    # mean 2, max 4; deviations 2, 0, -1, -1 -> variance 6/4
    assert peak == pytest.approx(2.0)
    assert cv == pytest.approx(math.sqrt(1.5) / 2)
    assert tokens_per_expert(EXPERTS_NK, 4, torch.tensor([True, False, False, True])).tolist() == [2, 1, 0, 1]
    assert load_imbalance(torch.tensor([3.0, 3.0, 3.0])) == (1.0, 0.0)


def test_router_entropy_of_softmax_and_sigmoid_routers():
    uniform_probs = router_probs(torch.zeros(1, 4), "softmax")
    assert uniform_probs.tolist() == [[0.25] * 4]
    assert router_entropy(uniform_probs).item() == pytest.approx(math.log(4))
    assert router_entropy(torch.tensor([[1.0, 0.0, 0.0, 0.0]])).item() == 0.0
    # sigmoid(0) = 1/2 for each of 4 experts, normalised to 1/4
    assert router_probs(torch.zeros(1, 4), "sigmoid").tolist() == [[0.25] * 4]
    # sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4 -> normalised 3/4, 1/4
    two = router_probs(torch.tensor([[math.log(3), -math.log(3)]]), "sigmoid")
    assert two[0].tolist() == pytest.approx([0.75, 0.25])


def test_topk_mismatch_ignores_order():
    natural = torch.tensor([[0, 1], [2, 0], [1, 3]])
    target = torch.tensor([[1, 0], [0, 2], [1, 2]])
    assert topk_differs(natural, target).tolist() == [False, False, True]


def test_routing_map_topk_marks_dropped_slots():
    routing_map = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.bool)
    assert routing_map_topk(routing_map, 2).tolist() == [[0, 1], [2, 3], [1, -1]]


def _map(experts_Nk: torch.Tensor, num_experts: int = 4) -> torch.Tensor:
    return torch.zeros(len(experts_Nk), num_experts, dtype=torch.bool).scatter(1, experts_Nk.clamp(min=0), True)


@pytest.mark.claim("router-statistics")
def test_router_stats_sums_per_layer():
    stats = RouterStats(num_layers=2, num_experts=4, top_k=2)
    probs = router_probs(torch.zeros(4, 4), "softmax")
    valid = torch.tensor([True, True, True, False])  # the last token is padding
    # layer 0: natural routing differs from the target on token 2; replay dispatched the target
    target = torch.tensor([[0, 1], [0, 2], [1, 3], [3, 0]])
    natural = torch.tensor([[1, 0], [2, 0], [1, 0], [0, 1]])
    stats.add(
        0,
        routing_map_NE=_map(target),
        probs_NE=probs,
        valid_N=valid,
        natural_Nk=natural,
        target_Nk=target,
        replayed=True,
    )
    # layer 1: no reference; token 1 lost one slot to capacity
    dropped_map = _map(EXPERTS_NK)
    dropped_map[1, 2] = False
    stats.add(1, routing_map_NE=dropped_map, probs_NE=probs, valid_N=valid)
    assert stats.counts().tolist() == [[2, 2, 1, 1], [3, 2, 0, 0]]
    layers = stats.layer_metrics()
    assert layers[0]["load_max_mean"] == pytest.approx(2 / 1.5)
    assert layers[0]["topk_mismatch"] == pytest.approx(1 / 3)
    assert layers[0]["replay_match"] == 1.0
    assert layers[0]["dropped_frac"] == 0.0
    assert layers[1]["dropped_frac"] == pytest.approx(1 / 6)  # 1 of 3 tokens x 2 slots
    assert layers[1]["router_entropy"] == pytest.approx(math.log(4))
    assert "topk_mismatch" not in layers[1]
    metrics = stats.metrics("moe/train")
    assert metrics["moe/train/topk_mismatch"] == pytest.approx(1 / 3)  # only layer 0 measured it
    assert metrics["moe/train/load_max_mean"] == pytest.approx((2 / 1.5 + 3 / 1.25) / 2)
    # layer 1 counts 3, 2, 0, 0: mean 1.25
    variance = ((3 - 1.25) ** 2 + 0.75**2 + 2 * 1.25**2) / 4
    assert metrics["moe/train/layer1/load_cv"] == pytest.approx(math.sqrt(variance) / 1.25)


def test_replay_match_counts_tokens_dispatched_elsewhere():
    stats = RouterStats(num_layers=1, num_experts=4, top_k=2)
    target = torch.tensor([[0, 1], [2, 3], [-1, -1]])  # the last token has no route: not compared
    dispatched = torch.tensor([[1, 0], [2, 1], [0, 1]])
    stats.add(
        0,
        routing_map_NE=_map(dispatched),
        probs_NE=router_probs(torch.zeros(3, 4), "softmax"),
        valid_N=torch.ones(3, dtype=torch.bool),
        target_Nk=target,
        replayed=True,
    )
    assert stats.layer_metrics()[0]["replay_match"] == 0.5


def test_summarise_keeps_layer_averages():
    history = [
        {"step": 1, "moe/train/load_cv": 0.5, "moe/train/layer0/load_cv": 0.4, "reward/mean": 1.0},
        {"step": 2, "moe/train/load_cv": 0.3},
    ]
    assert summarise(history) == {"moe/train/load_cv": {"first": 0.5, "last": 0.3, "mean": 0.4, "max": 0.5}}
