"""What the SGLang engine is checked against: transformers on the same model directory, and the
reshard oracle's per-rank SGLang tensors (``tests/reshard/oracle.py``, written from SGLang's
loaders, not from the adapter)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hfschema.sglang import SGLangSettings
from hybridflow.rollout.tiny import make_tiny_model_dir, to_hybridflow_model_config
from tests.reshard.oracle import sglang_params

INIT_RANGE = 0.2
"""Weight init std of the tiny models: 10x HF's default, so greedy decoding has clear margins
(near-uniform logits would make "token-identical" hang on 1e-6 differences between two fp32
engines)."""


def tiny_model_dir(root: Path, family: str, seed: int) -> Path:
    """A tiny ``family`` model directory (hybridflow.rollout.tiny) under ``root``."""
    return make_tiny_model_dir(root / f"{family}-seed{seed}", family, seed=seed, initializer_range=INIT_RANGE)


def load_hf(path: Path) -> torch.nn.Module:
    """transformers' model from the directory, float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()
) -> list[list[int]]:
    """transformers ``generate(do_sample=False)`` one prompt at a time (no padding); prompt removed."""
    eos = list(model.generation_config.eos_token_id) + list(stop_token_ids)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
            )
        out.append(full[0, len(prompt) :].tolist())
    return out


def hf_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs (unscaled) of ``response`` after ``prompt``."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The directory's tensors under HF checkpoint names (per-expert for MoE)."""
    return load_file(str(Path(path) / "model.safetensors"))


def rank_tensors(path: Path, tp: int, ep: int = 1) -> list[dict[str, torch.Tensor]]:
    """Each SGLang TP rank's parameters (engine ``tp``, ``ep``), unpadded, as the reshard plan lays
    them out (the oracle)."""
    hf = {name: t.numpy() for name, t in checkpoint_tensors(path).items()}
    config = to_hybridflow_model_config(path)
    return [
        {
            name: torch.from_numpy(np.ascontiguousarray(a))
            for name, a in sglang_params(config, SGLangSettings(tp=tp, ep=ep), hf, rank).items()
        }
        for rank in range(tp)
    ]


def child_processes() -> list[psutil.Process]:
    """This process's descendants."""
    return psutil.Process().children(recursive=True)
