"""Tiny reward-model directories as transformers writes them: a causal LM of
``tests/megatron_adapters/convert_models`` under a one-label score head."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hfschema.hf_config import side_files
from tests.megatron_adapters.convert_models import make_hf_dir


def make_rm_dir(root: Path, family: str, seed: int = 0) -> Path:
    """``<root>/rm_<family>``: transformers' ``*ForSequenceClassification`` (num_labels=1) of a
    tiny ``family`` model, its score head drawn from ``seed``, with the model's tokenizer."""
    from transformers import AutoModelForSequenceClassification

    causal = make_hf_dir(root, family, seed)
    path = root / f"rm_{family}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        net = AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1, dtype=torch.float32)
        with torch.no_grad():
            net.score.weight.normal_(0.0, 0.5)
    net.config.pad_token_id = net.config.pad_token_id if net.config.pad_token_id is not None else 0
    net.save_pretrained(str(path))
    for f in side_files(causal):
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, path / f.name)
    return path


def padded_ids(vocab: int, pad: int, lengths: tuple[int, ...] = (16, 12, 9, 5), seed: int = 7) -> torch.Tensor:
    """Rows of random non-padding tokens cut at ``lengths`` and right-padded with ``pad``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (len(lengths), max(lengths)), generator=g)
    ids[ids >= pad] += 1  # never the padding id inside a row
    for row, n in enumerate(lengths):
        ids[row, n:] = pad
    return ids


def transformers_scores(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own scores of ``ids`` on the directory (fp32)."""
    from transformers import AutoModelForSequenceClassification

    net = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return net(ids).logits[:, 0].float()
