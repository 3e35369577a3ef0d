"""Routing replay, router statistics and router freezing on a tiny Qwen3-MoE / DeepSeek-V3 actor.

One torchrun job (2 processes) runs ``routing_worker.py``; see its docstring for the scenarios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("routing_worker.py")
SCENARIOS = ("replay", "tp2", "pp2", "frozen")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("routing") / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        str(out),
        *SCENARIOS,
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for name in SCENARIOS:
        for rank in (0, 1):
            assert f"OK {name} rank {rank}\n" in result.stdout
    return json.loads(out.read_text())


@pytest.mark.claim("routing-tests")
def test_recorded_routes_are_the_routers_choices_in_trainer_order(results: dict) -> None:
    # transformers' own fp32 router on the same weights and tokens: an independent implementation
    assert results["replay"]["recorded_vs_transformers_fp32"] == 1.0  # EP=2 x DP=2
    for layout in ("tp2", "pp2"):  # TP=2 with sequence parallelism; PP=2, two MoE layers a stage
        assert results[layout]["recorded_vs_transformers_fp32"] == 1.0, layout
        assert results[layout]["self_replay_match"] == 1.0, layout
        assert results[layout]["self_replay_max_logp_diff"] < 1e-5, layout
    assert results["tp2"]["length"] % 2 == 1  # the policy padded the sequence for TP


@pytest.mark.claim("routing-replay")
def test_replay_dispatches_every_token_to_the_recorded_experts(results: dict) -> None:
    r = results["replay"]
    assert r["replay_match_engine_routes"] == 1.0
    # R2: the second training step runs on updated weights whose own routing differs a lot
    assert r["r2_train_natural_vs_recorded_mismatch"] > 0.1
    assert r["r2_train_replay_match"] == 1.0
    assert r["r2_train_pairs_matched"] == r["r2_train_pairs_compared"] == r["real_tokens"] * r["layers"]


def test_replaying_the_engines_routes_lowers_the_logprob_mismatch(results: dict) -> None:
    r = results["replay"]
    assert r["engine_vs_trainer_topk_mismatch"] > 0  # the bf16 engine routed some tokens differently
    assert r["mismatch_with_replay"]["mean"] < r["mismatch_without_replay"]["mean"]
    assert r["mismatch_with_replay"]["max"] <= r["mismatch_without_replay"]["max"]


@pytest.mark.claim("router-statistics")
def test_distributed_statistics_equal_the_pure_functions(results: dict) -> None:
    assert results["replay"]["stats_match_pure_functions"]


@pytest.mark.claim("routing-tests")
def test_frozen_router_is_bit_identical_after_an_rl_step(results: dict) -> None:
    f = results["frozen"]
    for family in ("qwen3_moe", "deepseek_v3"):
        frozen, trained = f[f"{family}_frozen"], f[f"{family}_trained"]
        assert frozen["others_changed"] and trained["others_changed"]
        assert not any(frozen["router"].values()), frozen
        assert all(trained["router"].values()), trained
    assert any(name.endswith("expert_bias") for name in f["deepseek_v3_frozen"]["router"])


@pytest.mark.claim("routing-tests")
def test_expert_bias_travels_through_the_reshard_plan(results: dict) -> None:
    assert results["frozen"]["expert_bias_through_reshard"]


def test_aux_and_z_losses_reach_the_router(results: dict) -> None:
    assert results["frozen"]["aux_z_loss_changes_router_update"]
