"""Checkpoint checksums (``hybridflow.runtime.checksums``): written with a checkpoint, compared
before a resume, so bytes changed in place are found like a missing shard."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from hybridflow.runtime import checksums, state
from tests.runtime.run_dirs import checkpoint, shard


def _checksummed(root: Path, name: str, step: int) -> Path:
    """A checkpoint as ``worker._save`` leaves it: files, then the manifest, then state.json."""
    path = checkpoint(root, name, step)
    files = checksums.listed_files(path)
    halves = checksums.shares_of(path, files, 2)
    checksums.write_manifest(path, [checksums.hash_files(path, half) for half in halves])
    state.save_state(path, dataclasses.replace(state.read_state(path), checksummed=True))
    return path


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    for name, step in (("sft", 0), ("step_000002", 2), ("step_000004", 4)):
        _checksummed(tmp_path, name, step)
    return tmp_path


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_but_state_json_once(run_dir: Path) -> None:
    newest = run_dir / "checkpoints" / "step_000004"
    manifest = (newest / checksums.MANIFEST).read_text()
    assert f'"{shard(newest).relative_to(newest)}"' in manifest and "common.pt" in manifest
    assert "state.json" not in manifest
    assert state.checkpoint_problem(newest) is None


@pytest.mark.claim("checkpoint-checksums")
def test_a_byte_changed_in_place_is_named_and_the_run_falls_back(run_dir: Path) -> None:
    newest = run_dir / "checkpoints" / "step_000004"
    _flip_a_byte(shard(newest))
    problem = state.checkpoint_problem(newest)
    assert problem is not None and problem.startswith(f"{shard(newest)} has changed since it was written (CRC-32 ")
    assert state.checkpoint_problem(newest, content=False) is None  # sizes and .metadata still agree
    found = state.find_resume(run_dir, "auto")
    assert found.path == run_dir / "checkpoints" / "step_000002" and found.damaged == ((newest, problem),)
    with pytest.raises(ValueError, match=r"checkpoint step_000004 is damaged: .* has changed since it was written"):
        state.find_resume(run_dir, "auto", fallback="stop")


def test_a_changed_size_or_a_missing_manifest_is_named(run_dir: Path) -> None:
    newest = run_dir / "checkpoints" / "step_000004"
    with open(newest / "actor" / "common.pt", "ab") as f:
        f.write(b"tail")
    assert "common.pt has" in state.checkpoint_problem(newest) and "checksums.json lists" in state.checkpoint_problem(
        newest
    )
    (newest / checksums.MANIFEST).unlink()
    assert "checksums.json is missing or unreadable" in state.checkpoint_problem(newest)


def test_a_checkpoint_from_before_checksums_is_checked_as_before(tmp_path: Path) -> None:
    old = checkpoint(tmp_path, "step_000002", 2)  # no manifest, checksummed=False
    _flip_a_byte(shard(old))
    assert state.checkpoint_problem(old) is None


def test_the_checkpoint_preflight_compared_is_not_read_again(run_dir: Path, monkeypatch) -> None:
    newest = run_dir / "checkpoints" / "step_000004"
    _flip_a_byte(shard(newest))  # after preflight's comparison: the ranks would load it anyway
    monkeypatch.setenv(checksums.VERIFIED_ENV, str(newest))
    assert state.checkpoint_problem(newest) is None
    monkeypatch.setenv(checksums.VERIFIED_ENV, str(run_dir / "checkpoints" / "step_000002"))
    assert state.checkpoint_problem(newest) is not None


def test_preflight_marks_the_checkpoint_it_compared(run_dir: Path, monkeypatch) -> None:
    from hybridflow.config import load_config
    from hybridflow.preflight import check_resume

    monkeypatch.delenv(checksums.VERIFIED_ENV, raising=False)
    cfg = load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={run_dir}"])
    check_resume(cfg, content=False)
    assert checksums.VERIFIED_ENV not in os.environ
    check_resume(cfg)
    assert os.environ[checksums.VERIFIED_ENV] == str(run_dir / "checkpoints" / "step_000004")


@pytest.mark.claim("checkpoint-checksums")
def test_shares_spread_the_bytes_and_cover_every_file_once(tmp_path: Path) -> None:
    sizes = {"a": 900, "b": 500, "c": 400, "d": 100, "e": 100}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    shares = checksums.shares_of(tmp_path, list(sizes), 2)
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    assert sorted(sum(sizes[n] for n in share) for share in shares) == [1000, 1000]
    assert checksums.shares_of(tmp_path, list(sizes), 8)[5:] == [[], [], []]  # more ranks than files
