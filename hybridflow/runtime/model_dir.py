"""The Hugging Face model directory the rollout engine starts from.

SGLang starts from a model directory and then only ever receives the actor's weights through
the reshard plan, so the directory holds no weights at all: its configs (which must describe
exactly the model megatron-core builds) and the tokenizer. The engine starts with
``load_format="dummy"`` and the run's first push fills every parameter, so no checkpoint of a
100B+ model is written or read for it:

    cfg.model (ModelConfig) --hf_overrides--> transformers config --make_tiny_model_dir(weights=False)--> dir
    dir --to_hybridflow_model_config--> ModelConfig  ==  cfg.model ?   (else ValueError per field)

The directory is written under a temporary name and renamed, and reused when it already holds
the same model (a resumed run). A run that starts from ``model.path`` gets that model's own
files instead (config.json, tokenizer, chat template, generation_config.json; no weights):
``run_model_dir`` copies them, so the engines, the tokenizer and ``convert mcore-to-hf`` of the
run's checkpoints all read the model the run started from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from hfschema.families import FAMILIES
from hfschema.files import publish_directory
from hfschema.hf_config import side_files
from hfschema.model import ModelConfig
from hfschema.model_source import model_source

__all__ = ["GENERATED_FAMILIES", "copy_model_files", "hf_overrides", "rollout_model_dir", "run_model_dir"]

logger = logging.getLogger(__name__)

GENERATED_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.write is not None and f.tiny)
"""Families a random model's starting directory can be written for (``Family.write``)."""


def _family_overrides(model: ModelConfig) -> dict[str, Any]:
    if model.family not in GENERATED_FAMILIES:
        raise ValueError(
            f"model.family={model.family!r}: the run can write a starting model directory for "
            f"{', '.join(GENERATED_FAMILIES)} only; set model.path to a model directory of that family"
        )
    return FAMILIES[model.family].write(model)


def hf_overrides(model: ModelConfig) -> dict[str, Any]:
    """transformers config values that make the tiny family model equal ``model``."""
    common = dict(
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=model.kv_channels,
        intermediate_size=model.ffn_hidden_size,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
    )
    return {**common, **_family_overrides(model)}


def _mismatches(expected: ModelConfig, got: ModelConfig) -> list[str]:
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    return [
        f"model.{name}: config {getattr(expected, name)!r}, directory {getattr(got, name)!r}"
        for name in fields
        if getattr(expected, name) != getattr(got, name)
    ]


def _matches(path: Path, model: ModelConfig) -> bool:
    from hybridflow.rollout.tiny import to_hybridflow_model_config

    try:
        return not _mismatches(model, to_hybridflow_model_config(path))
    except Exception:  # unreadable or foreign directory: rewrite it
        return False


def rollout_model_dir(model: ModelConfig, path: str | os.PathLike, *, seed: int) -> Path:
    """Write (or reuse) a model directory for ``model`` at ``path``; ValueError if it cannot match."""
    from hybridflow.rollout.tiny import make_tiny_model_dir, to_hybridflow_model_config

    final = Path(path)
    if (final / "config.json").is_file() and _matches(final, model):
        return final
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    make_tiny_model_dir(
        staging, model.family, seed=seed, vocab_size=model.vocab_size, weights=False, **hf_overrides(model)
    )
    problems = _mismatches(model, to_hybridflow_model_config(staging))
    if problems:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError("the rollout model directory cannot describe this model: " + "; ".join(problems))
    publish_directory(staging, final)
    logger.info("wrote the rollout engine's starting model directory %s", final)
    return final


def run_model_dir(model: ModelConfig, path: str | os.PathLike, *, seed: int) -> Path:
    """The run's model directory: the files of ``model.path``'s model, or a generated one."""
    if getattr(model, "path", None):
        return copy_model_files(model_source(model.path).files, path)
    return rollout_model_dir(model, path, seed=seed)


def copy_model_files(source: Path, path: str | os.PathLike) -> Path:
    """``source``'s non-weight files copied to ``path`` (kept when its config.json is the same)."""
    final = Path(path)
    if final.resolve() == source.resolve():
        return final
    config = final / "config.json"
    if config.is_file() and config.read_bytes() == (source / "config.json").read_bytes():
        return final
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for file in side_files(source):
        shutil.copy2(file, staging / file.name)
    publish_directory(staging, final)
    logger.info("copied the starting model's config and tokenizer files from %s to %s", source, final)
    return final
