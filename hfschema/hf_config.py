"""What the checkpoint converters need from a Hugging Face model directory, without torch.

```
HF dir ── config.json ──► model_type ──► HF_CONFIG_READERS[model_type] ──► ModelConfig
       ├─ tokenizer*, generation_config.json, ... ──► side_files(): copied verbatim both ways
       └─ *.safetensors (+ model.safetensors.index.json) ──► the weights (megatron_adapters.convert)
```

Readers are registered per ``model_type`` (transformers' name for the architecture) with the rest
of each family (``hfschema.families``); each turns the raw ``config.json`` into hybridflow's
``ModelConfig`` fields. Settings megatron-core would
compute differently are refused, naming the key, in two tables: ``HF_FIXED`` for ``config.json``
keys that have no ``ModelConfig`` field (sliding windows, MLP biases, router jitter), and
``ModelConfig``'s own ``FAMILY_FIXED`` / ``ROUTER_RULES`` for those that do (they also guard the
YAML config). An absent key reads as transformers' default for it.
A ``model_type`` no family maps reads, where the caller allows it (``model.path`` of an FSDP2
actor), as the ``transformers`` family: the shape keys most decoder configs share (``read_unmapped``).
The converters themselves live in ``megatron_adapters.convert``; ``hybridflow convert`` calls them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfschema.families import FAMILIES, ConfigKeys
from hfschema.layout import ConfigError
from hfschema.model import UNMAPPED_FAMILY, ModelConfig, ScoreModelConfig

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_SHARD_BYTES",
    "HF_CONFIG_READERS",
    "HF_FIXED",
    "SIDE_FILE_DIR",
    "IGNORED_TENSORS",
    "WEIGHT_INDEX",
    "is_ignored_tensor",
    "read_hf_config",
    "read_model_config",
    "read_unmapped",
    "SCORE_SUFFIX",
    "side_files",
]

DEFAULT_BUFFER_BYTES = 1 << 30
"""Tensor data a converter holds in memory at a time, by default."""
DEFAULT_SHARD_BYTES = 4 << 30
"""Largest safetensors file mcore-to-hf writes, by default."""
SIDE_FILE_DIR = "hf_files"
"""Folder of a converted Megatron checkpoint holding the HF directory's non-weight files."""
WEIGHT_INDEX = "model.safetensors.index.json"
"""The sharded-checkpoint index file Hugging Face uses."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: a Hugging Face model directory needs config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def read_model_config(directory: str | Path, *, unmapped: bool = False) -> ModelConfig:
    """hybridflow's ``ModelConfig`` for the model in ``directory`` (its ``config.json``).
    ``unmapped``: a ``model_type`` no family maps reads as the ``transformers`` family (the caller
    trains it with transformers' own class) instead of being refused."""
    config = read_hf_config(directory)
    where = Path(directory) / "config.json"
    model_type = config.get("model_type")
    keys = ConfigKeys(config, where)
    if model_type not in HF_CONFIG_READERS:
        if not unmapped or not model_type:
            raise ValueError(
                f"{where}: model_type={model_type!r} is not mapped onto megatron-core (mapped: "
                f"{', '.join(HF_CONFIG_READERS)}); as a policy (model.path) actor.backend=fsdp2 trains it "
                "with transformers' own class"
            )
        return _read(keys, lambda: ModelConfig(family=UNMAPPED_FAMILY, **read_unmapped(keys)))
    for key, value, why in HF_FIXED[model_type]:
        if keys.get(key, value) != value:
            keys.refuse(key, f"{why}; only {key}={value!r} maps")
    kind = ScoreModelConfig if _is_score_model(config, where) else ModelConfig
    return _read(keys, lambda: kind(family=model_type, **HF_CONFIG_READERS[model_type](keys)))


def _read(keys: ConfigKeys, build: Callable[[], ModelConfig]) -> ModelConfig:
    """``build()``, a missing key or a value ``ModelConfig`` refuses named with the file."""
    where = keys.where
    try:
        return build()
    except KeyError as error:
        raise ValueError(f"{where}: required key {error.args[0]!r} is missing") from None
    except ConfigError as error:  # a value ModelConfig refuses (e.g. FAMILY_FIXED): name the file
        raise ValueError(f"{where}: {error}") from None


_UNMAPPED_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys by which architectures transformers ships declare routed experts."""


def read_unmapped(c: ConfigKeys) -> dict[str, Any]:
    """``ModelConfig`` fields of a dense decoder no family maps, from the keys transformers' decoder
    configs share (GPT-2's names too). They size the plan's estimates; the model itself is what
    transformers' class builds from config.json, so nothing here is refused for differing."""
    if c.get("is_encoder_decoder", False):
        c.refuse("is_encoder_decoder", "an encoder-decoder model is not a causal LM a policy samples from")
    for key in _UNMAPPED_EXPERTS:
        if c.get(key, 0):
            c.refuse(key, "routed experts train only in a mapped MoE family (actor.backend=megatron)")
    hidden = c.get("hidden_size") or c["n_embd"]
    heads = c.get("num_attention_heads") or c["n_head"]
    theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return dict(
        hidden_size=hidden,
        num_layers=c.get("num_hidden_layers") or c["n_layer"],
        num_attention_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim", hidden // heads),
        ffn_hidden_size=c.get("intermediate_size") or c.get("n_inner") or 4 * hidden,
        vocab_size=c["vocab_size"],
        max_position_embeddings=c.get("max_position_embeddings") or c["n_positions"],
        rope_theta=float(theta),
        norm_eps=c.get("rms_norm_eps", c.get("layer_norm_eps", c.get("layer_norm_epsilon", 1e-6))),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_experts=0,
    )


SCORE_SUFFIX = "ForSequenceClassification"
"""transformers' class-name suffix of a model ending in a score head (a reward model)."""


def _is_score_model(config: dict[str, Any], where: Path) -> bool:
    """Whether ``architectures`` names a sequence-classification class; only one label maps (a
    reward model's single score)."""
    if not any(str(a).endswith(SCORE_SUFFIX) for a in config.get("architectures") or ()):
        return False
    labels = config.get("num_labels", len(config.get("id2label") or {0: None}))
    if labels != 1:
        raise ValueError(
            f"{where}: a sequence-classification model with {labels} labels; a reward model has "
            "one score (num_labels=1, id2label with one entry)"
        )
    return True


def side_files(directory: str | Path) -> list[Path]:
    """The directory's non-weight files (config, tokenizer, generation config, chat template)."""
    return sorted(
        p
        for p in Path(directory).iterdir()
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != WEIGHT_INDEX
    )


HF_FIXED: dict[str, tuple[tuple[str, Any, str], ...]] = {name: f.hf_fixed for name, f in FAMILIES.items()}
"""Per ``model_type``: ``config.json`` keys without a ``ModelConfig`` field whose other values
megatron_adapters would compute differently: (key, the one value that maps, why); ``Family.hf_fixed``.
An absent key reads as that value: transformers' default (it has none for topk_method and
scoring_func, which its DeepSeek-V3 ignores)."""

HF_CONFIG_READERS: dict[str, Callable[[ConfigKeys], dict[str, Any]]] = {name: f.read for name, f in FAMILIES.items()}
"""``config.json`` ``model_type`` -> ``ModelConfig`` fields (the family is the model_type)."""

IGNORED_TENSORS: dict[str, Callable[[str, ModelConfig], bool]] = {
    name: f.ignored_tensor for name, f in FAMILIES.items() if f.ignored_tensor is not None
}
"""Per family: checkpoint tensors that are not part of the model megatron builds (skipped, counted)."""


def is_ignored_tensor(model: ModelConfig, name: str) -> bool:
    """Whether ``name`` is a known tensor of the family that the converter skips."""
    rule = IGNORED_TENSORS.get(model.family)
    return rule is not None and rule(name, model)
