"""Replica bookkeeping that needs no engine: who drives what, chunking, seeds, failure naming."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.runtime import replicas

QUICKSTART = "configs/quickstart_cpu.yaml"


def test_replica_drivers_are_the_first_rank_of_each_engine():
    cfg = load_config(QUICKSTART, ["rollout.tp=2", "rollout.num_replicas=2", "actor.parallel.dp=4"])
    assert [replicas.driver_rank(cfg, k) for k in range(2)] == [0, 2]
    assert [replicas.replica_of(cfg, r) for r in range(5)] == [0, None, 1, None, None]


@pytest.mark.claim("replicas-share-the-work")
def test_one_replica_takes_the_batch_whole_and_many_take_chunks():
    one = load_config(QUICKSTART)
    assert replicas._chunks(16, one) == [range(0, 16)]
    two = load_config(QUICKSTART, ["rollout.tp=1", "rollout.num_replicas=2", "rollout.dispatch_chunks=3"])
    chunks = replicas._chunks(16, two)
    assert len(chunks) == 6 and sum(len(c) for c in chunks) == 16 and chunks[0].start == 0
    assert replicas._chunks(3, two) == [range(0, 1), range(1, 2), range(2, 3)]  # never an empty chunk
    assert replicas.chunk_seed(11, 0) == 11 and len({replicas.chunk_seed(11, c) for c in range(6)}) == 6


@pytest.mark.claim("replica-failure-named")
def test_a_failed_replica_is_named_on_every_rank():
    report = replicas._Report
    gathered = [
        report(0, [], 1.0, None, 0),
        report(None, [], 0.0, None, 1),
        report(1, [], 0.0, "RuntimeError: engine died", 0),
    ]
    with pytest.raises(
        replicas.ReplicaFailed,
        match=r"rollout replica 1 \(driven by rank 2\) failed mid-generation: "
        r"RuntimeError: engine died; .*resume",
    ):
        replicas._raise_failures(gathered)
    replicas._raise_failures(gathered[:2])  # no failure: nothing raised


def test_a_call_whose_engines_returned_no_sample_raises_instead_of_training_on_nothing():
    """The combination matrix's first runs kept a run going whose generate calls all came back
    empty (each step scored nothing, trained nothing, reported a reward of nan): now it stops."""
    cfg = load_config(QUICKSTART)
    empty = [replicas._Report(0, [], 0.1, None, 0), replicas._Report(None, [], 0.0, None, 1)]
    with pytest.raises(RuntimeError, match="the rollout engines returned no sample for 8 prompts and named no error"):
        replicas._deliver(cfg, [], empty, 8, channel=None, device="cpu")


def test_the_engine_gets_the_parallel_settings_the_plan_assumed(monkeypatch, tmp_path):
    from hybridflow.rollout.sglang import start as sglang_start
    from hybridflow.runtime import session

    # (rollout.moe_dp > 1 is refused when the config is read: SGLang pairs it with attention CP)
    cfg = load_config(
        QUICKSTART, ["rollout.enable_dp_attention=true", "rollout.dp_size=2", "rollout.ep=1", "rollout.tp=2"]
    )
    assert sglang_start.engine_parallel_args(cfg) == {"attn_dp_size": 2}
    assert sglang_start.engine_parallel_args(load_config(QUICKSTART)) == {}
    seen = {}
    monkeypatch.setattr("hybridflow.rollout.make_engine", lambda name, **kwargs: seen.update(kwargs, name=name))
    session.start_engine(cfg, tmp_path)
    assert (seen["name"], seen["tp"], seen["attn_dp_size"], "moe_dp_size" in seen) == ("sglang", 2, 2, False)
    assert seen["bucket_bytes"] == cfg.rollout.push_bucket_mb << 20 and seen["load_format"] == "dummy"


@pytest.mark.claim("engine-spanning-nodes")
def test_engines_spanning_nodes_start_one_part_per_node():
    cfg = load_config(
        QUICKSTART,
        [
            "rollout.tp=4",
            "rollout.num_replicas=2",
            "rollout.gpus_per_node=2",
            "actor.parallel.dp=8",
            "actor.parallel.ep=2",
        ],
    )
    assert replicas.engine_nodes(cfg) == 2
    roles = {r: replicas.node_role(cfg, r) for r in range(8)}
    # replica 0 on ranks 0-3 (nodes of GPUs 0-1 and 2-3), replica 1 on ranks 4-7
    assert roles == {0: (0, 0), 1: None, 2: (0, 1), 3: None, 4: (1, 0), 5: None, 6: (1, 1), 7: None}
    assert [replicas.replica_of(cfg, r) for r in (0, 2, 4)] == [0, None, 1]  # node 0 parts drive
    from hybridflow.rollout.sglang import start as sglang_start

    assert sglang_start.node_args(cfg, 1, "10.0.0.1:1234") == {
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "10.0.0.1:1234",
    }
    assert sglang_start.node_args(load_config(QUICKSTART), 0, None) == {}
