"""The FSDP2 side of a reshard (``reshard/fsdp.py``): each rank holds ``torch.chunk``'s rows of each
tensor, and the planner moves them into SGLang's layout exactly once, at the byte bound."""

from __future__ import annotations

import pytest
import torch

from hfschema.layout import ParallelLayout
from hfschema.sglang import SGLangSettings
from reshard import Bandwidth, Topology, plan_reshard, plan_stats, sglang_layout
from reshard.fsdp import fsdp_layout, row_chunks
from tests.reshard.cases import TINY_MODELS
from tests.reshard.test_planner import _brute_lower_bound, _check_exactly_once, _check_sources, _coverage


@pytest.mark.parametrize("rows, ranks", [(8, 2), (7, 2), (5, 4), (3, 4), (1, 3), (130, 8)])
def test_each_ranks_rows_are_torch_chunks_piece(rows, ranks):
    pieces = torch.arange(rows).chunk(ranks)
    expected = [(int(p[0]), int(p[-1]) + 1) for p in pieces] + [(rows, rows)] * (ranks - len(pieces))
    assert row_chunks(rows, ranks) == expected


@pytest.mark.claim("fsdp2-sync-plan")
@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 2), (3, 1)])
def test_the_planner_moves_fsdp2_shards_into_sglang_exactly_once_at_the_bound(family, dp, tp):
    model = TINY_MODELS[family]
    source = fsdp_layout(model, ParallelLayout(dp=dp), dtype="float32")
    for rank in range(dp):  # every rank has every parameter, its rows as torch.chunk gives them
        for name, shape in source.param_shapes(rank).items():
            rows = source.tensors[name].shape[0]
            start, stop = row_chunks(rows, dp)[rank]
            assert shape == (stop - start, *source.tensors[name].shape[1:])
    destination = sglang_layout(model, SGLangSettings(tp=tp), dtype="float32")
    topology = Topology.colocated(dp, num_destination=tp)
    plan = plan_reshard(source, destination, topology)
    _check_exactly_once(_coverage(plan, destination))
    _check_sources(plan, source)
    stats = plan_stats(plan, bandwidth=Bandwidth(intra_node_gbps=200.0, inter_node_gbps=25.0))
    assert stats.bytes == stats.lower_bound_bytes == _brute_lower_bound(source, destination, topology)


def test_moe_families_and_model_parallel_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="model.family=qwen3_moe: the FSDP2 weight layout of fused MoE experts"):
        fsdp_layout(TINY_MODELS["qwen3_moe"], ParallelLayout(dp=2))
    with pytest.raises(ValueError, match="FSDP2 shards over data and sequence parallel alone"):
        fsdp_layout(TINY_MODELS["llama"], ParallelLayout(tp=2, dp=1))


@pytest.mark.claim("fsdp2-ulysses")
def test_sequence_parallel_ranks_hold_shards_too():
    """Under Ulysses (``cp``) every rank of the world holds a share of each parameter: dp=1 x
    cp=2 is laid out as dp=2 is."""
    model = TINY_MODELS["llama"]
    ulysses, data = fsdp_layout(model, ParallelLayout(dp=1, cp=2)), fsdp_layout(model, ParallelLayout(dp=2))
    assert ulysses.num_ranks == 2
    assert all(ulysses.param_shapes(rank) == data.param_shapes(rank) for rank in range(2))
