"""A checkpoint directory is accepted only when complete; errors name the path and the fix."""

from __future__ import annotations

import json

import pytest

from megatron_adapters import checkpoint


def test_missing_directory_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="checkpoint directory not found: .*nowhere"):
        checkpoint.read_meta(tmp_path / "nowhere")


def test_half_written_checkpoint_is_rejected(tmp_path) -> None:
    staged = tmp_path / "step_4"
    staged.mkdir()
    (staged / "__0_0.distcp").write_bytes(b"partial")  # shards without the final metadata file
    with pytest.raises(
        ValueError, match=f"{staged} is not a complete hybridflow checkpoint: hybridflow.json is missing"
    ):
        checkpoint.read_meta(staged)


def test_complete_checkpoint_metadata_is_read(tmp_path) -> None:
    done = tmp_path / "step_4"
    done.mkdir()
    (done / checkpoint.META_FILE).write_text(json.dumps({"step": 4, "with_optimizer": True}))
    assert checkpoint.read_meta(done)["step"] == 4


def test_loading_optimizer_state_from_a_weights_only_checkpoint_names_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="holds no optimizer state"):
        checkpoint._require_optimizer_state({"with_optimizer": False}, tmp_path)
