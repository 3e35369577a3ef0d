"""Property tests of the planner over seeded random layout pairs of every family.

For each case: every destination element is written exactly once (vocab padding rows never);
every transfer reads a box its source rank really holds, at the place it holds it; the kind
matches the devices; the bytes across devices equal the lower bound, computed here by brute
force over element masks (independently of the planner and of ``reshard.stats``); the plan is
deterministic. ``hypothesis`` is not installed in the venv, so the cases are drawn from a
seeded ``random.Random`` (tests/reshard/cases.py).
"""

import dataclasses

import numpy as np
import pytest

from hfschema.layout import ParallelLayout
from hfschema.sglang import SGLangSettings
from reshard import Bandwidth, Topology, megatron_layout, plan_reshard, plan_stats, sglang_layout
from reshard.families import DTYPE_BYTES
from reshard.regions import map_into
from reshard.topology import Device
from tests.reshard.cases import TINY_MODELS, random_cases

BANDWIDTH = Bandwidth(intra_node_gbps=200.0, inter_node_gbps=25.0)

CASES = random_cases(seed=3, count=240)
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


def _box(region):
    return tuple(slice(a, b) for a, b in region)


def _contains(outer, inner):
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _coverage(plan, destination):
    counts = {
        r: {k: np.zeros(s, np.int32) for k, s in destination.param_shapes(r).items()}
        for r in range(destination.num_ranks)
    }
    for t in plan.transfers():
        for param, region in ((t.dst_param, t.dst_region), *t.also):
            counts[t.dst_rank][param][_box(region)] += 1
    return counts


def _check_exactly_once(counts):
    for rank, params in counts.items():
        for name, c in params.items():
            if name in VOCAB_PARAMS:
                rows = c.reshape(c.shape[0], -1)
                covered = rows.all(axis=1)
                # real rows first, padding rows (never written) after; none written twice
                assert rows.max(initial=0) <= 1 and (rows.min(axis=1) == rows.max(axis=1)).all()
                assert not covered[np.argmin(covered) :].any() if not covered.all() else True, name
            else:
                assert (c == 1).all(), (rank, name, np.unique(c))


def _check_sources(plan, source):
    """Source transfers read a box their rank holds; a relay forwards, from its own buffer, a box
    it received on an earlier route one hop shallower ("relays only forward what they got")."""
    held = {}
    for shards in source.shards.values():
        for s in shards:
            for r in s.ranks:
                held.setdefault((r, s.tensor), []).append(s)
    received = {}
    for t in plan.transfers():
        if t.relay:
            got = received.get((t.src_rank, t.tensor, t.region))
            assert got is not None and got.hop == t.hop - 1, t  # received before, one hop shallower
            assert (t.src_param, t.src_region) == (got.dst_param, got.dst_region), t
            received[(t.dst_rank, t.tensor, t.region)] = t
            continue
        received[(t.dst_rank, t.tensor, t.region)] = t
        assert any(
            s.param == t.src_param
            and _contains(s.region, t.region)
            and map_into(t.region, s.region, s.param_region) == t.src_region
            for s in held[(t.src_rank, t.tensor)]
        ), t


def _check_kinds(plan, topology):
    """Kinds match the devices (so relayed fan-out stays inside a node), and each box enters each
    destination node over the network at most once."""
    entered = set()
    for t in plan.transfers():
        a = (topology.destination if t.relay else topology.source)[t.src_rank]
        b = topology.destination[t.dst_rank]
        want = "local" if a == b else "intra" if a.node == b.node else "inter"
        assert t.kind == want, t
        assert not (t.relay and t.kind == "local"), t
        if t.kind == "inter":
            key = (b.node, t.tensor, t.region)
            assert key not in entered, t
            entered.add(key)


def _brute_lower_bound(source, destination, topology):
    """Needed bytes not on the destination's own device, by element masks."""
    total = 0
    for d in range(destination.num_ranks):
        masks = {}
        for s in range(source.num_ranks):
            if topology.source[s] != topology.destination[d]:
                continue
            for h in source.holdings(s).holdings:
                shape = destination.tensors[h.tensor].shape
                masks.setdefault(h.tensor, np.zeros(shape, bool))[_box(h.region)] = True
        needed = {(h.tensor, h.region): h for h in destination.holdings(d).holdings}
        for h in needed.values():  # a box held in two places is needed once
            itemsize = DTYPE_BYTES[destination.tensors[h.tensor].dtype]
            have = masks[h.tensor][_box(h.region)].sum() if h.tensor in masks else 0
            size = int(np.prod([b - a for a, b in h.region]))
            total += (size - int(have)) * itemsize
    return total


