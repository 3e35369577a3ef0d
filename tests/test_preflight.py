"""What ``hybridflow train`` checks before any rank starts (``hybridflow.preflight``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.preflight import check_runtime_support, preflight

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart_cpu.yaml")


@pytest.mark.parametrize("overrides, key", [
    (["rollout.num_replicas=2", "rollout.tp=1", "rollout.sync_route=full"], "rollout.num_replicas=2 with"),
    (["rollout.placement=separate", "rollout.engine=hf", "rollout.sync_route=full", "rollout.tp=1"],
     "rollout.placement=separate with rollout.engine=hf"),
    (["rollout.placement=separate", "rollout.gpus_per_node=1"], "separate engines spanning nodes"),
    (["rollout.gpus_per_node=3", "rollout.tp=4", "actor.parallel.dp=4"], "rollout.tp=4 does not fill whole nodes"),
    (["critic.enabled=true", "algorithm.name=ppo", "critic.parallel.ep=1"], "critic.parallel differs"),
    (["reference.enabled=true", "reference.parallel.ep=1"], "reference.parallel differs"),
])
def test_what_the_runtime_cannot_run_is_refused_with_the_key_and_the_fix(overrides, key):
    cfg = load_config(QUICKSTART, overrides)
    with pytest.raises(ValueError, match=key) as error:
        check_runtime_support(cfg)
    assert "set " in str(error.value)


def test_the_quickstart_passes_preflight(tmp_path):
    preflight(load_config(QUICKSTART, [f"run.output_dir={tmp_path}"]))


def test_a_layout_that_needs_more_gpus_than_the_node_has_is_refused(tmp_path, monkeypatch):
    import torch

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}"])  # 2 ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("moe.routes.check_replay_device", lambda *a, **k: None)
    with pytest.raises(ValueError) as error:
        preflight(cfg)
    message = str(error.value)
    assert "actor.parallel needs 2 GPUs" in message and "this node has 1" in message
    assert "lower actor.parallel.dp" in message and "\n" not in message


def test_separate_placement_passes_for_train_and_counts_the_engine_ranks(tmp_path, monkeypatch):
    import torch

    from hybridflow.preflight import check_separate_nodes, process_count

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", "rollout.placement=separate"])
    preflight(cfg)  # 2 actor ranks + 2 engine ranks (tp=2)
    assert process_count(cfg) == 4
    preflight(cfg, command="launch")
    check_separate_nodes(cfg, 2)  # actor ranks on one node, the tp=2 engine on the next
    with pytest.raises(ValueError, match="engine replica 0 \\(ranks 2..3\\) would span two nodes of 3"):
        check_separate_nodes(cfg, 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr("moe.routes.check_replay_device", lambda *a, **k: None)
    with pytest.raises(ValueError, match="actor.parallel \\+ the separate engine ranks needs 4 GPUs"):
        preflight(cfg)
