"""Hugging Face <-> megatron-core checkpoint converters: exact, streaming, for any layout.

```
hf_to_mcore   HF dir ── config.json ──► ModelConfig ──► plan (convert_plan: chunks of HF rows)
              preflight: each expected tensor present once, none unexpected, shapes, dtypes,
                         no truncated file                       (nothing is written before)
              <out>.tmp: per chunk: its HF rows (positioned reads) ──► one stored tensor (dist_io)
                         + metadata.json, common.pt, hybridflow.json, hf_files/ (config, tokenizer)
              verify: keys, shapes, dtypes, every row stored; --checksums: CRC32 of every HF
                      tensor read back through the checkpoint ──► rename to <out>
mcore_to_hf   <mcore> ── hybridflow.json, hf_files/ (or hf_config=) ──► ModelConfig ──► same plan
              preflight: every key present with its global shape (vocab padding as stored)
              <out>.tmp: per batch of chunks (<= buffer): boxes read from the checkpoint, whatever
                         layout saved it ──► rows written in place into preallocated shards
              verify: safe_open re-reads names, shapes, dtypes; --checksums: CRC32 against the
                      source's checksums recorded by hf_to_mcore and against the files read back
              a LoRA run's checkpoint (frozen base + adapters): refused unless merge_lora, which
                      adds s * B[rows] A to each chunk of an adapted weight as it is read
mcore_to_peft a LoRA run's checkpoint ──► its adapters alone (the *.lora_a / *.lora_b keys) as
              Hugging Face PEFT files (peft_io), for the base converted by mcore_to_hf
```

A checkpoint written by a training run has no ``hf_files/``; when it sits in its run directory
(``<run>/checkpoints/<name>/actor``) the run's ``<run>/model`` (the rollout engine's config.json
and tokenizer) describes it, and is the default.

The written checkpoint is megatron-core's own ``torch_dist`` format with global (unsharded)
tensors, so ``megatron_adapters.checkpoint.load`` loads it into a policy of any TP / PP / VPP / EP /
ETP layout; the one layout-dependent thing in it is the vocabulary padding (megatron pads the
embedding to a multiple of 128 x TP and loads only that global shape), which ``layout.tp`` picks.
Memory: at most about ``buffer_bytes`` of tensor data at a time (chunks of a quarter of it), plus,
when reading a checkpoint written by training, one stored shard (a rank's slice) at a time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from hfschema.files import check_distinct, staged_directory
from hfschema.hf_config import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_SHARD_BYTES,
    SIDE_FILE_DIR,
    is_ignored_tensor,
    read_model_config,
    side_files,
)
from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from reshard.families import canonical_tensors

from .checkpoint import META_FILE, read_meta, stored_lora
from .convert_plan import CheckpointPlan, Chunk, plan_checkpoint
from .dist_io import DistReader, write_dist_checkpoint
from .safetensors_stream import SafetensorsReader, SafetensorsWriter, check_written

__all__ = ["ConversionReport", "DTYPES", "hf_to_mcore", "mcore_to_hf", "mcore_to_peft"]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Target dtypes the converters accept by name."""
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_ADAPTER_KEYS = (".lora_a", ".lora_b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionReport:
    """What one conversion did and checked."""

    direction: str
    """``hf-to-mcore``, ``mcore-to-hf`` or ``mcore-to-peft``."""
    source: str
    """Input directory."""
    destination: str
    """Output directory."""
    family: str
    """Model family."""
    tensors: int
    """Hugging Face tensors converted."""
    nbytes: int
    """Bytes of those tensors (as written)."""
    keys: int
    """megatron checkpoint tensor keys."""
    chunks: int
    """Boxes moved (stored tensors written, or read)."""
    skipped: tuple[str, ...]
    """Input tensors / keys left out on purpose (MTP layers, optimizer state)."""
    seconds: float
    """Wall time."""
    checks: tuple[str, ...]
    """Verification results, one line each."""

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def lines(self) -> list[str]:
        """A short human-readable report."""
        head = (
            f"{self.direction}: {self.family}, {self.tensors} HF tensors "
            f"({self.nbytes / 1e9:.3f} GB) <-> {self.keys} megatron keys in {self.chunks} "
            f"boxes, {self.seconds:.1f} s ({self.gbps:.2f} GB/s) -> {self.destination}"
        )
        skipped = (
            [f"skipped {len(self.skipped)}: {', '.join(self.skipped[:3])}{' ...' if len(self.skipped) > 3 else ''}"]
            if self.skipped
            else []
        )
        return [head, *skipped, *(f"verified: {c}" for c in self.checks)]


# ------------------------------------------------------------------------------- helpers


def _local_spec_renames(model: ModelConfig) -> dict[str, str]:
    """The key renames of megatron's local layer spec for this model's layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=model.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm,
        multi_latent_attention=model.is_mla,
        normalization="RMSNorm",
    )
    return dict(spec.submodules.sharded_state_dict_keys_map)


def _chunk_bytes(buffer_bytes: int) -> int:
    """Size of a stored chunk, and of a batch of chunks read at once. A chunk's bytes are in
    memory up to three times at once (the tensor, torch.save's / torch.load's serialised copy,
    the batch it is read into), so a quarter of the buffer keeps the working set under it."""
    if buffer_bytes < 4:
        raise ValueError(f"buffer_bytes={buffer_bytes} must be >= 4 (a few MiB or more is sensible)")
    return buffer_bytes // 4


def _target_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def _pinned(model: ModelConfig) -> set[str]:
    """HF tensors whose dtype the family fixes (DeepSeek's float32 expert bias)."""
    return {t.name for t in canonical_tensors(model) if t.spec.dtype is not None}


class _Checksums:
    """CRC32 of each HF tensor, accumulated over its rows in increasing order."""

    def __init__(self) -> None:
        self.state: dict[str, tuple[int, int]] = {}

    def add(self, name: str, rows: tuple[int, int], data: torch.Tensor) -> None:
        next_row, crc = self.state.get(name, (0, 0))
        if rows[0] != next_row:
            raise AssertionError(f"{name}: rows {rows} out of order (expected {next_row})")
        raw = memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy())
        self.state[name] = (rows[1], zlib.crc32(raw, crc))

    def values(self) -> dict[str, int]:
        return {name: crc for name, (_, crc) in self.state.items()}


def _copy_side_files(source: Path, destination: Path, dtype: torch.dtype | None) -> int:
    """Copy config / tokenizer files; a changed dtype is written into config.json."""
    destination.mkdir(parents=True, exist_ok=True)
    files = side_files(source)
    for path in files:
        shutil.copy2(path, destination / path.name)
    config = destination / "config.json"
    if dtype is not None and config.is_file():
        values = json.loads(config.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in values:
                values[key] = str(dtype).removeprefix("torch.")
        config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return len(files)


# ----------------------------------------------------------------------- hf -> megatron


def _preflight_hf(reader: SafetensorsReader, model: ModelConfig) -> tuple[str, ...]:
    """Every expected tensor present with its shape, nothing unexpected; returns skipped names."""
    expected = {t.name: t.shape for t in canonical_tensors(model)}
    skipped = []
    for name, entry in reader.tensors.items():
        if name in expected:
            if entry.shape != expected[name]:
                raise ValueError(
                    f"{entry.path}: tensor {name!r} has shape {list(entry.shape)}, "
                    f"expected {list(expected[name])} for this config.json"
                )
            if not entry.dtype.is_floating_point:
                raise ValueError(f"{entry.path}: tensor {name!r} has dtype {entry.dtype}, expected floating point")
        elif is_ignored_tensor(model, name):
            skipped.append(name)
        else:
            raise ValueError(
                f"{entry.path}: unexpected tensor {name!r}: not part of a {model.family} model with this config.json"
            )
    missing = [n for n in expected if n not in reader.tensors]
    if missing:
        raise ValueError(
            f"{reader.directory}: tensor {missing[0]!r} is missing from every "
            f"*.safetensors file ({len(missing)} missing in all)"
        )
    return tuple(sorted(skipped))


def _key_dtypes(plan: CheckpointPlan, dtype_of: Mapping[str, torch.dtype]) -> dict[str, torch.dtype]:
    out = {}
    for key, tensors in plan.key_tensors.items():
        kinds = {dtype_of[t] for t in tensors}
        if len(kinds) != 1:
            raise ValueError(
                f"megatron key {key!r} would hold tensors of dtypes {sorted(map(str, kinds))} "
                f"({', '.join(tensors[:3])}); pass dtype= (--dtype) to convert them to one"
            )
        out[key] = kinds.pop()
    return out


def _fill(reader: SafetensorsReader, chunk: Chunk, dtype: torch.dtype, sums: _Checksums | None) -> torch.Tensor:
    """The chunk's tensor: its HF rows, zeros in vocabulary padding rows."""
    data = torch.empty(chunk.param_shape, dtype=dtype)
    filled = 0  # pieces come sorted by position; rows between them are padding
    for piece in chunk.pieces:
        data[filled : piece.at].zero_()
        filled = piece.at + piece.rows[1] - piece.rows[0]
        rows = data[piece.at : filled]
        reader.read_rows(piece.tensor, piece.rows, rows)
        if sums is not None:
            sums.add(piece.tensor, piece.rows, rows)
    data[filled:].zero_()
    return data.reshape(chunk.sizes)


def _meta(
    model: ModelConfig, layout: ParallelLayout, plan: CheckpointPlan, source: Path, checksums: Mapping[str, int] | None
) -> dict:
    """``hybridflow.json``: what ``checkpoint.read_meta`` needs, plus where the weights came from."""
    return {
        "format": "megatron-core torch_dist",
        "layout": dataclasses.asdict(layout),
        "expert_parallel": layout.ep > 1,
        "with_optimizer": False,
        "step": 0,
        "scheduler": None,
        "converted_from": str(source),
        "model": dataclasses.asdict(model),
        "padded_vocab_size": plan.padded_vocab,
        "hf_checksums_crc32": dict(checksums) if checksums is not None else None,
    }


def _converter_layout(tp: int, pp: int, vpp: int, ep: int, etp: int) -> ParallelLayout:
    """The layout with the fewest data-parallel ranks that fits the expert grid."""
    dp = (ep * etp) // math.gcd(tp, ep * etp)
    return ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, dp=dp)


def hf_to_mcore(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    ep: int = 1,
    etp: int = 1,
    dtype: str | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    checksums: bool = False,
    overwrite: bool = False,
) -> ConversionReport:
    """Convert a Hugging Face directory into a megatron-core checkpoint for this layout."""
    started = time.perf_counter()
    source, out = Path(hf_dir), Path(out_dir)
    check_distinct(out, (source,))  # before the plan: a refusal in a second, not after it
    model = read_model_config(source)
    layout = _converter_layout(tp, pp, vpp, ep, etp)
    layout.check_model(model, prefix="convert")
    target = _target_dtype(dtype)
    reader = SafetensorsReader(source)
    try:
        skipped = _preflight_hf(reader, model)
        pinned = _pinned(model)
        dtype_of = {name: e.dtype if target is None or name in pinned else target for name, e in reader.tensors.items()}
        plan = plan_checkpoint(
            model,
            renames=_local_spec_renames(model),
            padded_vocab=layout.padded_vocab_size(model),
            itemsize=lambda slab: dtype_of[slab.pieces[0].tensor].itemsize,
            chunk_bytes=_chunk_bytes(buffer_bytes),
        )
        key_dtypes = _key_dtypes(plan, dtype_of)
        sums = _Checksums() if checksums else None
        with staged_directory(out, overwrite=overwrite, sources=(source,)) as staging, _bar(plan, "hf-to-mcore") as bar:

            def make(i: int):
                bar.update()
                return _fill(reader, plan.chunks[i], key_dtypes[plan.chunks[i].key], sums)

            write_dist_checkpoint(
                staging,
                boxes=[(c.key, c.offsets, c.sizes) for c in plan.chunks],
                dtypes=key_dtypes,
                shapes=plan.keys,
                extra_states=plan.extra_states,
                make=make,
            )
            _copy_side_files(source, staging / SIDE_FILE_DIR, target)
            recorded = sums.values() if sums else None
            (staging / META_FILE).write_text(json.dumps(_meta(model, layout, plan, source, recorded), indent=2))
            checks = _verify_mcore(staging, plan, key_dtypes, recorded, buffer_bytes)
    finally:
        reader.close()
    nbytes = sum(math.prod(plan.tensors[n]) * dtype_of[n].itemsize for n in plan.tensors)
    return _report("hf-to-mcore", source, out, model, plan, nbytes, skipped, started, checks)


def _bar(plan, direction: str):
    """A progress bar over the plan's chunks (on a terminal only): a 671B conversion takes hours."""
    from tqdm import tqdm

    return tqdm(total=len(plan.chunks), desc=f"convert {direction}", unit="chunk", disable=None, leave=False)


def _write_chunk(writer, chunk, data, out_dtype, sums) -> None:
    for piece in chunk.pieces:
        rows = data[piece.at : piece.at + piece.rows[1] - piece.rows[0]].to(out_dtype[piece.tensor])
        writer.write_rows(piece.tensor, piece.rows, rows)
        if sums is not None:
            sums.add(piece.tensor, piece.rows, rows)


def _report(direction, source, out, model, plan, nbytes, skipped, started, checks) -> ConversionReport:
    report = ConversionReport(
        direction=direction,
        source=str(source),
        destination=str(out),
        family=model.family,
        tensors=len(plan.tensors),
        nbytes=nbytes,
        keys=len(plan.keys),
        chunks=len(plan.chunks),
        skipped=tuple(skipped),
        seconds=time.perf_counter() - started,
        checks=tuple(checks),
    )
    for line in report.lines():
        logger.info("%s", line)
    return report


def _verify_mcore(
    directory: Path,
    plan: CheckpointPlan,
    key_dtypes: Mapping[str, torch.dtype],
    recorded: Mapping[str, int] | None,
    buffer_bytes: int,
) -> list[str]:
    """Re-read the written checkpoint's metadata (and, with checksums, its data)."""
    reader = DistReader(directory)
    stored = reader.tensors()
    if set(stored) != set(plan.keys) or set(reader.objects()) != set(plan.extra_states):
        raise AssertionError(f"{directory}: written keys differ from the plan")
    for key, shape in plan.keys.items():
        md = stored[key]
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if tuple(md.size) != shape or md.properties.dtype != key_dtypes[key] or covered != math.prod(shape):
            raise AssertionError(
                f"{directory}: key {key} stored as {md.properties.dtype} {list(md.size)} ({covered} elements in chunks)"
            )
    checks = [
        f"{len(stored)} tensor keys + {len(plan.extra_states)} extra-state objects with their "
        f"global shapes and dtypes; every row of {len(plan.tensors)} HF tensors stored once"
    ]
    if recorded is not None:
        again = _read_back_checksums(reader, plan, buffer_bytes)
        bad = [n for n in recorded if again.get(n) != recorded[n]]
        if bad:
            raise ValueError(f"{directory}: checksum mismatch after writing, e.g. tensor {bad[0]!r}")
        checks.append(f"CRC32 of all {len(recorded)} HF tensors read back through the checkpoint")
    return checks


def _batches(chunks: tuple[Chunk, ...], dtypes: Mapping[str, torch.dtype], budget: int) -> Iterator[list[Chunk]]:
    """Consecutive chunks holding HF rows, at most ``budget`` bytes per batch (or one chunk)."""
    batch, size = [], 0
    for chunk in chunks:
        if not chunk.pieces:
            continue  # vocabulary padding only
        nbytes = math.prod(chunk.sizes) * dtypes[chunk.key].itemsize
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += nbytes
    if batch:
        yield batch


def _adapter_boxes(chunk: Chunk, stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> list | None:
    """Boxes of the adapter of the weight ``chunk`` holds rows of: B's rows of the chunk and the
    whole A (``lora_a`` / ``lora_b`` sit beside the weight's key with its stacked axes); None if
    the weight has none. ``stored``: {key: (dtype, global shape)}."""
    base = chunk.key[: -len("weight")]
    a_key, b_key = base + "lora_a", base + "lora_b"
    if not chunk.key.endswith(".weight") or a_key not in stored:
        return None
    lead, rank = chunk.offsets[: chunk.lead], stored[a_key][1][chunk.lead]
    ones = (1,) * chunk.lead
    b_box = (b_key, lead + (chunk.offsets[chunk.lead], 0), ones + (chunk.rows, rank))
    a_box = (a_key, lead + (0, 0), ones + (rank, chunk.sizes[chunk.lead + 1]))
    return [(box, torch.empty(box[2], dtype=stored[box[0]][0])) for box in (b_box, a_box)]


def _read_chunks(
    reader: DistReader,
    plan: CheckpointPlan,
    dtypes: Mapping[str, torch.dtype],
    budget: int,
    *,
    lora_scale: float | None = None,
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Every chunk with HF rows, read from the checkpoint in batches of ``budget`` bytes;
    ``lora_scale``: with the adapters merged, W[rows] + s * B[rows] A (in float32)."""
    stored = {k: (dtypes[k], tuple(v.size)) for k, v in reader.tensors().items()} if lora_scale else {}
    for batch in _batches(plan.chunks, dtypes, budget):
        boxes = [((c.key, c.offsets, c.sizes), torch.empty(c.sizes, dtype=dtypes[c.key])) for c in batch]
        adapters = [_adapter_boxes(c, stored) if lora_scale else None for c in batch]
        reader.read(boxes + [box for pair in adapters if pair for box in pair])
        for chunk, (_, data), pair in zip(batch, boxes, adapters):
            data = data.reshape(chunk.param_shape)
            if pair is not None:
                (_, b), (_, a) = pair
                b, a = b.reshape(b.shape[-2:]).float(), a.reshape(a.shape[-2:]).float()
                data = data.float() + lora_scale * (b @ a)
            yield chunk, data


def _read_back_checksums(reader: DistReader, plan: CheckpointPlan, buffer_bytes: int) -> dict[str, int]:
    dtypes = {k: v.properties.dtype for k, v in reader.tensors().items()}
    sums = _Checksums()
    for chunk, data in _read_chunks(reader, plan, dtypes, _chunk_bytes(buffer_bytes)):
        for piece in chunk.pieces:
            sums.add(piece.tensor, piece.rows, data[piece.at : piece.at + piece.rows[1] - piece.rows[0]])
    return sums.values()


# ----------------------------------------------------------------------- megatron -> hf


def _run_model_dir(directory: Path) -> Path | None:
    """``<run>/model`` of a checkpoint at ``<run>/checkpoints/<name>/<actor|critic>``."""
    if directory.resolve().parent.parent.name != "checkpoints":
        return None
    return directory.resolve().parent.parent.parent / "model"


def _mcore_model(directory: Path, hf_config: str | os.PathLike | None) -> tuple[ModelConfig, Path]:
    files = Path(hf_config) if hf_config is not None else directory / SIDE_FILE_DIR
    run_model = _run_model_dir(directory)
    if hf_config is None and not (files / "config.json").is_file() and run_model is not None:
        files = run_model
    if not (files / "config.json").is_file():
        raise ValueError(
            f"{directory} has no {SIDE_FILE_DIR}/config.json (it was not written by "
            "hf-to-mcore) and is not in a run directory with model/config.json; pass "
            "hf_config= (--hf-config DIR) with the model's config.json and tokenizer"
        )
    return read_model_config(files), files


def _preflight_mcore(reader: DistReader, plan: CheckpointPlan) -> tuple[str, ...]:
    """Every planned key stored with its global shape; returns the non-model keys skipped."""
    stored = reader.tensors()
    where = reader.directory / ".metadata"
    for key, shape in plan.keys.items():
        if key not in stored:
            raise ValueError(
                f"{where}: checkpoint key {key!r} (holding {', '.join(plan.key_tensors[key][:2])}) is missing"
            )
        if tuple(stored[key].size) != shape:
            raise ValueError(
                f"{where}: checkpoint key {key!r} has shape {list(stored[key].size)}, "
                f"expected {list(shape)} for this config.json"
            )
    unexpected = [
        k for k in stored if k not in plan.keys and k.startswith(_MODEL_PREFIXES) and not k.endswith(_ADAPTER_KEYS)
    ]
    if unexpected:
        raise ValueError(
            f"{where}: unexpected checkpoint key {unexpected[0]!r}: not part of a "
            f"{plan.model.family} model with this config.json"
        )
    return tuple(sorted(k for k in stored if k not in plan.keys))


def _stored_padded_vocab(reader: DistReader) -> int:
    embedding = reader.tensors().get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ValueError(
            f"{reader.directory / '.metadata'}: checkpoint key 'embedding.word_embeddings.weight' is missing"
        )
    return int(embedding.size[0])


def mcore_to_hf(
    mcore_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config: str | os.PathLike | None = None,
    dtype: str | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    checksums: bool = False,
    overwrite: bool = False,
    merge_lora: bool = False,
) -> ConversionReport:
    """Convert a megatron-core checkpoint (converted or saved by training) into a HF directory;
    a LoRA run's only with ``merge_lora`` (W + alpha/r B A written for every adapted weight)."""
    started = time.perf_counter()
    source, out = Path(mcore_dir), Path(out_dir)
    meta = read_meta(source)
    lora = stored_lora(source)
    if lora is not None and not merge_lora:  # its weights alone are the frozen base, without the training
        raise ValueError(
            f"{source} is a LoRA run's checkpoint: its model weights are the frozen base and the "
            "training is in the adapters; pass merge_lora=True (--merge-lora) for merged weights, "
            "or write the adapters as PEFT files with mcore_to_peft (convert mcore-to-peft)"
        )
    model, files = _mcore_model(source, hf_config)
    target = _target_dtype(dtype)
    reader = DistReader(source)
    stored = {k: v.properties.dtype for k, v in reader.tensors().items()}
    plan = plan_checkpoint(
        model,
        renames=_local_spec_renames(model),
        padded_vocab=_stored_padded_vocab(reader),
        itemsize=lambda slab: stored[slab.key].itemsize if slab.key in stored else 4,
        chunk_bytes=_chunk_bytes(buffer_bytes),
    )
    skipped = _preflight_mcore(reader, plan)
    pinned = _pinned(model)
    out_dtype = {
        n: stored[k] if target is None or n in pinned else target
        for k, names in plan.key_tensors.items()
        for n in names
    }
    sums = _Checksums() if checksums else None
    with staged_directory(out, overwrite=overwrite, sources=(source, files)) as staging:
        writer = SafetensorsWriter(
            staging, [(n, out_dtype[n], s) for n, s in plan.tensors.items()], shard_bytes=shard_bytes
        )
        try:
            scale = lora.alpha / lora.rank if lora is not None else None
            chunks = _read_chunks(reader, plan, stored, _chunk_bytes(buffer_bytes), lora_scale=scale)
            with _bar(plan, "mcore-to-hf") as bar:
                for chunk, data in chunks:
                    bar.update()
                    _write_chunk(writer, chunk, data, out_dtype, sums)
            writer.finish()
        finally:
            writer.close()
        _copy_side_files(files, staging, target)
        checks = _verify_hf(staging, writer, sums, meta if lora is None else {}, target)
    if lora is not None:
        checks.append(
            f"LoRA adapters (r={lora.rank}, alpha={lora.alpha:g}) merged into the weights of "
            f"{', '.join(lora.target_modules)}"
        )
    nbytes = sum(e.nbytes for e in writer.entries.values())
    return _report("mcore-to-hf", source, out, model, plan, nbytes, skipped, started, checks)


def mcore_to_peft(
    mcore_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> ConversionReport:
    """Write a LoRA run's adapters as a PEFT LoRA directory (read from its checkpoint, without the
    base weights), for the base model that ``mcore_to_hf`` makes of the run's SFT checkpoint."""
    from .peft_io import checkpoint_adapters, write_peft  # peft_io imports megatron's lora layers

    started = time.perf_counter()
    source, out = Path(mcore_dir), Path(out_dir)
    lora = stored_lora(source)
    if lora is None:
        raise ValueError(
            f"{source} has no LoRA adapters (not a LoRA run's checkpoint); convert it with "
            "mcore_to_hf (convert mcore-to-hf)"
        )
    model, files = _mcore_model(source, hf_config)
    reader = DistReader(source)
    state = checkpoint_adapters(reader, model)
    with staged_directory(out, overwrite=overwrite, sources=(source, files)) as staging:
        write_peft(state, model, lora, staging)
        written = SafetensorsReader(staging)
        try:
            nbytes, tensors = sum(e.nbytes for e in written.tensors.values()), len(written.tensors)
        finally:
            written.close()
    adapter_keys = sum(k.endswith(_ADAPTER_KEYS) for k in reader.tensors())
    report = ConversionReport(
        direction="mcore-to-peft",
        source=str(source),
        destination=str(out),
        family=model.family,
        tensors=tensors,
        nbytes=nbytes,
        keys=adapter_keys,
        chunks=len(state),
        skipped=(),
        seconds=time.perf_counter() - started,
        checks=(
            f"{tensors} PEFT tensors re-opened; r={lora.rank}, lora_alpha={lora.alpha:g}; "
            f"targets: {', '.join(lora.target_modules)}",
        ),
    )
    for line in report.lines():
        logger.info("%s", line)
    return report


def _verify_hf(
    directory: Path, writer: SafetensorsWriter, sums: _Checksums | None, meta: Mapping, target: torch.dtype | None
) -> list[str]:
    count = check_written(writer.entries)
    checks = [
        f"{count} tensors in {len({e.path for e in writer.entries.values()})} safetensors "
        "files re-opened with safe_open: names, shapes, dtypes, index"
    ]
    if sums is None:
        return checks
    written = sums.values()
    again = _file_checksums(directory)
    bad = [n for n in written if again.get(n) != written[n]]
    if bad:
        raise ValueError(f"{directory}: tensor {bad[0]!r} reads back with a different checksum")
    checks.append(f"CRC32 of all {len(written)} tensors read back from the written files")
    recorded = meta.get("hf_checksums_crc32")
    if recorded and target is None:
        differ = [n for n in written if recorded.get(n) != written[n]]
        if differ:
            raise ValueError(
                f"tensor {differ[0]!r} differs from the HF source it was converted from "
                "(CRC32 recorded in hybridflow.json)"
            )
        checks.append(f"CRC32 of all {len(written)} tensors equal the original HF checkpoint's")
    return checks


def _file_checksums(directory: Path) -> dict[str, int]:
    """CRC32 of every written tensor, re-read from disk in row blocks."""
    reader = SafetensorsReader(directory)
    sums = _Checksums()
    try:
        for name, entry in reader.tensors.items():
            step = max(1, (16 << 20) // max(entry.row_bytes, 1))
            for start in range(0, entry.shape[0], step):
                stop = min(start + step, entry.shape[0])
                rows = torch.empty((stop - start,) + entry.shape[1:], dtype=entry.dtype)
                reader.read_rows(name, (start, stop), rows)
                sums.add(name, (start, stop), rows)
    finally:
        reader.close()
    return sums.values()