@pytest.mark.claim("reshard-only-missing-slices")
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.name}" for i, c in enumerate(CASES)])
def test_plan_properties(case):
    source, destination = case.build()
    plan = plan_reshard(source, destination, case.topology)
    _check_exactly_once(_coverage(plan, destination))
    _check_sources(plan, source)
    _check_kinds(plan, case.topology)

    stats = plan_stats(plan, bandwidth=BANDWIDTH)
    moved = sum(t.nbytes for t in plan.transfers() if t.kind != "local")
    assert stats.bytes == moved
    assert stats.num_transfers == sum(1 for _ in plan.transfers())
    assert stats.bytes == stats.lower_bound_bytes == _brute_lower_bound(source, destination, case.topology)
    # the node-level bound: exact (element by element), and no plan carries less over the network
    assert stats.node_lower_bound_bytes == _brute_node_bound(source, destination, case.topology)
    assert stats.node_lower_bound_bytes == stats.inter_node_bytes  # node-aware: at the bound
    assert stats.time_lower_bound_seconds <= stats.simulated_seconds * (1 + 1e-9)
    assert stats.relay_bytes == sum(t.nbytes for t in plan.transfers() if t.relay)

    again = plan_reshard(*case.build(), case.topology)
    assert list(plan.transfers()) == list(again.transfers())


def _brute_node_bound(source, destination, topology) -> int:
    """Per destination node and canonical tensor, element masks of what its ranks need and what
    its sources hold; the bound counts needed and not held, once per node."""
    total = 0
    for node in {d.node for d in topology.destination}:
        for name, shards in destination.shards.items():
            spec = destination.tensors[name]
            need = np.zeros(spec.shape, bool)
            held = np.zeros(spec.shape, bool)
            for s in shards:
                if any(topology.destination[r].node == node for r in s.ranks):
                    need[_box(s.region)] = True
            for s in source.shards.get(name, ()):
                if any(topology.source[r].node == node for r in s.ranks):
                    held[_box(s.region)] = True
            total += int((need & ~held).sum()) * DTYPE_BYTES[spec.dtype]
    return total


@pytest.mark.claim("reshard-node-aware-bounds")
def test_each_node_gets_the_model_once_from_balanced_holders_and_fans_it_out():
    """8 separate SGLang ranks on 2 nodes, each needing all of a TP1 model held by 4 DP replicas:
    the model crosses into each node once (from two different holders' NICs), then NVLink."""
    model = TINY_MODELS["llama"]
    source = megatron_layout(model, ParallelLayout(dp=4))
    destination = sglang_layout(model, SGLangSettings(num_replicas=8))
    plan = plan_reshard(source, destination, Topology.separate(4, 8, gpus_per_node=4), part_bytes=1024)
    stats = plan_stats(plan, bandwidth=BANDWIDTH)
    whole = stats.baseline_bytes // 8
    assert stats.inter_node_bytes == stats.node_lower_bound_bytes == 2 * whole
    assert stats.intra_node_bytes == 6 * whole and stats.relay_bytes >= 6 * whole
    inter = plan.route_kind == 2
    part = max(b.nbytes for b in plan.bundles)
    assert part <= 1024
    sent = np.bincount(
        plan.route_src[inter & ~plan.route_relay], plan.route_nbytes()[inter & ~plan.route_relay], minlength=4
    )
    assert (sent > 0).all(), sent  # every holder's NIC takes part
    took = np.bincount(plan.route_dst[inter], plan.route_nbytes()[inter], minlength=8)
    assert (took.reshape(2, 4).max(1) - took.reshape(2, 4).min(1) <= part).all(), took
    assert stats.time_ratio < 1.2


