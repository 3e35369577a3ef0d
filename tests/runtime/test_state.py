"""Resume that explains itself (``hybridflow.runtime.state``): a damaged checkpoint is named with
its file and passed over or refused by ``run.resume_fallback``; a changed config is named key by key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hybridflow.config import load_config, to_yaml
from hybridflow.runtime import state
from tests.runtime.run_dirs import checkpoint, shard

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml")


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """sft, step 2 and step 4, all complete."""
    for name, step in (("sft", 0), ("step_000002", 2), ("step_000004", 4)):
        checkpoint(tmp_path, name, step)
    return tmp_path


def test_a_complete_checkpoint_has_no_problem(run_dir: Path) -> None:
    assert state.checkpoint_problem(run_dir / "checkpoints" / "step_000004") is None
    assert state.find_resume(run_dir, "auto") == state.Resume(path=run_dir / "checkpoints" / "step_000004")


def test_a_missing_shard_is_named_and_the_run_falls_back_to_the_previous_checkpoint(run_dir: Path) -> None:
    newest = run_dir / "checkpoints" / "step_000004"
    missing = shard(newest)
    missing.unlink()
    problem = state.checkpoint_problem(newest)
    assert problem == f"{missing} is missing (listed in .metadata)"
    found = state.find_resume(run_dir, "auto", fallback="previous")
    assert found.path == run_dir / "checkpoints" / "step_000002" and found.damaged == ((newest, problem),)
    assert state.resume_point(run_dir, "auto", set_aside_damaged=True) == found.path
    assert (run_dir / "checkpoints" / "step_000004.damaged").is_dir() and not newest.exists()
    assert [p.name for p in state.checkpoint_dirs(run_dir)] == ["step_000002"]  # pruning no longer sees it


@pytest.mark.claim("damaged-checkpoint-set-aside")
def test_under_stop_a_damaged_newest_checkpoint_refuses_the_start_naming_the_file(run_dir: Path) -> None:
    missing = shard(run_dir / "checkpoints" / "step_000004")
    missing.unlink()
    with pytest.raises(ValueError) as error:
        state.find_resume(run_dir, "auto", fallback="stop")
    message = str(error.value)
    assert message.startswith(f"checkpoint step_000004 is damaged: {missing} is missing (listed in .metadata)")
    assert "set run.resume_fallback=previous" in message and "\n" not in message


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda c: shard(c).write_bytes(b"x"), r"__0_0.distcp is truncated \(1 bytes, .metadata lists \d+\)"),
        (lambda c: (c / "actor" / ".metadata").unlink(), r"actor/.metadata is missing"),
        (lambda c: (c / "actor" / ".metadata").write_bytes(b"not a pickle"), r"actor/.metadata is unreadable"),
        (lambda c: (c / "actor" / "common.pt").unlink(), r"actor/common.pt is missing"),
        (lambda c: (c / "actor" / "hybridflow.json").write_text("{"), r"actor/hybridflow.json is unreadable"),
        (lambda c: (c / "state.json").unlink(), r"step_000004/state.json is missing or unreadable"),
    ],
)
@pytest.mark.claim("checkpoint-checksums")
def test_each_kind_of_damage_names_its_file(run_dir: Path, damage, expected) -> None:
    newest = run_dir / "checkpoints" / "step_000004"
    damage(newest)
    assert state.checkpoint_problem(newest) is not None
    assert pytest.raises(ValueError, state.find_resume, run_dir, "auto", fallback="stop").match(expected)


def test_no_complete_checkpoint_left_is_refused(run_dir: Path) -> None:
    for name in ("sft", "step_000002", "step_000004"):
        shard(run_dir / "checkpoints" / name).unlink()
    with pytest.raises(
        ValueError,
        match=r"no complete checkpoint in .*checkpoints \(newest: step_000004: .*"
        r"restore the files, or set a new run.output_dir",
    ):
        state.find_resume(run_dir, "auto")
    with pytest.raises(ValueError, match="already holds checkpoints"):
        state.find_resume(run_dir, "never")


def _resolved(*overrides: str) -> dict:
    return yaml.safe_load(to_yaml(load_config(QUICKSTART, list(overrides))))


@pytest.mark.claim("model-change-refused")
def test_a_model_change_is_named_key_by_key_and_other_changes_are_reported() -> None:
    before = _resolved()
    blocking, other = state.config_changes(
        before, _resolved("model.num_layers=4", "model.vocab_size=512", "run.steps=40")
    )
    assert blocking == ["model.num_layers: 2 -> 4", "model.vocab_size: 320 -> 512"]
    assert other == ["run.steps: 30 -> 40"]
    blocking, other = state.config_changes(before, _resolved("model.rope_theta=20000.0"))
    assert blocking == [] and other == ["model.rope_theta: 10000.0 -> 20000.0"]  # same shapes: it loads
    del before["run"]["resume_fallback"]  # a field added since that run, at its default: no change
    before["model"]["dropped_field"] = 1  # one removed since: reported, not refused (megatron has the last word)
    assert state.config_changes(before, _resolved()) == ([], ["model.dropped_field: 1 -> (no such key now)"])


def test_resume_compares_with_the_checkpoint_config_first_and_refuses_a_model_it_cannot_load(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(QUICKSTART)))  # the first start's
    path = checkpoint(tmp_path, "step_000002", 2, config=to_yaml(load_config(QUICKSTART, ["train.lr=0.01"])))
    assert state.check_config_loads(path, tmp_path, _resolved("train.lr=0.01")) == []
    assert state.check_config_loads(path, tmp_path, _resolved()) == ["train.lr: 0.01 -> 0.001"]
    with pytest.raises(ValueError) as error:
        state.check_config_loads(path, tmp_path, _resolved("train.lr=0.01", "model.hidden_size=128"))
    message = str(error.value)
    assert message.startswith(
        "checkpoint step_000002 holds a different model than this config "
        f"(model.hidden_size: 64 -> 128; saved under {path / 'config.yaml'})"
    )
    assert "restore those model keys" in message and "\n" not in message


def test_the_fault_harness_checks_checkpoints_as_resume_does(run_dir: Path) -> None:
    from hybridflow.faults import check_checkpoints

    assert check_checkpoints(run_dir) == []
    missing = shard(run_dir / "checkpoints" / "step_000002")
    missing.unlink()
    assert check_checkpoints(run_dir) == [
        f"{run_dir / 'checkpoints' / 'step_000002'}: {missing} is missing (listed in .metadata)"
    ]
