"""The benchmarks behind the README's measured tables, run small: each still measures what its
table reports (slow tier: the figures are measurements on this machine, the tests prove the
scripts compute them). ``benchmarks/reshard_plan``, ``lora_cost`` and ``rollout_data`` have tests of
their own in the default tier, ``reshard_exec`` one of its own in the slow tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path, *args: str, timeout: int = 1400) -> dict:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, script, *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.claim("adapter-push-benchmark")
def test_adapter_push_benchmark_moves_fewer_bytes(tmp_path) -> None:
    result = _run("benchmarks/adapter_push.py", tmp_path, "--hidden", "64", "--layers", "2", "--rank", "4")
    assert 0 < result["adapter_push_bytes"] < result["merged_push_bytes"]
    assert result["adapter_push_seconds"] > 0 and result["merged_push_seconds"] > 0
    assert result["generate_seconds_base"] > 0 and result["generate_seconds_adapter"] > 0


@pytest.mark.claim("async-benchmark")
def test_async_rl_benchmark_runs_each_mode(tmp_path) -> None:
    result = _run(
        "benchmarks/async_rl.py", tmp_path, "--steps", "3", "--sft-steps", "20", "--modes", "sync,async_partial"
    )
    modes = {m["label"]: m for m in result["modes"]}
    assert set(modes) == {"sync", "async_partial"}
    assert all(m["steps_per_second"] > 0 and m["heldout_reward"] is not None for m in modes.values())
    assert modes["sync"]["overlap_fraction"] == 0 and modes["async_partial"]["overlap_fraction"] > 0
    assert modes["async_partial"]["partial_rollout"] is True


@pytest.mark.claim("convert-benchmark")
def test_convert_benchmark_round_trips_in_bounded_memory(tmp_path) -> None:
    result = _run(
        "benchmarks/convert.py",
        tmp_path,
        "--target-bytes",
        "64M",
        "--buffer-bytes",
        "8M",
        "--workdir",
        str(tmp_path / "work"),
    )
    assert result["round_trip_bitwise"] is True
    assert result["checkpoint_bytes"] >= 64 * 2**20 * 0.9
    for way in ("hf_to_mcore", "mcore_to_hf"):
        assert result[f"{way}_gbps"] > 0 and result[f"{way}_rss_above_idle_bytes"] < result["checkpoint_bytes"]


@pytest.mark.claim("load-pretrained-benchmark")
def test_load_pretrained_benchmark_reads_each_ranks_share_in_bounded_memory(tmp_path) -> None:
    result = _run(
        "benchmarks/load_pretrained.py",
        tmp_path,
        "--target-bytes",
        "200M",
        "--buffer-bytes",
        "32M",
        "--workdir",
        str(tmp_path),
    )
    cases = {case["layout"].split()[0]: case for case in result["cases"]}
    assert set(cases) == {"ep2", "tp2"}
    for case in cases.values():
        assert case["checkpoint_bytes"] >= 200 * 2**20 * 0.9
        assert all(0 < share < case["checkpoint_bytes"] for share in case["rank_share_bytes"])
        assert case["rss_within_share_plus_two_buffers"] is True
        assert case["load_seconds"] > 0 and case["plain_read_seconds"] > 0


@pytest.mark.claim("efficiency-benchmark")
def test_efficiency_benchmark_packs_fewer_tokens(tmp_path) -> None:
    result = _run("benchmarks/efficiency.py", tmp_path, "--rows", "8", "--steps", "1")
    assert result["packed_tokens"] == result["packed_budget_tokens"] == result["real_tokens"]
    assert result["padded_tokens"] >= result["padded_trimmed_tokens"] > result["real_tokens"]
    assert result["tokens_ratio_vs_padded"] > 1 and result["loss_spread"] < 1e-3  # the same loss in every mode


@pytest.mark.claim("user-mistakes-table")
def test_user_mistakes_table_prints_every_row(tmp_path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "scripts/user_mistakes.py",
            "--work",
            str(tmp_path / "work"),
            "--json",
            str(tmp_path / "table.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "table.json").read_text())
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    assert len(rows) == len(table) >= 44
    for row in rows:
        assert row["last_lines"] and isinstance(row["exit"], int), row  # what the user saw, and how it ended
        assert row["left"] == [], row  # no process of the job outlives it


@pytest.mark.claim("startup-benchmark")
def test_startup_benchmark_splits_the_time_to_the_first_step_into_phases(tmp_path) -> None:
    result = _run("benchmarks/startup.py", tmp_path, "--shapes", "colocated")
    (case,) = result["cases"]
    phases = case["phases"]
    from hybridflow.runtime.startup_clock import PHASES

    assert case["shape"] == "colocated" and tuple(phases) == ("launcher", *PHASES[1:])
    assert all(seconds >= 0 for seconds in phases.values())
    assert abs(sum(phases.values()) - case["seconds_to_first_step"]) < 0.1


@pytest.mark.claim("train-step-benchmark")
def test_train_step_benchmark_times_both_trainers_on_the_same_batches(tmp_path) -> None:
    result = _run("benchmarks/train_step.py", tmp_path, "--steps", "2", "--warmup", "1", "--seq", "64")
    assert result["policy_step_seconds"] > 0 and result["plain_loop_step_seconds"] > 0
    assert len(result["policy_seconds"]) == len(result["plain_loop_seconds"]) == 2
    assert result["policy_over_plain"] == pytest.approx(
        result["policy_step_seconds"] / result["plain_loop_step_seconds"], rel=1e-2
    )


@pytest.mark.claim("fsdp2-step-benchmark")
def test_fsdp2_step_benchmark_times_three_trainers_on_the_same_batches(tmp_path) -> None:
    result = _run("benchmarks/fsdp2_step.py", tmp_path, "--steps", "2", "--warmup", "1", "--seq", "64", "--chunk", "32")
    assert set(result["seconds"]) == {"fsdp2", "plain_fsdp2", "megatron"}
    assert all(len(times) == 2 for times in result["seconds"].values())
    assert result["fsdp2_over_plain"] == pytest.approx(
        result["fsdp2_step_seconds"] / result["plain_fsdp2_step_seconds"], rel=1e-2
    )


@pytest.mark.claim("fsdp2-ulysses")
def test_sequence_parallel_benchmark_halves_a_long_rows_peak_at_the_same_loss(tmp_path) -> None:
    result = _run("benchmarks/fsdp2_sequence_parallel.py", tmp_path, "--seq", "2048")
    assert result["sp2_over_sp1"] < 0.8, result
    assert result["loss"]["sp1"] == pytest.approx(result["loss"]["sp2"], abs=1e-5)


@pytest.mark.claim("reward-scoring-benchmark")
def test_reward_scoring_benchmark_scores_like_transformers(tmp_path) -> None:
    result = _run("benchmarks/reward_scoring.py", tmp_path, "--rows", "32", "--longest", "64", "--passes", "1")
    assert result["max_abs_score_diff"] < 1e-4  # the same scores, so the times compare like for like
    assert result["node_samples_per_s"] > 0 and result["transformers_samples_per_s"] > 0