@pytest.mark.claim("reshard-node-aware-bounds")
def test_relays_carry_the_model_across_engine_nodes():
    """One trainer GPU, 8 engine nodes: direct sends would push 8 models through one NIC;
    relays forward it node to node, pipelined, so every NIC carries about one model."""
    model = TINY_MODELS["llama"]
    source = megatron_layout(model, ParallelLayout())
    destination = sglang_layout(model, SGLangSettings(num_replicas=8))
    topology = Topology.separate(1, 8, gpus_per_node=1)
    direct = plan_stats(plan_reshard(source, destination, topology, max_relays=0), bandwidth=BANDWIDTH)
    relayed_plan = plan_reshard(source, destination, topology)
    relayed = plan_stats(relayed_plan, bandwidth=BANDWIDTH)
    whole = direct.baseline_bytes // 8
    assert direct.max_sent_bytes == 8 * whole and direct.relay_bytes == 0
    assert relayed.inter_node_bytes == direct.inter_node_bytes == 8 * whole
    assert relayed.max_sent_bytes < 2 * whole and relayed.relay_bytes > 6 * whole
    assert relayed.time_ratio < 1.5 < direct.time_ratio
    assert relayed.max_hop >= 2


def test_bad_max_relays():
    model = TINY_MODELS["llama"]
    with pytest.raises(ValueError, match="max_relays is -1"):
        plan_reshard(
            megatron_layout(model, ParallelLayout()),
            sglang_layout(model, SGLangSettings()),
            Topology.colocated(1),
            max_relays=-1,
        )


def test_same_node_source_preferred_over_idle_remote_one():
    model = TINY_MODELS["llama"]
    source = megatron_layout(model, ParallelLayout(dp=2))
    destination = sglang_layout(model, SGLangSettings(num_replicas=2))
    topo = Topology(
        source=(Device(node=0, gpu=0), Device(node=1, gpu=0)),
        destination=(Device(node=0, gpu=1), Device(node=0, gpu=2)),
    )
    plan = plan_reshard(source, destination, topo)
    assert set(plan.route_src.tolist()) == {0}
    assert {t.kind for t in plan.transfers()} == {"intra"}


@pytest.mark.claim("reshard-only-missing-slices")
def test_colocated_identical_layouts_move_nothing():
    model = dataclasses.replace(TINY_MODELS["qwen3_moe"], vocab_size=256)
    source = megatron_layout(model, ParallelLayout(tp=2, ep=2))
    destination = sglang_layout(model, SGLangSettings(tp=2, ep=2))
    stats = plan_stats(plan_reshard(source, destination, Topology.colocated(2)), bandwidth=BANDWIDTH)
    # megatron tp=2 ep=2 on 2 ranks: rank r holds attention tp shard r and experts of ep rank r,
    # exactly SGLang tp=2 ep=2's rank r
    assert stats.bytes == stats.lower_bound_bytes == 0
    # every split byte once, every replicated byte on both ranks
    assert stats.local_bytes == stats.baseline_bytes // 2 + _replicated_bytes(destination)


def _replicated_bytes(layout):
    return sum(
        layout.shard_nbytes(s) for shards in layout.shards.values() for s in shards if len(s.ranks) == layout.num_ranks
    )


