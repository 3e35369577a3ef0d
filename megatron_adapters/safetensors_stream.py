"""Hugging Face safetensors read and written a row range at a time, with bounded memory.

```
read:   *.safetensors headers (8-byte length + JSON) ──► name -> (file, byte offset, dtype, shape)
        read_rows(name, rows, out): one positioned read straight into ``out`` (no mmap, so the
        file's pages never count towards the process's resident memory)
write:  header of every shard computed up front ──► files created at full size
        write_rows(name, rows, data): one positioned write; finish(): the index file
```

The format (a little-endian u64 header length, a JSON header of ``{name: {dtype, shape,
data_offsets}}`` plus ``__metadata__``, then the tensors' bytes back to back) is small enough to
handle directly, which is what lets one tensor be streamed in pieces larger tensors would not
fit in memory for. Files are validated when opened: a header that does not parse, offsets that
do not tile the data, or a file shorter than its header says (truncated) raise ``ValueError``
naming the file and the first tensor affected. ``safetensors.safe_open`` re-reads every written
file in the converters' verification pass.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hfschema.buckets import fill_buckets

__all__ = [
    "DTYPES",
    "INDEX_FILE",
    "HFTensor",
    "SafetensorsReader",
    "SafetensorsWriter",
    "check_written",
    "dtype_name",
    "read_header",
]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names."""
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit
INDEX_FILE = "model.safetensors.index.json"


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    return _NAMES[dtype]


@dataclass(frozen=True, kw_only=True, slots=True)
class HFTensor:
    """Where one tensor's bytes are."""

    name: str
    """Tensor name."""
    path: Path
    """File holding it."""
    dtype: torch.dtype
    """Element type."""
    shape: tuple[int, ...]
    """Shape."""
    start: int
    """Byte offset of its first element in the file."""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (dim 0); a 1-D tensor's row is one element."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _header(path: Path) -> tuple[int, dict]:
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(
                f"{path}: truncated or corrupt safetensors file (header of {length} bytes in a {size}-byte file)"
            )
        try:
            return 8 + length, json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({error})") from None


