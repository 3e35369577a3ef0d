"""An offline wandb run read back: the records of its transaction log (``run-<id>.wandb``) parsed
with wandb's own protobuf schema (``wandb.proto.wandb_internal_pb2.Record``).

The log is LevelDB's log format behind a 7-byte header (``:W&B``, a 2-byte magic, a version):
32 KiB blocks of records, each a 7-byte header (crc32, length, type: full, first, middle, last)
and its bytes. wandb 0.31 has no reader of its own in Python (its Go core writes and reads it).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        else:
            yield pending + chunk
            pending = b""


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    out = []
    for chunk in _chunks(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """Every logged row, its values decoded from JSON."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def run_record(path: Path):
    """The run's own record: its id, project, name and config."""
    (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return run


def offline_runs(out_dir: Path) -> list[Path]:
    """The offline runs' transaction logs under a run directory, oldest first."""
    return sorted((Path(out_dir) / "wandb").glob("offline-run-*/run-*.wandb"))
