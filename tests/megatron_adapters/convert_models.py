"""Tiny Hugging Face model directories of every registered family, made with transformers' own classes.

Weights are random (transformers' init, then norms, biases and DeepSeek's expert-score bias moved
off their constant init so that a swapped or dropped tensor changes the output), written as a
hub model is: two safetensors shards with their index, the tokenizer with its chat template,
generation_config.json. Layers: 4, so PP=2
splits them; vocabulary 320 (megatron pads it to 384 at TP=1 and 512 at TP=2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hfschema.families import FAMILIES as REGISTERED
from hybridflow.rollout.tiny import make_tiny_model_dir, make_tiny_tokenizer

FAMILIES = tuple(REGISTERED)
"""Every registered family (``hfschema.families``): a new one is converted and loaded here too."""
MOE_FAMILIES = tuple(name for name, f in REGISTERED.items() if f.is_moe)
INIT_RANGE = 0.2
"""10x transformers' default std: clear greedy margins, as tests/rollout/sglang/reference.py."""
_OVERRIDES = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True},  # as Qwen3-0.6B to 4B ship
    "qwen3_moe": {},
    "mixtral": {},
}
_DEEPSEEK = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=INIT_RANGE,
)


def _deepseek_dir(path: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    tokenizer = make_tiny_tokenizer(320)
    config = DeepseekV3Config(
        **_DEEPSEEK,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _perturb(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    out = {}
    for name, t in tensors.items():
        if "norm" in name or name.endswith(("bias", "e_score_correction_bias")):
            t = t + 0.1 * torch.randn(t.shape, generator=g)
        out[name] = t.contiguous()
    return out


def _rewrite_weights(path: Path, seed: int, shards: int) -> None:
    files = sorted(path.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors = _perturb(tensors, seed)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def make_hf_dir(root: Path, family: str, seed: int = 0) -> Path:
    """A tiny ``family`` HF directory under ``root`` (4 layers, vocabulary 320)."""
    path = root / f"hf_{family}"
    if family == "deepseek_v3":
        _deepseek_dir(path, seed)
    else:
        make_tiny_model_dir(
            path, family, seed=seed, num_hidden_layers=4, initializer_range=INIT_RANGE, **_OVERRIDES[family]
        )
    _rewrite_weights(path, seed, shards=2)
    return path


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory, by name."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
