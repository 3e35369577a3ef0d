"""What the checkpoint converters need from a Hugging Face model directory, without torch.

```
HF dir ── config.json ──► model_type ──► HF_CONFIG_READERS[model_type] ──► ModelConfig
       ├─ tokenizer*, generation_config.json, ... ──► side_files(): copied verbatim both ways
       └─ *.safetensors (+ model.safetensors.index.json) ──► the weights (megatron_adapters.convert)
```

Readers are registered per ``model_type`` (transformers' name for the architecture); each turns
the raw ``config.json`` into hybridflow's ``ModelConfig`` fields. Settings megatron-core would
compute differently are refused, naming the key, in two tables: ``HF_FIXED`` for ``config.json``
keys that have no ``ModelConfig`` field (sliding windows, MLP biases, router jitter), and
``ModelConfig``'s own ``FAMILY_FIXED`` / ``ROUTER_RULES`` for those that do (they also guard the
YAML config). An absent key reads as transformers' default for it.
The converters themselves live in ``megatron_adapters.convert``; ``hybridflow convert`` calls them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hfschema.layout import ConfigError
from hfschema.model import ModelConfig, RopeScalingConfig

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

Config = Mapping[str, Any]


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: a Hugging Face model directory needs config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def read_model_config(directory: str | Path) -> ModelConfig:
    """hybridflow's ``ModelConfig`` for the model in ``directory`` (its ``config.json``)."""
    config = read_hf_config(directory)
    where = Path(directory) / "config.json"
    model_type = config.get("model_type")
    if model_type not in HF_CONFIG_READERS:
        raise ValueError(
            f"{where}: model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(HF_CONFIG_READERS)}"
        )
    keys = _Keys(config, where)
    for key, value, why in HF_FIXED[model_type]:
        if keys.get(key, value) != value:
            keys.refuse(key, f"{why}; only {key}={value!r} maps")
    try:
        fields = HF_CONFIG_READERS[model_type](keys)
        return ModelConfig(family=model_type, **fields)
    except KeyError as error:
        raise ValueError(f"{where}: required key {error.args[0]!r} is missing") from None
    except ConfigError as error:  # a value ModelConfig refuses (e.g. FAMILY_FIXED): name the file
        raise ValueError(f"{where}: {error}") from None


def side_files(directory: str | Path) -> list[Path]:
    """The directory's non-weight files (config, tokenizer, generation config, chat template)."""
    return sorted(
        p for p in Path(directory).iterdir()
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != WEIGHT_INDEX
    )


