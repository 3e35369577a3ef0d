"""Checksums of a checkpoint's files: recorded when it is written, compared before a resume.

```
_save (every actor rank, the checkpoint complete under .partial, before state.json)
   files = every file under it          rank r hashes its share (``shares_of``: the largest files
   rank r: {file: (bytes, crc32)}       spread evenly by bytes), in parallel with the others
   gathered on rank 0 ──► checksums.json, then state.json (``checksummed: true``), then publish

a start (preflight, once, in the launcher; else the run's rank 0)
   state.json says checksummed ──► every listed file re-read and compared: a file whose bytes
   changed in place (a bad disk, an interrupted copy over it) is named, and the checkpoint is
   damaged like one with a shard missing (``run.resume_fallback``)
```

CRC-32 (zlib, which releases the GIL, so threads read files in parallel) finds the accidental
damage a resume must not load; it is not a defence against deliberate tampering. The files'
bytes are read once more at save (from the page cache, just written) and once at a start.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hfschema.files import write_atomic

__all__ = ["MANIFEST", "VERIFIED_ENV", "digest", "problems", "shares_of", "write_manifest"]

MANIFEST = "checksums.json"
"""At a checkpoint's top: ``{"algorithm": "crc32", "files": {relative path: [bytes, crc32]}}``."""
VERIFIED_ENV = "HYBRIDFLOW_VERIFIED_CHECKPOINT"
"""Set by preflight to the checkpoint whose checksums it compared, so the ranks it launches do
not read the whole checkpoint a second time."""
UNLISTED = ("state.json", MANIFEST)
"""Written after the manifest (state.json is checked by parsing it)."""
_CHUNK = 8 << 20
_THREADS = 8


def digest(path: Path) -> tuple[int, int]:
    """(bytes, CRC-32) of one file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def listed_files(directory: Path) -> list[str]:
    """Every file of a checkpoint being written, relative, that the manifest covers."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and str(p.relative_to(directory)) not in UNLISTED
    )


def shares_of(directory: Path, files: list[str], world: int) -> list[list[str]]:
    """``files`` dealt to ``world`` ranks, largest first to the rank with the fewest bytes so far."""
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    for name in sorted(files, key=lambda n: -(directory / n).stat().st_size):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += (directory / name).stat().st_size
    return shares


def hash_files(directory: Path, files: list[str]) -> dict[str, tuple[int, int]]:
    """``{file: (bytes, crc32)}``, several files at once."""
    with ThreadPoolExecutor(max_workers=min(_THREADS, max(1, len(files)))) as pool:
        return dict(zip(files, pool.map(lambda name: digest(directory / name), files)))


def write_manifest(directory: Path, parts: list[dict[str, tuple[int, int]]]) -> None:
    """Rank 0: the gathered ``hash_files`` results as the checkpoint's manifest, atomically."""
    files = {name: list(value) for part in parts for name, value in sorted(part.items())}
    write_atomic(directory / MANIFEST, json.dumps({"algorithm": "crc32", "files": files}, indent=1))


def problems(directory: Path) -> list[str]:
    """What no longer matches the manifest (a file missing, resized, or with other bytes)."""
    path = directory / MANIFEST
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{path} is missing or unreadable ({type(error).__name__}), though state.json says it was written"]
    present = [n for n in files if (directory / n).is_file()]
    found = [f"{directory / n} is missing (listed in {MANIFEST})" for n in files if n not in present]
    for name, (size, crc) in hash_files(directory, present).items():
        want_size, want_crc = files[name]
        if size != want_size:
            found.append(f"{directory / name} has {size} bytes, {MANIFEST} lists {want_size}")
        elif crc != want_crc:
            found.append(
                f"{directory / name} has changed since it was written (CRC-32 {crc:08x}, "
                f"{MANIFEST} lists {want_crc:08x})"
            )
    return found


def verified_elsewhere(directory: Path) -> bool:
    """Whether preflight in the launching process compared this checkpoint's checksums."""
    marked = os.environ.get(VERIFIED_ENV)
    return marked is not None and Path(marked).resolve() == directory.resolve()
