"""Each data-parallel rank receives its own rollout rows, and batch-wide statistics over the
split rows equal one process's over the whole batch (torchrun, 4 gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.runtime.shares import balanced_owners, owner

pytestmark = [pytest.mark.distributed]

WORKER = Path(__file__).with_name("shares_worker.py")


@pytest.mark.claim("dp-ranks-receive-their-rows")
def test_owners_are_contiguous_whole_groups_and_balanced():
    for prompts, dp in ((7, 2), (7, 4), (16, 4), (3, 4)):
        owners = [owner(p, prompts, dp) for p in range(prompts)]
        assert owners == sorted(owners) and all(0 <= o < dp for o in owners)
        counts = [owners.count(d) for d in range(dp)]
        assert max(counts) - min(counts) <= 1


@pytest.mark.claim("token-budget-balance")
def test_token_balanced_owners_keep_the_prompt_counts_and_even_out_the_tokens():
    # one long-tail prompt per block of 4: the blocks put all the long ones on rank 0
    tokens = [800 if p % 4 == 0 and p < 8 else 100 for p in range(16)]
    blocks = [owner(p, 16, 2) for p in range(16)]
    balanced = balanced_owners(tokens, 2)

    def load(owners: list[int]) -> list[int]:
        return [sum(t for t, o in zip(tokens, owners) if o == r) for r in range(2)]

    assert load(blocks) == [2200, 800] and load(balanced) == [1500, 1500]
    assert sorted(balanced) == sorted(blocks)  # every rank keeps its number of prompts (groups)
    assert balanced_owners(tokens, 2) == balanced  # the same on every rank: ties by index
    assert balanced_owners([5, 5, 5], 1) == [0, 0, 0]


@pytest.mark.claim("dp-ranks-receive-their-rows")
@pytest.mark.parametrize("tp", [1, 2], ids=["dp4", "tp2xdp2"])
def test_every_rank_receives_exactly_its_dp_ranks_samples(tmp_path, tp):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        str(WORKER),
        str(tmp_path),
        str(tp),
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    covered = set()
    for rank, r in enumerate(ranks):
        assert r["positions"] == r["expected"] and r["same"] and all(r["same"])
        assert r["metas"] == 21 and r["gather_equal"]
        assert r["whiten_diff"] < 1e-6, r["whiten_diff"]
        assert max(r["estimator_diff"].values()) < 1e-6, r["estimator_diff"]
        covered |= set(r["positions"])
        if rank not in (0, 3):  # not a driver: all it holds arrived point to point
            assert r["received_bytes"] > 0
    assert covered == set(range(21))
    # TP peers hold the same rows; different DP ranks hold disjoint rows
    for a in range(4):
        for b in range(a + 1, 4):
            same_dp = a // tp == b // tp
            overlap = set(ranks[a]["positions"]) & set(ranks[b]["positions"])
            assert (ranks[a]["positions"] == ranks[b]["positions"]) if same_dp else not overlap


@pytest.mark.claim("rollout-data-benchmark")
def test_the_rollout_data_benchmark_measures_shares_against_the_broadcast(tmp_path):
    out = tmp_path / "rollout_data.json"
    cmd = [
        sys.executable,
        "benchmarks/rollout_data.py",
        "--samples",
        "64",
        "--tokens",
        "32",
        "--ranks",
        "4",
        "--json",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-4000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case["every_rank_got_its_rows"]
    assert case["sharded"]["received_bytes_max"] == case["share_bytes"]  # 8 prompts split evenly over 4
    assert case["broadcast"]["received_bytes_max"] == case["total_bytes"]
    assert case["broadcast"]["pickled_bytes_per_rank"] > case["total_bytes"]
