"""An FSDP2 policy's weights leaving it: whole tensors under their Hugging Face names, a bounded
bucket at a time (the weight push into an engine), and a Hugging Face directory (the run's model).

The model is transformers' own class, so its parameter names are the checkpoint's: nothing is
renamed or re-laid, each tensor is gathered from the data-parallel shards (an all-gather every
rank takes part in) and let go with its bucket.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hfschema.buckets import fill_buckets
from hfschema.files import staged_directory

__all__ = ["TOKENIZER_FILES", "export_checkpoint", "hf_buckets", "save_hf_directory"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)
"""What a model directory carries beside its weights and config, copied from the starting one."""


def hf_buckets(policy, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every parameter, whole, under its Hugging Face name, in buckets of about ``bucket_bytes``
    (one tensor larger than that is a bucket of its own); every rank must iterate in step."""
    named = list(policy.model.named_parameters())
    sizes = [p.numel() * p.element_size() for _, p in named]
    for bucket in fill_buckets(named, sizes, bucket_bytes):
        yield [(name, param.full_tensor().detach()) for name, param in bucket]


def save_hf_directory(policy, out: str | Path, *, source: str | Path, overwrite: bool = False) -> Path | None:
    """The policy's model as a Hugging Face directory (rank 0 writes it; every rank calls it):
    the weights in safetensors, the config, and the starting directory's tokenizer files and chat
    template. Returns the directory on rank 0, None elsewhere."""
    state = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    from transformers import AutoModelForCausalLM

    source = Path(source)
    with staged_directory(out, overwrite=overwrite, sources=(source,)) as staging:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(policy.model.config, dtype=torch.float32)
        model.load_state_dict(state, assign=True, strict=False)
        model.tie_weights()
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not (staging / name).exists():
                shutil.copy2(source / name, staging / name)
    return Path(out)


def export_checkpoint(
    checkpoint_dir: str | Path, out: str | Path, *, hf_config: str | Path | None = None, overwrite: bool = False
) -> int:
    """A checkpoint ``checkpoint.save`` wrote, as a Hugging Face directory, read by this process
    alone (no collective: the run's driver exports while the other ranks wait): the model's
    tensors, config.json and the tokenizer files of ``hf_config`` (default: the checkpoint's own
    ``hf_files``). Returns the weights' bytes. The whole model passes through this host's memory
    once (the megatron backend's converter streams it; dense FSDP2 models are the smaller ones)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig

    from hfschema.hf_config import SIDE_FILE_DIR, side_files

    from .checkpoint import read_meta

    source = Path(checkpoint_dir)
    read_meta(source)
    files = Path(hf_config) if hf_config is not None else source / SIDE_FILE_DIR
    if not (files / "config.json").is_file():
        raise ValueError(f"{files / 'config.json'} is missing: pass hf_config= the model's config directory")
    stored = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(source), no_dist=True)
    tensors = {key.removeprefix("model."): t.contiguous() for key, t in state.items()}
    config = AutoConfig.from_pretrained(files)
    if getattr(config, "tie_word_embeddings", False):  # saved once, as the input embedding (as save_pretrained)
        tensors = _without_tied_copy(tensors)
    with staged_directory(out, overwrite=overwrite, sources=(source, files)) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        for file in side_files(files):
            shutil.copy2(file, staging / file.name)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _without_tied_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs = [n for n in tensors if n.endswith("embed_tokens.weight")]
    if len(inputs) == 1 and "lm_head.weight" in tensors:
        return {n: t for n, t in tensors.items() if n != "lm_head.weight"}
    return tensors
