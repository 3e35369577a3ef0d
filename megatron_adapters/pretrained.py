"""A policy's starting weights from ``model.path``: each rank reads only the slices it holds.

```
hf:     ModelConfig + the policy's ParallelLayout ── reshard.megatron_layout ──► this rank's
        holdings: (HF tensor, box) -> (parameter, box)   [the weight sync's own source mapping]
        per holding: rows of the HF box read from safetensors in blocks of <= buffer_bytes
        (positioned reads, no mmap) ──► the box's columns ──► parameter box (dtype, device)
mcore:  checkpoint.load (torch.distributed.checkpoint reads each rank's shards)
```

No rank reads or holds the whole model: a rank's memory above its own parameters is one read
block (plus its dtype conversion, when the file's dtype differs). Every data-parallel copy reads
the same slices (from the page cache after the first); a rank of a 235B model under TP x EP
reads its share, not the 470 GB. Rows no HF tensor maps to (megatron's vocabulary padding) are
zeroed, whatever the policy was initialised with: the log-prob kernels mask them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfschema.hf_config import DEFAULT_BUFFER_BYTES
from hfschema.model_source import ModelSource
from reshard.megatron import megatron_layout
from reshard.regions import Region

from .export import global_named_parameters
from .safetensors_stream import HFTensor, SafetensorsReader

__all__ = ["LoadReport", "load_hf_weights", "load_pretrained"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What one rank read."""

    tensors: int
    """HF tensor boxes copied into this rank's parameters."""
    bytes_read: int
    """Bytes read from the files (whole rows of each box)."""
    share_bytes: int
    """Bytes of the boxes themselves, in the files' dtype (the rank's share of the model)."""
    seconds: float


def load_pretrained(policy, source: ModelSource, *, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> LoadReport | None:
    """Fill ``policy`` from ``source`` (its optimizer's main params follow); None for ``mcore``."""
    if source.kind == "mcore":
        from . import checkpoint

        checkpoint.load(policy, source.weights)
        return None
    return load_hf_weights(policy, source.weights, buffer_bytes=buffer_bytes)


def load_hf_weights(
    policy, directory, *, buffer_bytes: int = DEFAULT_BUFFER_BYTES, skip: tuple[str, ...] = ()
) -> LoadReport:
    """Copy this rank's boxes of every HF tensor in ``directory`` into ``policy``, but those
    named in ``skip`` (a reward model's fresh score head over a causal LM's body)."""
    started = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = megatron_layout(policy.model_config, policy.layout, dtype="float32")
    held = [h for h in layout.holdings(rank).holdings if h.tensor not in skip]
    params = global_named_parameters(policy, merge_adapters=False)
    reader = SafetensorsReader(directory)
    # one block reused for every read: freed and re-allocated blocks would stay in the allocator
    largest_row = max((reader.tensors[h.tensor].row_bytes for h in held if h.tensor in reader.tensors), default=1)
    block = torch.empty(max(min(buffer_bytes, _largest_box(held, reader)), largest_row), dtype=torch.uint8)
    read = share = 0
    try:
        missing = sorted({h.tensor for h in held} - set(reader.tensors))
        if missing:
            raise ValueError(
                f"{directory}: tensor {missing[0]!r} (and {len(missing) - 1} more) is missing from "
                "the safetensors files; the directory is not a complete model of its config.json"
            )
        with torch.no_grad():
            for h in held:
                entry = reader.tensors[h.tensor]
                _check_shape(entry, layout.tensors[h.tensor].shape)
                target = params[h.param][_slices(h.param_region)]
                read += _copy_box(reader, entry, h.region, target, block)
                share += math.prod(b - a for a, b in h.region) * entry.dtype.itemsize
    finally:
        reader.close()
    _zero_unmapped_rows(params, held)
    if policy.optimizer is not None:  # mixed precision keeps fp32 main params: they follow the copy
        policy.optimizer.reload_model_params()
    report = LoadReport(tensors=len(held), bytes_read=read, share_bytes=share, seconds=time.perf_counter() - started)
    logger.info(
        "rank %d loaded %d tensor slices (%.1f MB) from %s in %.1f s",
        rank,
        report.tensors,
        share / 1e6,
        directory,
        report.seconds,
    )
    return report


def _zero_unmapped_rows(params: dict[str, torch.Tensor], held) -> None:
    """Zero the rows of each loaded parameter that no HF tensor maps to (megatron's vocabulary
    padding). They would otherwise keep the policy's initial values, which depend on the RNG's
    state when it was built: a run that builds its RL actor after SFT and one resumed from the SFT
    export would then differ there (the log-prob kernels mask these rows; checkpoints compare them)."""
    covered: dict[str, list[tuple[int, int]]] = {}
    for h in held:
        covered.setdefault(h.param, []).append(tuple(h.param_region[0]))
    with torch.no_grad():
        for name, spans in covered.items():
            start = 0
            for a, b in sorted(spans) + [(params[name].shape[0], params[name].shape[0])]:
                if a > start:
                    params[name][start:a].zero_()
                start = max(start, b)


def _check_shape(entry: HFTensor, expected: tuple[int, ...]) -> None:
    if tuple(entry.shape) != tuple(expected):
        raise ValueError(
            f"{entry.path}: tensor {entry.name!r} has shape {list(entry.shape)} but config.json "
            f"describes {list(expected)}; the weights and config.json are of different models"
        )


def _slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def _largest_box(held, reader: SafetensorsReader) -> int:
    """Bytes of the largest read a box needs (its rows, whole): the block need not be larger."""
    sizes = [
        (h.region[0][1] - h.region[0][0]) * reader.tensors[h.tensor].row_bytes
        for h in held
        if h.tensor in reader.tensors
    ]
    return max(sizes, default=1)


def _copy_box(
    reader: SafetensorsReader, entry: HFTensor, region: Region, target: torch.Tensor, block: torch.Tensor
) -> int:
    """Rows of ``region`` in reads that fill at most ``block`` (at least one row); returns bytes read."""
    (first, stop), *columns = region
    rows_per_block = max(1, block.numel() // max(entry.row_bytes, 1))
    flat = target.view((stop - first,) + tuple(b - a for a, b in columns))  # param box without its unit dims
    whole_rows = all((a, b) == (0, n) for (a, b), n in zip(columns, entry.shape[1:]))
    for start in range(first, stop, rows_per_block):
        end = min(stop, start + rows_per_block)
        rows = block[: (end - start) * entry.row_bytes].view(entry.dtype).view((end - start,) + tuple(entry.shape[1:]))
        reader.read_rows(entry.name, (start, end), rows)
        part = rows if whole_rows else rows[(slice(None),) + _slices(tuple(columns))]
        flat[start - first : end - first].copy_(part)
    return (stop - first) * entry.row_bytes
