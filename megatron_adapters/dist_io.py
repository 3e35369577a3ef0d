"""megatron-core ``torch_dist`` checkpoints written and read a box at a time.

```
write:  chunks (convert_plan) ──► WriteItems (key, box, dtype, global shape) + _extra_state bytes
        torch.distributed.checkpoint.save(no_dist) with a planner whose resolve_data() builds
        each chunk only when the file writer asks for it (one chunk in memory at a time)
        + metadata.json and common.pt, written with megatron-core's own config type
read:   boxes (key, offsets, sizes) ──► ReadItems against the checkpoint's chunks
        (torch's create_read_items_for_chunk_list: any stored sharding is resharded)
        torch.distributed.checkpoint.load(no_dist) with a planner that narrows into the
        destinations; metadata parsed once and cached
```

The result is what ``megatron.core.dist_checkpointing.save`` writes (its ``TorchDistSaveShardedStrategy``
goes through the same torch.distributed.checkpoint writer) and what ``dist_checkpointing.load``
reads; stored chunks need not match any rank's shard, torch reshards on load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hfschema.files import shard_problems

__all__ = ["Box", "DistReader", "extra_state_bytes", "write_dist_checkpoint"]

Box = tuple[str, tuple[int, ...], tuple[int, ...]]
"""(key, offsets, sizes) of a box of a checkpoint tensor."""


@contextlib.contextmanager
def _one_process():
    """A single-process (no_dist) save / load: torch's warning about it silenced, and the error
    raised inside (a bad input file, a full disk) re-raised as itself rather than wrapped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as wrapped:
            errors = [error for error, _ in wrapped.failures.values()]
            if len(errors) == 1 and isinstance(errors[0], Exception):
                raise errors[0] from None
            raise


def extra_state_bytes() -> io.BytesIO:
    """What megatron stores for a local linear layer's ``_extra_state``: ``torch.save([None])``
    (its torch strategy saves a list of the ShardedObjects' data; the layers' state is None)."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    buffer.seek(0)
    return buffer


class _LazySavePlanner(SavePlanner):
    """Writes the given items; each tensor is built by ``make`` only when it is written."""

    def __init__(self, items: list[WriteItem], make: Callable[[WriteItem], torch.Tensor | io.BytesIO]):
        self.items, self.make = items, make

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self.make(write_item)


def _tensor_item(box: Box, dtype: torch.dtype, global_shape: tuple[int, ...]) -> WriteItem:
    key, offsets, sizes = box
    return WriteItem(
        index=MetadataIndex(key, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(global_shape),
        ),
    )


def write_dist_checkpoint(
    directory: str | os.PathLike,
    *,
    boxes: Sequence[Box],
    dtypes: Mapping[str, torch.dtype],
    shapes: Mapping[str, tuple[int, ...]],
    extra_states: Sequence[str],
    make: Callable[[int], torch.Tensor],
) -> None:
    """Write a megatron ``torch_dist`` checkpoint: tensor ``boxes[i]`` is ``make(i)``."""
    directory = Path(directory)
    items = [_tensor_item(box, dtypes[box[0]], shapes[box[0]]) for box in boxes]
    where = {(box[0], tuple(box[1])): i for i, box in enumerate(boxes)}
    items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in extra_states]

    def resolve(item: WriteItem) -> torch.Tensor | io.BytesIO:
        if item.type == WriteItemType.BYTE_IO:
            return extra_state_bytes()
        return make(where[(item.index.fqn, tuple(item.index.offset))])

    writer = FileSystemWriter(
        str(directory), single_file_per_rank=True, thread_count=1, sync_files=True, overwrite=True
    )
    with _one_process():
        dcp.save({}, storage_writer=writer, planner=_LazySavePlanner(items, resolve), no_dist=True)
    save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(directory))
    torch.save({}, directory / COMMON_STATE_FNAME)  # no non-tensor model state


# --------------------------------------------------------------------------------- reading


class _CachedReader(FileSystemReader):
    """A FileSystemReader that parses the (large) ``.metadata`` file once."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _BoxLoadPlanner(LoadPlanner):
    """Reads boxes of checkpoint tensors into destination tensors (request ids as fqns)."""

    def __init__(self, requests: Mapping[str, tuple[Box, torch.Tensor]]) -> None:
        self.requests = requests
        self.bytes: dict[str, io.BytesIO] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for rid, ((key, offsets, sizes), _) in self.requests.items():
            stored = self.metadata.state_dict_metadata[key]
            if isinstance(stored, BytesStorageMetadata):
                items.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=MetadataIndex(rid),
                        dest_offsets=torch.Size(()),
                        storage_index=MetadataIndex(key),
                        storage_offsets=torch.Size(()),
                        lengths=torch.Size(()),
                    )
                )
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for item in create_read_items_for_chunk_list(key, stored, [chunk]):
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(rid)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.bytes[read_item.dest_index.fqn] = value

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.requests[read_item.dest_index.fqn][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DistReader:
    """Boxes of the tensors of a ``torch_dist`` checkpoint directory."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        if not (self.directory / ".metadata").is_file():
            raise ValueError(f"{self.directory} is not a torch_dist checkpoint: .metadata is missing")
        self._reader = _CachedReader(self.directory)
        self.metadata = self._reader.read_metadata()
        problems = shard_problems(self.directory, self.metadata.storage_data)
        if problems:  # found now, in one line, not as a traceback from inside torch's reader mid-read
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(
                f"checkpoint {self.directory} is damaged: {problems[0]}{more}; restore the file "
                "from a copy, or convert an earlier checkpoint of the run"
            )

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Tensor keys and their global size, dtype and stored chunks."""
        return {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def objects(self) -> list[str]:
        """Keys of the stored byte objects (``_extra_state`` ...)."""
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]

    def read(self, boxes: Sequence[tuple[Box, torch.Tensor]]) -> None:
        """Fill each destination (shaped like its box) from the checkpoint."""
        requests = {f"box{i}": request for i, request in enumerate(boxes)}
        with _one_process():
            dcp.load({}, storage_reader=self._reader, planner=_BoxLoadPlanner(requests), no_dist=True)

    def read_object(self, key: str):
        """The unpickled content of a stored byte object."""
        planner = _BoxLoadPlanner({"obj": ((key, (), ()), torch.empty(0))})
        with _one_process():
            dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        buffer = planner.bytes["obj"]
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
