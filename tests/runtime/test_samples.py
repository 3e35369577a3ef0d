"""The run's figure and the samples writer's limits, without a run: panels by name, the size
budget, a full disk, the record choice."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from hybridflow.runtime.report import PANELS, run_figure
from hybridflow.runtime.samples import SampleWriter, chosen
from hybridflow.runtime.state import RunState
from hybridflow.sample_files import pick, read


def _state(steps: int) -> RunState:
    history = []
    for step in range(1, steps + 1):
        history.append({
            "step": step, "reward/mean": step / steps, "response_length/mean": 10.0 + step,
            "response_length/clip_ratio": 0.1, "actor/entropy": 1.0 / step, "actor/ppo_kl": 1e-3,
            "actor/clipfrac": 0.02, "actor/grad_norm": 0.5, "timing/generate": 2.0, "timing/update_actor": 1.0,
        })  # fmt: skip
    return RunState(step=steps, history=history, heldout=[(0, 0.2), (steps, 0.9)])


@pytest.mark.claim("run-figure")
def test_the_run_figure_has_every_panel_by_name_each_with_its_curves() -> None:
    fig = run_figure(_state(5))
    panels = [ax for ax in fig.axes if ax.get_title()]  # the twin axes of two panels have none
    assert [ax.get_title() for ax in panels] == list(PANELS)
    reward, length, entropy, kl, grad, timing = panels
    assert [line.get_label() for line in reward.get_lines()] == ["train", "held-out"]
    assert list(reward.get_lines()[1].get_xdata()) == [0, 5]
    for ax in (length, entropy, kl, grad):
        assert ax.get_lines() and len(ax.get_lines()[0].get_xdata()) == 5
    assert {t.get_text() for t in timing.get_legend().get_texts()} == {"generate", "update_actor"}
    twins = [ax for ax in fig.axes if not ax.get_title()]
    assert sorted(ax.get_ylabel() for ax in twins) == ["clip fraction", "clip ratio"]


def test_whole_groups_are_chosen_up_to_the_count() -> None:
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    assert chosen(groups, 8) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert chosen(groups, 5) == [0, 1, 2, 3, 4]  # the count bounds it, mid-group if it must
    assert chosen(groups, 0) == [] and chosen(groups, 100) == list(range(12))


def _records(step: int, count: int) -> list[dict]:
    return [{"step": step, "sample": i, "reward": float(i % 3), "data_source": "max" if i % 2 else "gsm8k",
             "response": "x" * 100} for i in range(count)]  # fmt: skip


def test_the_oldest_step_files_go_past_the_budget_and_held_out_files_stay(tmp_path: Path) -> None:
    writer = SampleWriter(tmp_path, budget_mb=0.004)  # ~4 KB: two step files of ~1.6 KB each
    writer.write("heldout_step_000000.jsonl", _records(0, 4))
    for step in range(1, 6):
        writer.write(f"step_{step:06d}.jsonl", _records(step, 12))
    names = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert names[0] == "heldout_step_000000.jsonl" and names[-1] == "step_000005.jsonl"
    assert "step_000001.jsonl" not in names and len(names) <= 3
    assert [r["sample"] for r in read(tmp_path / "samples" / "step_000005.jsonl")] == list(range(12))


@pytest.mark.claim("samples-disk-full")
def test_a_full_disk_is_said_once_and_training_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    import hybridflow.runtime.samples as samples

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(samples, "write_atomic", full)
    writer = SampleWriter(tmp_path, budget_mb=200)
    with caplog.at_level(logging.WARNING, logger=samples.__name__):
        assert writer.write("step_000001.jsonl", _records(1, 2)) is None
        assert writer.write("step_000002.jsonl", _records(2, 2)) is None  # not tried again, not said again
    (record,) = caplog.records
    assert record.getMessage() == (
        f"samples: could not write step_000001.jsonl ([Errno 28] No space left on device: "
        f"'{tmp_path / 'samples' / 'step_000001.jsonl'}'); training goes on without writing samples"
    )


def test_picks_by_reward_at_random_and_by_data_source() -> None:
    records = _records(3, 6)
    assert [r["sample"] for r in pick(records, "best", 2)] == [2, 5]
    assert [r["sample"] for r in pick(records, "worst", 2)] == [0, 3]
    assert [r["sample"] for r in pick(records, "first", 2, source="max")] == [1, 3]
    assert pick(records, "random", 6, seed=1) == pick(records, "random", 6, seed=1) != records
    with pytest.raises(ValueError, match="no samples with data_source 'aime' here; there are: gsm8k, max"):
        pick(records, "best", 2, source="aime")
    assert json.dumps(records)  # records are plain JSON
