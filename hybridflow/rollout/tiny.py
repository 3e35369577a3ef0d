"""Tiny Hugging Face checkpoints made on the spot: no download, a fixed seed, the hub's file layout.

```
make_tiny_model_dir(path, family)
   transformers config (tiny dims)  ──  random init under a forked, seeded RNG (HF init, std 0.02)
   ├─ config.json, generation_config.json, model.safetensors        (save_pretrained, float32)
   byte-level BPE trained on an in-code corpus (tokenizers)  ──  PreTrainedTokenizerFast
   └─ tokenizer.json, tokenizer_config.json (chat_template inside), special_tokens_map.json

to_hybridflow_model_config(path)
   config.json  ──  hfschema.hf_config  ──  hybridflow ModelConfig   (megatron builds the same model)
```

transformers (``AutoModelForCausalLM`` / ``AutoTokenizer``) and SGLang load such a directory as
they would a downloaded model. Each family's tiny transformers settings are part of its
registration (``hfschema.families``, ``Family.tiny``); its config.json reads back through the
same reader as any model directory's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfschema.families import FAMILIES
from hfschema.hf_config import read_model_config
from hfschema.model import ModelConfig

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_FAMILIES",
    "TOOL_CHAT_TEMPLATE",
    "make_tiny_model_dir",
    "make_tiny_tokenizer",
    "to_hybridflow_model_config",
]

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = {
    "unk_token": "<|endoftext|>",
    "pad_token": "<|pad|>",
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
}
"""Special tokens, in id order (ids 0-5); generation stops at ``<|eos|>`` and ``<|im_end|>``."""

# Qwen2's pre-tokenizer regex. transformers 5 rebuilds any model_type="qwen2" tokenizer as its
# Qwen2Tokenizer (NFC, this split, byte-level; unk "<|endoftext|>"): using the same pipeline
# (and having that token) makes every family's tokenizer encode alike whichever class loads it.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-style template (Qwen's layout)."""

TOOL_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:\\n' }}"
    "{% for t in tools %}{{ t | tojson + '\\n' }}{% endfor %}"
    '{{ \'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\\n\' }}{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""``CHAT_TEMPLATE`` with tools, in the layout of Qwen's: the tools' schemas in a system turn, and
each run of consecutive ``tool`` messages one user turn of ``<tool_response>`` blocks."""

# Enough text for a few dozen BPE merges; common chat words become single tokens.
_CORPUS = (
    "system user assistant",
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog.",
    "Solve 12 + 30 = 42. The answer is 42.",
    "Reinforcement learning trains the policy on its own samples and their rewards.",
    "hello world, hello there, how are you today?",
)

_TINY_DIMS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


TINY_FAMILIES: dict[str, Mapping[str, Any]] = {name: f.tiny for name, f in FAMILIES.items() if f.tiny}
"""Families ``make_tiny_model_dir`` builds, with their transformers settings on top of the shared
tiny dims (``Family.tiny``); the key is transformers' ``model_type``."""


def _family(name: str) -> Mapping[str, Any]:
    """A mapped family's tiny settings; any other transformers ``model_type`` (an architecture only
    ``actor.backend=fsdp2`` trains) gets the shared tiny dims alone."""
    if name in TINY_FAMILIES:
        return TINY_FAMILIES[name]
    from transformers import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        raise ValueError(
            f"model family {name!r} is neither one of {', '.join(TINY_FAMILIES)} nor a transformers model_type"
        )
    return {}


# --------------------------------------------------------------------------- tokenizer


def make_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of at most ``vocab_size`` tokens, chat-ready.

    Every byte is in the vocabulary, so any text encodes; the merges come from a small in-code
    corpus (training is deterministic). Special tokens take ids 0-5 (``SPECIAL_TOKENS``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} must be >= {minimum} (256 bytes + special tokens)")
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    named = {key: SPECIAL_TOKENS[key] for key in ("unk_token", "pad_token", "bos_token", "eos_token")}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **named,
        extra_special_tokens=[SPECIAL_TOKENS["im_start"], SPECIAL_TOKENS["im_end"]],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _save_tokenizer(tokenizer, path: Path) -> None:
    # The chat template goes into tokenizer_config.json (not chat_template.jinja) and the class
    # is named PreTrainedTokenizerFast, so older loaders read the directory as well.
    tokenizer.save_pretrained(str(path), save_jinja_files=False)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# --------------------------------------------------------------------------- model


def _token_ids(tokenizer) -> dict[str, Any]:
    eos, im_end = tokenizer.convert_tokens_to_ids([SPECIAL_TOKENS[k] for k in ("eos_token", "im_end")])
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=[eos, im_end])


def _build_config(family: str, token_ids: Mapping[str, Any], vocab_size: int, overrides: Mapping[str, Any]):
    from transformers import AutoConfig

    settings = {**_TINY_DIMS, **_family(family), **overrides}
    return AutoConfig.for_model(
        family,
        vocab_size=vocab_size,
        dtype="float32",
        **settings,
        pad_token_id=token_ids["pad_token_id"],
        bos_token_id=token_ids["bos_token_id"],
        eos_token_id=token_ids["eos_token_id"][0],
    )


def _build_model(family: str, token_ids: Mapping[str, Any], vocab_size: int, seed: int, overrides: Mapping[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    config = _build_config(family, token_ids, vocab_size, overrides)
    # fork_rng: the seed fixes these weights without moving the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config.update(**token_ids)
    return model


def make_tiny_model_dir(
    path: str | Path,
    family: str,
    *,
    seed: int = 0,
    vocab_size: int = 320,
    weights: bool = True,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random ``family`` model and its tokenizer into ``path``; return the path.

    ``family`` is one of ``TINY_FAMILIES`` or any other transformers model_type (the shared tiny
    dims alone); ``overrides`` are transformers config values
    (``num_hidden_layers=4``, ``tie_word_embeddings=True``, ...). The model's vocabulary is
    ``vocab_size``; the tokenizer's is at most that. The same arguments give the same files.
    ``weights=False`` writes the configs and the tokenizer only (no model is built: any size
    works), for an engine that starts without weights and receives them by push.
    ``max_shard_size`` (e.g. ``"40KB"``) splits the weights over several files with their index,
    as the hub ships larger models.
    """
    _family(family)  # an unknown family fails before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(vocab_size)
    token_ids = _token_ids(tokenizer)
    if weights:
        model = _build_model(family, token_ids, vocab_size, seed, overrides)
        model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    else:
        from transformers import GenerationConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = _build_config(family, token_ids, vocab_size, overrides)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]]  # what save_pretrained of a model records
        config.save_pretrained(str(path))
        GenerationConfig(**token_ids).save_pretrained(str(path))
    _save_tokenizer(tokenizer, path)
    logger.debug("tiny %s model%s written to %s", family, "" if weights else " (no weights)", path)
    return path


# --------------------------------------------------------------------------- ModelConfig


def to_hybridflow_model_config(path: str | Path) -> ModelConfig:
    """hybridflow's ``ModelConfig`` of the transformers model whose config.json is in ``path``
    (the one reader, ``hfschema.hf_config``)."""
    return read_model_config(path)