class _Keys:
    """``config.json`` values; ``refuse`` raises a ValueError naming the file and key."""

    def __init__(self, config: Config, where: Path) -> None:
        self.config, self.where = config, where

    def __getitem__(self, key: str) -> Any:
        return self.config[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    def refuse(self, key: str, why: str) -> None:
        raise ValueError(f"{self.where}: {key}={self.config.get(key)!r}: {why}")


def _rope(c: _Keys) -> dict[str, Any]:
    """transformers 5 writes ``rope_parameters``; older configs ``rope_theta`` + ``rope_scaling``."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return {"theta": float(theta), "type": kind, "params": params}


def _plain_rope(c: _Keys) -> float:
    rope = _rope(c)
    if rope["type"] != "default":
        c.refuse("rope_parameters", f"rope_type {rope['type']!r}: only plain RoPE maps onto "
                 "megatron-core for this family")
    return rope["theta"]


def _common(c: _Keys) -> dict[str, Any]:
    heads = c["num_attention_heads"]
    return dict(
        hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
        num_attention_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim", c["hidden_size"] // heads),
        ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"], norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _llama(c: _Keys) -> dict[str, Any]:
    return dict(_common(c), rope_theta=_plain_rope(c), num_experts=0,
                attention_bias=bool(c.get("attention_bias", False)))


def _qwen2(c: _Keys) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases; its config has no switch for them.
    return dict(_common(c), rope_theta=_plain_rope(c), num_experts=0, attention_bias=True)


def _qwen3_moe(c: _Keys) -> dict[str, Any]:
    return dict(
        _common(c), rope_theta=_plain_rope(c), qk_layernorm=True,
        # the hub's configs say num_experts; transformers 5 writes its alias num_local_experts
        attention_bias=bool(c.get("attention_bias", False)),
        num_experts=c.get("num_experts") or c["num_local_experts"],
        moe_top_k=c["num_experts_per_tok"], moe_ffn_hidden_size=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
    )


def _mixtral(c: _Keys) -> dict[str, Any]:
    # Mixtral's intermediate_size is each expert's; it always renormalises the top-k weights.
    return dict(
        _common(c), rope_theta=_plain_rope(c), num_experts=c["num_local_experts"],
        moe_top_k=c["num_experts_per_tok"], moe_ffn_hidden_size=c["intermediate_size"],
        norm_topk_prob=True,
    )


def _yarn(c: _Keys) -> tuple[float, RopeScalingConfig | None]:
    rope = _rope(c)
    if rope["type"] == "default":
        return rope["theta"], None
    if rope["type"] != "yarn":
        c.refuse("rope_parameters", f"rope_type {rope['type']!r}: DeepSeek-V3 maps with yarn only")
    p = rope["params"]
    scaling = RopeScalingConfig(
        type="yarn", factor=float(p["factor"]),
        original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast", 32.0)), beta_slow=float(p.get("beta_slow", 1.0)),
        mscale=float(p.get("mscale", 1.0)), mscale_all_dim=float(p.get("mscale_all_dim", 0.0)),
    )
    return rope["theta"], scaling


def _deepseek_groups(c: _Keys) -> tuple[int | None, int | None]:
    """(router_num_groups, router_group_topk); None when every group is chosen: both sides then
    route by plain top-k, and megatron-core is spared group scores that change nothing."""
    groups, chosen = c.get("n_group", 8), c.get("topk_group", 4)  # transformers' defaults
    return (None, None) if chosen == groups else (groups, chosen)


def _deepseek_v3(c: _Keys) -> dict[str, Any]:
    theta, scaling = _yarn(c)
    groups, chosen = _deepseek_groups(c)
    common = _common(c)
    return dict(
        common, head_dim=c["v_head_dim"], num_kv_heads=common["num_attention_heads"],
        rope_theta=theta, rope_scaling=scaling, num_experts=c["n_routed_experts"],
        moe_top_k=c["num_experts_per_tok"], moe_ffn_hidden_size=c["moe_intermediate_size"],
        # transformers always multiplies by routed_scaling_factor and renormalises by norm_topk_prob
        num_shared_experts=c.get("n_shared_experts", 1), router_score_function="sigmoid",
        router_expert_bias=True, router_topk_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), router_num_groups=groups,
        router_group_topk=chosen, first_k_dense_layers=c.get("first_k_dense_replace", 3),
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
    )


_SILU = ("hidden_act", "silu", "megatron_adapters builds SwiGLU (silu) MLPs only")
HF_FIXED: dict[str, tuple[tuple[str, Any, str], ...]] = {
    "llama": (_SILU, ("mlp_bias", False, "MLP biases are not supported (megatron_adapters sets "
                      "add_bias_linear=False)")),
    "qwen2": (_SILU, ("use_sliding_window", False, "sliding-window attention is not built by "
                      "megatron_adapters")),
    "qwen3_moe": (
        _SILU,
        ("mlp_only_layers", [], "only all-MoE models map onto ModelConfig"),
        ("decoder_sparse_step", 1, "only all-MoE models map onto ModelConfig"),
    ),
    "mixtral": (_SILU, ("router_jitter_noise", 0.0, "transformers multiplies the MoE block's input "
                        "(the experts' too) by uniform noise when training; megatron_adapters adds "
                        "none, and megatron-core's moe_input_jitter_eps would jitter the router's "
                        "input only")),
    "deepseek_v3": (
        _SILU,
        ("rope_interleave", True, "megatron-core's MLA applies RoPE to interleaved channels"),
        ("topk_method", "noaux_tc", "only the aux-loss-free router maps (its gate.e_score_correction_bias "
         "is router.expert_bias; SGLang builds that tensor for noaux_tc alone)"),
        ("scoring_func", "sigmoid", "megatron_adapters routes DeepSeek-V3 by sigmoid scores, as "
         "transformers does whatever the key says"),
        ("moe_layer_freq", 1, "only MoE in every layer after first_k_dense_replace maps (SGLang makes "
         "layers with layer % moe_layer_freq != 0 dense)"),
        ("attention_bias", False, "MLA's projections map without biases (SGLang builds none)"),
    ),
}
"""Per ``model_type``: ``config.json`` keys without a ``ModelConfig`` field whose other values
megatron_adapters would compute differently: (key, the one value that maps, why). An absent key
reads as that value: transformers' default (it has none for topk_method and scoring_func, which
its DeepSeek-V3 ignores)."""

HF_CONFIG_READERS: dict[str, Callable[[_Keys], dict[str, Any]]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
}
"""``config.json`` ``model_type`` -> ``ModelConfig`` fields (the family is the model_type)."""


def _deepseek_mtp(name: str, model: ModelConfig) -> bool:
    """DeepSeek-V3's multi-token-prediction layers follow the last decoder layer
    (``model.layers.61.*`` in the released checkpoint); transformers skips them too."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= model.num_layers)


IGNORED_TENSORS: dict[str, Callable[[str, ModelConfig], bool]] = {"deepseek_v3": _deepseek_mtp}
"""Per family: checkpoint tensors that are not part of the model megatron builds (skipped, counted)."""


def is_ignored_tensor(model: ModelConfig, name: str) -> bool:
    """Whether ``name`` is a known tensor of the family that the converter skips."""
    rule = IGNORED_TENSORS.get(model.family)
    return rule is not None and rule(name, model)