def read_header(path: str | os.PathLike) -> dict[str, HFTensor]:
    """Every tensor of one safetensors file; ValueError names the file and the bad tensor."""
    path = Path(path)
    data_start, header = _header(path)
    header.pop("__metadata__", None)
    entries, end = [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = DTYPES.get(info["dtype"])
        begin, stop = info["data_offsets"]
        shape = tuple(info["shape"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        if begin != end or stop - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{path}: tensor {name!r}: data_offsets {info['data_offsets']} do not "
                f"match its shape {list(shape)} / the previous tensor's end {end}"
            )
        entries.append(HFTensor(name=name, path=path, dtype=dtype, shape=shape, start=data_start + begin))
        end = stop
    available = path.stat().st_size - data_start
    for entry in entries:
        if entry.start - data_start + entry.nbytes > available:
            raise ValueError(
                f"{path}: truncated: tensor {entry.name!r} needs bytes up to "
                f"{entry.start + entry.nbytes} but the file has {path.stat().st_size}"
            )
    return {e.name: e for e in entries}


class SafetensorsReader:
    """The tensors of a Hugging Face directory (one file, or shards and their index)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"{self.directory}: no *.safetensors files (other weight formats are "
                "not read; convert them to safetensors first)"
            )
        self.tensors: dict[str, HFTensor] = {}
        for path in files:
            for name, entry in read_header(path).items():
                if name in self.tensors:
                    raise ValueError(f"tensor {name!r} is in both {self.tensors[name].path} and {path}")
                self.tensors[name] = entry
        self._check_index()
        self._files: dict[Path, int] = {}

    def _check_index(self) -> None:
        index = self.directory / INDEX_FILE
        if not index.is_file():
            return
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        for name, file in weight_map.items():
            entry = self.tensors.get(name)
            if entry is None or entry.path.name != file:
                raise ValueError(f"{index}: tensor {name!r} is listed in {file}, which does not hold it")

    def where(self, name: str) -> str:
        """The file holding ``name`` (for messages)."""
        return str(self.tensors[name].path)

    def read_rows(self, name: str, rows: tuple[int, int], out: torch.Tensor) -> None:
        """Copy rows ``rows`` of tensor ``name`` into ``out`` (contiguous; any float dtype)."""
        entry = self.tensors[name]
        count = (rows[1] - rows[0]) * entry.row_bytes
        target = out if out.dtype == entry.dtype else torch.empty(out.shape, dtype=entry.dtype)
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        fd = self._fd(entry.path)
        offset, done = entry.start + rows[0] * entry.row_bytes, 0
        while done < count:
            got = os.preadv(fd, [view[done:count]], offset + done)
            if got == 0:
                raise ValueError(f"{entry.path}: truncated while reading tensor {name!r}")
            done += got
        if target is not out:
            out.copy_(target)

    def _fd(self, path: Path) -> int:
        if path not in self._files:
            self._files[path] = os.open(path, os.O_RDONLY)
        return self._files[path]

    def close(self) -> None:
        """Close the open files."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class SafetensorsWriter:
    """Shards of a Hugging Face checkpoint laid out up front and filled in any order."""

    def __init__(
        self,
        directory: str | os.PathLike,
        tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        *,
        shard_bytes: int,
    ) -> None:
        self.directory = Path(directory)
        tensors = list(tensors)
        shards = fill_buckets(tensors, [math.prod(shape) * dtype.itemsize for _, dtype, shape in tensors], shard_bytes)
        self.entries: dict[str, HFTensor] = {}
        self._fds: list[int] = []
        self._fd_of: dict[str, int] = {}
        for index, shard in enumerate(shards):
            path = self.directory / f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            self._create(path, shard)

    def _create(self, path: Path, shard: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header, offset = {}, 0
        for name, dtype, shape in shard:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(fd, 8 + len(text) + offset)
        self._fds.append(fd)
        for name, dtype, shape in shard:
            start = 8 + len(text) + header[name]["data_offsets"][0]
            self.entries[name] = HFTensor(name=name, path=path, dtype=dtype, shape=shape, start=start)
            self._fd_of[name] = fd

    def write_rows(self, name: str, rows: tuple[int, int], data: torch.Tensor) -> None:
        """Write ``data`` (rows ``rows`` of ``name``, already in its dtype) at its place."""
        entry = self.entries[name]
        raw = memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy())
        if len(raw) != (rows[1] - rows[0]) * entry.row_bytes:
            raise AssertionError(f"{name} rows {rows}: {len(raw)} bytes for {entry.shape}")
        offset, done = entry.start + rows[0] * entry.row_bytes, 0
        while done < len(raw):
            done += os.pwrite(self._fd_of[name], raw[done:], offset + done)

    def finish(self) -> Path:
        """Flush and close the shards, write the index; returns the index path."""
        for fd in self._fds:
            os.fsync(fd)
        self.close()
        total = sum(e.nbytes for e in self.entries.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: e.path.name for name, e in self.entries.items()},
        }
        path = self.directory / INDEX_FILE
        path.write_text(json.dumps(index, indent=2) + "\n")
        return path

    def close(self) -> None:
        """Close the shard files (idempotent; ``finish`` calls it)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def check_written(entries: Mapping[str, HFTensor]) -> int:
    """Re-open every written file with the safetensors library; return the tensors checked."""
    from safetensors import safe_open

    by_file: dict[Path, dict[str, HFTensor]] = {}
    for entry in entries.values():
        by_file.setdefault(entry.path, {})[entry.name] = entry
    for path, expected in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            if set(f.keys()) != set(expected):
                raise ValueError(f"{path}: holds {sorted(set(f.keys()) ^ set(expected))[:5]} unexpectedly")
            for name, entry in expected.items():
                part = f.get_slice(name)
                if tuple(part.get_shape()) != entry.shape or part.get_dtype() != dtype_name(entry.dtype):
                    raise ValueError(
                        f"{path}: tensor {name!r} reads back as {part.get_dtype()} "
                        f"{part.get_shape()}, written as {entry.dtype} {list(entry.shape)}"
                    )
    return len(entries)
