"""Host memory of a run whose processes all share one machine without a GPU (the quickstart, a
first run of a small model on a laptop): what ``plan`` says beside its per-GPU answer there, and
what preflight compares with the memory the machine has free.

On a CPU every process is a Python interpreter holding torch, megatron-core and SGLang's modules
before it holds any tensor, so a small model's run is mostly that: the launcher, torchrun's agent,
each trainer rank, each engine rank's SGLang scheduler and each engine's detokenizer (their
proportional set sizes, seen on this project's CPU runs: ``benchmarks/host_memory.py``). The
model's part is measured too, per parameter a trainer rank holds: ``BYTES_PER_RANK_PARAM``
covers the rank's fp32 weights, gradients and Adam moments (16 B), their copy in the engine
processes forked from the rank (``rollout.sglang.cpu.forked_engine_processes``: the pages the
rank rewrites while it trains stay the child's), the engine's own weights, the weight push's
staging and what the allocator keeps of the passes' temporaries. Per token: the activations in
fp32, the attention scores a CPU keeps (no flash attention) and the vocabulary-wide logits; the
engines' KV cache. Not counted: frozen models (reward models, teachers, judges), page cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hfschema.engines import ENGINES
from hybridflow.config import HybridflowConfig, enabled_roles
from hybridflow.memory import GIB, TRAINER_MEMORY, engine_components, training_components

PROCESS_BYTES = {
    "launcher": int(0.45 * GIB),
    "launcher tokenizer": int(0.45 * GIB),
    "torchrun agent": int(0.40 * GIB),
    "trainer rank": int(0.55 * GIB),
    "engine scheduler": int(0.45 * GIB),
    "engine detokenizer": int(0.30 * GIB),
    "engine server": int(1.0 * GIB),
}
"""An idle process of each kind with what it imports (proportional set size, shared pages split):
``launcher tokenizer`` is transformers and the model's tokenizer, which a ``model.path`` run's
launcher loads to check the data. Seen on this project's CPU runs (``benchmarks/host_memory.py``)."""
BYTES_PER_RANK_PARAM = 100
"""Host bytes of the whole job per parameter a trainer rank holds (summed over its ranks): seen
95 and 104 on two shapes of a 60M-parameter Qwen3 under tp=2 (``benchmarks/host_memory.py``)."""
CPU_ACTIVATION_SCALE = 2  # fp32 activations where the GPU estimate counts bf16
SCORE_COPIES, SCORE_BYTES = 2, 4  # attention scores and their softmax, fp32


@dataclass(frozen=True)
class HostEstimate:
    parts: dict[str, int]
    """What -> bytes, over every process of the run."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        """One line: the total and its three largest parts."""
        largest = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in largest)
        return f"host memory on this CPU-only machine: about {self.total / GIB:.2f} GiB in all ({parts} GiB, ...)"


def _cpu_training(cfg: HybridflowConfig, role: str) -> dict[str, int]:
    """One trainer rank's part for ``role``: its parameters' share of the job, and per token."""
    _, parts = training_components(cfg, role)
    params = TRAINER_MEMORY[cfg.actor.backend].params_per_rank(cfg, role, parts)
    out = {f"{role} parameters": params * BYTES_PER_RANK_PARAM}
    if f"{role} activations" in parts:
        out[f"{role} activations"] = parts[f"{role} activations"] * CPU_ACTIVATION_SCALE + _score_bytes(cfg, role)
        out[f"{role} logits"] = parts[f"{role} logits"]
    return out


def _score_bytes(cfg: HybridflowConfig, role: str) -> int:
    layout, m = getattr(cfg, role).parallel, cfg.model
    length = cfg.data.max_prompt_length + cfg.data.max_response_length
    heads = -(-m.num_attention_heads // layout.tp)
    return SCORE_COPIES * SCORE_BYTES * cfg.train.micro_batch_size * heads * length * length


ENGINE_PROCESSES = {
    "schedulers": lambda ranks, replicas: (
        ranks * PROCESS_BYTES["engine scheduler"] + replicas * PROCESS_BYTES["engine detokenizer"]
    ),
    "server": lambda ranks, replicas: ranks * PROCESS_BYTES["engine server"],
    "none": lambda ranks, replicas: 0,  # inside the driver's process
}
"""Host bytes of the processes an engine starts beside the ranks (``EngineTraits.start_processes``),
from its ranks and replicas."""


def host_memory(cfg: HybridflowConfig) -> HostEstimate:
    """Every process of ``cfg``'s run on one machine: bases, trainer state, engines."""
    from hybridflow.preflight import process_count

    ranks = process_count(cfg)
    trainers = cfg.actor.parallel.world_size
    replicas = cfg.rollout.num_replicas
    engines = cfg.rollout.tp * replicas  # a scheduler each, colocated or not
    parts = {
        "launcher": PROCESS_BYTES["launcher"] + (PROCESS_BYTES["launcher tokenizer"] if cfg.model.path else 0),
        "torchrun agent": PROCESS_BYTES["torchrun agent"],
        "rank processes": ranks * PROCESS_BYTES["trainer rank"],
        "engine processes": ENGINE_PROCESSES[ENGINES[cfg.rollout.engine].start_processes](engines, replicas),
    }
    for role in [r for r in enabled_roles(cfg) if r in ("actor", "reference", "critic")]:
        for name, size in _cpu_training(cfg, role).items():
            parts[name] = size * trainers
    parts["engine KV cache"] = engine_components(cfg)["engine KV cache"] * engines
    return HostEstimate(parts)


def available_bytes() -> int | None:
    """The memory this machine has free for a new job (``MemAvailable``), None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def has_gpu_device() -> bool:
    """Whether this machine shows an NVIDIA device node (cheap: no torch, no driver call)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
