"""One-line errors of a rank: running out of GPU memory names the settings to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.runtime.worker import DeviceMemoryError, out_of_memory_hint

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml")


@pytest.mark.claim("oom-one-line")
def test_out_of_memory_becomes_one_line_naming_the_settings():
    cfg = load_config(QUICKSTART)
    with pytest.raises(DeviceMemoryError) as error:
        with out_of_memory_hint(cfg, "the RL steps"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    message = str(error.value)
    assert "\n" not in message and "in the RL steps" in message
    for key in ("train.micro_batch_size (now 16)", "data.max_response_length (now 4)", "actor.parallel.tp"):
        assert key in message
    assert error.value.__cause__ is None  # the CUDA traceback is not chained under it


def test_other_errors_pass_through_unchanged():
    cfg = load_config(QUICKSTART)
    with pytest.raises(ValueError, match="boom"):
        with out_of_memory_hint(cfg, "start-up"):
            raise ValueError("boom")
