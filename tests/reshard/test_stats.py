"""Statistics on hand-computed examples: bytes, baseline, bound, simulated time."""

import numpy as np
import pytest

from hfschema.layout import ParallelLayout
from hfschema.sglang import SGLangSettings
from reshard import Bandwidth, Topology, megatron_layout, plan_reshard, plan_stats, sglang_layout
from reshard import stats as stats_module
from reshard.families import DTYPE_BYTES
from reshard.topology import Device
from tests.reshard.cases import TINY_MODELS, random_cases

MODEL = TINY_MODELS["llama"]  # H 16, 4 layers, 4 heads x 4, 2 kv heads, ffn 24, vocab 200


def _elements():
    m = MODEL
    h, d = m.hidden_size, m.kv_channels
    q_rows = m.num_attention_heads * d
    attention = (q_rows + 2 * m.num_kv_heads * d) * h + h * q_rows
    per_layer = 2 * h + attention + 3 * m.ffn_hidden_size * h
    replicated = m.num_layers * 2 * h + h  # norms
    return 2 * m.vocab_size * h + h + m.num_layers * per_layer, replicated


def _plan(topology):
    source = megatron_layout(MODEL, ParallelLayout())
    destination = sglang_layout(MODEL, SGLangSettings(tp=2))  # vocab 200 -> 256: 128 rows a rank
    return plan_reshard(source, destination, topology)


def test_one_source_to_two_remote_ranks():
    model_elems, replicated = _elements()
    stats = plan_stats(
        _plan(Topology.separate(1, 2, gpus_per_node=2)),
        bandwidth=Bandwidth(intra_node_gbps=100.0, inter_node_gbps=10.0),
    )
    # each split element goes to one rank, each replicated one (norms) to both; bf16. The norms
    # cross the network once into the node, and one rank forwards them to the other over NVLink
    want = 2 * (model_elems + replicated)
    assert stats.bytes == stats.lower_bound_bytes == want
    assert stats.inter_node_bytes == stats.node_lower_bound_bytes == 2 * model_elems
    assert stats.intra_node_bytes == stats.relay_bytes == 2 * replicated
    assert stats.local_bytes == 0 and stats.node_ratio == 1.0 and stats.max_hop == 1
    assert stats.max_sent_bytes == 2 * model_elems
    assert stats.baseline_bytes == 2 * 2 * model_elems  # both ranks get the whole model
    assert stats.ratio_to_lower_bound == 1.0
    assert stats.baseline_ratio == pytest.approx(2 * model_elems / (model_elems + replicated))
    # the one source NIC carries the model: the busiest link
    assert stats.simulated_seconds == pytest.approx(2 * model_elems / 10e9)
    # the bound: the node's two NICs at once (source sends are not counted in it)
    assert stats.time_lower_bound_seconds == pytest.approx(2 * model_elems / (2 * 10e9))


def test_same_node_uses_intra_bandwidth_and_local_is_free():
    topology = Topology(source=(Device(node=0, gpu=0),), destination=(Device(node=0, gpu=0), Device(node=0, gpu=1)))
    stats = plan_stats(_plan(topology), bandwidth=Bandwidth(intra_node_gbps=100.0, inter_node_gbps=25.0))
    assert stats.local_bytes > 0 and stats.inter_node_bytes == 0
    assert stats.bytes == stats.intra_node_bytes == stats.lower_bound_bytes
    assert stats.max_received_bytes == stats.bytes  # rank 1 receives everything that moves
    assert stats.simulated_seconds == pytest.approx(stats.bytes / 100e9)


def test_as_dict_and_describe():
    stats = plan_stats(
        _plan(Topology.colocated(1, num_destination=2)),
        bandwidth=Bandwidth(intra_node_gbps=200.0, inter_node_gbps=25.0),
    )
    d = stats.as_dict()
    assert {
        "bytes",
        "lower_bound_bytes",
        "baseline_bytes",
        "simulated_seconds",
        "ratio_to_lower_bound",
        "baseline_ratio",
    } <= set(d)
    text = stats.describe()
    assert "lower bound" in text and "baseline" in text and "simulated" in text


def _masks(shards, shape, ranks_to_key) -> dict:
    """key -> boolean mask of the tensor's elements the shards give that key (a rank, a node)."""
    out: dict = {}
    for s in shards:
        for key in {ranks_to_key(r) for r in s.ranks}:
            mask = out.setdefault(key, np.zeros(shape, bool))
            mask[tuple(slice(a, b) for a, b in s.region)] = True
    return out


@pytest.mark.parametrize("case", random_cases(seed=31, count=60), ids=str)
def test_what_each_rank_and_node_lacks_is_what_an_element_count_finds(case) -> None:
    """The bounds' per-rank and per-node shortfalls (the bytes a rank needs that its node does
    not hold; the bytes a node needs that it does not hold) against element-by-element masks,
    EPLB's redundant experts included (a cache keyed by a rank tuple that was freed once gave
    another tuple's nodes)."""
    source, destination = case.build()
    topology = case.topology
    want_rank = np.zeros(destination.num_ranks, np.int64)
    want_node: dict[int, int] = {}
    for name, tensor in destination.tensors.items():
        itemsize = DTYPE_BYTES[tensor.dtype]
        held = _masks(source.shards[name], tensor.shape, lambda r: topology.source[r].node)
        needed = _masks(destination.shards[name], tensor.shape, lambda r: r)
        nothing = np.zeros(tensor.shape, bool)
        by_node: dict[int, np.ndarray] = {}
        for rank, mask in needed.items():
            node = topology.destination[rank].node
            want_rank[rank] += int((mask & ~held.get(node, nothing)).sum()) * itemsize
            by_node[node] = by_node.get(node, nothing) | mask
        for node, mask in by_node.items():
            want_node[node] = want_node.get(node, 0) + int((mask & ~held.get(node, nothing)).sum()) * itemsize
    assert stats_module._rank_missing(source, destination, topology).tolist() == want_rank.tolist()
    got = stats_module.node_missing_bytes(source, destination, topology)
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want_node.items() if v}
