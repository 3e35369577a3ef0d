"""An FSDP2 policy's weights leaving it: whole tensors under their Hugging Face names, a bounded
bucket at a time (the weight push into an engine), and a Hugging Face directory (the run's model).

The model is transformers' own class, so its parameter names are the checkpoint's: nothing is
renamed or re-laid, each tensor is gathered from the data-parallel shards (an all-gather every
rank takes part in) and let go with its bucket.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hfschema.buckets import fill_buckets
from hfschema.files import staged_directory

__all__ = ["TOKENIZER_FILES", "hf_buckets", "save_hf_directory"]

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