def test_vocab_padding_differs_between_the_sides():
    """vocab 190 at tp=2: megatron pads to 256 (128 rows a rank), SGLang to 192 (96 a rank)."""
    model = TINY_MODELS["qwen3_moe"]
    source = megatron_layout(model, ParallelLayout(tp=2, ep=2))
    destination = sglang_layout(model, SGLangSettings(tp=2, ep=2))
    plan = plan_reshard(source, destination, Topology.colocated(2))
    moved = [t for t in plan.transfers() if t.kind != "local"]
    seen = {(t.tensor, t.region, t.src_rank, t.src_region, t.dst_rank, t.dst_region) for t in moved}
    assert seen == {
        (name, ((96, 128), (0, 16)), 0, ((96, 128), (0, 16)), 1, ((0, 32), (0, 16)))
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    assert plan_stats(plan, bandwidth=BANDWIDTH).bytes == 2 * 32 * 16 * 2


def test_model_mismatch_names_the_field():
    model = TINY_MODELS["llama"]
    other = dataclasses.replace(model, ffn_hidden_size=32)
    source = megatron_layout(model, ParallelLayout())
    destination = sglang_layout(other, SGLangSettings())
    with pytest.raises(ValueError, match=r"model\.ffn_hidden_size is 24 on the source .* 32"):
        plan_reshard(source, destination, Topology.colocated(1))


def test_dtype_mismatch_is_refused():
    model = TINY_MODELS["llama"]
    source = megatron_layout(model, ParallelLayout(), dtype="float32")
    destination = sglang_layout(model, SGLangSettings())
    with pytest.raises(ValueError, match="dtype differs"):
        plan_reshard(source, destination, Topology.colocated(1))


def test_rank_missing_from_topology():
    model = TINY_MODELS["llama"]
    source = megatron_layout(model, ParallelLayout(dp=2))
    destination = sglang_layout(model, SGLangSettings(tp=2, num_replicas=2))
    with pytest.raises(ValueError, match="destination rank 2 has no place in the topology"):
        plan_reshard(source, destination, Topology.colocated(2))
    with pytest.raises(ValueError, match="source rank 1 has no place"):
        plan_reshard(source, destination, Topology.colocated(1, num_destination=4))


def test_two_ranks_on_one_device_are_refused():
    model = TINY_MODELS["llama"]
    source = megatron_layout(model, ParallelLayout(dp=2))
    destination = sglang_layout(model, SGLangSettings(num_replicas=2))
    twice = Topology(
        source=(Device(node=0, gpu=0), Device(node=0, gpu=0)),
        destination=(Device(node=0, gpu=0), Device(node=0, gpu=1)),
    )
    with pytest.raises(ValueError, match="source ranks 0 and 1 are both on node 0 gpu 0"):
        plan_reshard(source, destination, twice)
    twice = Topology(
        source=(Device(node=0, gpu=0), Device(node=0, gpu=1)),
        destination=(Device(node=1, gpu=3), Device(node=1, gpu=3)),
    )
    with pytest.raises(ValueError, match="destination ranks 0 and 1 are both on node 1 gpu 3"):
        plan_reshard(source, destination, twice)


def test_per_rank_views_for_an_executor():
    """transfers_for(rank) partitions the plan by sender (source ranks and relaying destination
    ranks) and by receiver; holdings agree with param shapes."""
    case = CASES[3]
    source, destination = case.build()
    plan = plan_reshard(source, destination, case.topology)
    everything = sorted(map(repr, plan.transfers()))
    senders = [t for r in range(source.num_ranks) for t in plan.transfers_for(r, side="source")]
    senders += [t for r in range(destination.num_ranks) for t in plan.transfers_for(r, side="relay")]
    receivers = [t for r in range(destination.num_ranks) for t in plan.transfers_for(r, side="destination")]
    assert sorted(map(repr, senders)) == sorted(map(repr, receivers)) == everything
    for r in range(destination.num_ranks):
        held = destination.holdings(r)
        for h in held.holdings:
            shape = held.param_shapes[h.param]
            assert all(0 <= a < b <= n for (a, b), n in zip(h.param_region, shape))
    with pytest.raises(ValueError, match="sglang rank 99 does not exist"):
        destination.holdings(99)


@pytest.mark.parametrize("case", CASES[::4], ids=lambda c: c.name)
def test_the_planners_heaps_choose_what_scanning_every_candidate_chooses(case):
    """The planner keeps its candidates in heaps updated lazily; the rule, scanning them all
    (tests/reshard/greedy_reference.py), must give the same routes, in the same order."""
    from tests.reshard.greedy_reference import reference_routes

    source, destination = case.build()
    for relays in (8, 1):
        plan = plan_reshard(source, destination, case.topology, max_relays=relays, part_bytes=4096)
        src, relay, dst, kind, hop, bundle = reference_routes(
            source, destination, case.topology, max_relays=relays, part_bytes=4096
        )
        assert np.array_equal(plan.route_src, src) and np.array_equal(plan.route_dst, dst)
        assert np.array_equal(plan.route_kind, kind) and np.array_equal(plan.route_relay, relay)
        assert np.array_equal(plan.route_hop, hop) and np.array_equal(plan.route_bundle, bundle)
