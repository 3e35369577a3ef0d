"""How a run's settings start SGLang: a replica's driver engine (or its part on another node) and a
judge's (``hfschema.engines.ENGINES["sglang"].start`` / ``.judge_args``).

The runtime calls these with torchrun's variables already out of the environment
(``runtime.session.plain_engine_env``), which SGLang would read as its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.config import HybridflowConfig


def start_replica(cfg: HybridflowConfig, model_dir: Path, *, device: str, node_rank: int, dist_init_addr: str | None):
    """SGLang's engine (its scheduler processes of their own), or on node ``node_rank`` > 0 that
    node's part of an engine spanning nodes (``SGLangNode``). ``device``: SGLang places itself
    from the current CUDA device (``base_gpu_id``)."""
    from hybridflow.rollout import make_engine

    placement = {**engine_parallel_args(cfg), **node_args(cfg, node_rank, dist_init_addr)}
    common = dict(
        tp=cfg.rollout.tp,
        ep=cfg.rollout.ep,
        dtype=cfg.rollout.dtype,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=cfg.run.seed,
        load_format="dummy",
        deterministic=_deterministic(cfg),
        **placement,
    )
    if node_rank > 0:
        from hybridflow.rollout.sglang.engine import start_node

        return start_node(str(model_dir), **common)
    return make_engine(
        "sglang",
        model_path=str(model_dir),
        bucket_bytes=cfg.rollout.push_bucket_mb << 20,
        generate_timeout_s=cfg.rollout.generate_timeout_s,
        **common,
        **_adapter_slots(cfg),
    )


def judge_args(cfg: HybridflowConfig, *, device: str) -> dict[str, Any]:
    """The judge section as SGLang's factory arguments."""
    judge = cfg.judge
    where = {"base_gpu_id": torch.cuda.current_device()} if torch.cuda.is_available() else {}
    return dict(
        tp=judge.tp,
        dtype=judge.dtype,
        max_total_tokens=judge.max_total_tokens,
        seed=cfg.run.seed,
        generate_timeout_s=cfg.rollout.generate_timeout_s,
        **where,
    )


def engine_parallel_args(cfg: HybridflowConfig) -> dict[str, int]:
    """SGLang's parallel settings beyond tp and ep that the plan assumed (sent only when set):
    attention data parallelism (SGLang 0.5.23 calls it ``attn_dp_size``; its ``dp_size`` now
    means whole-model replicas, which hybridflow runs as ``rollout.num_replicas``) and MoE DP."""
    rollout = cfg.rollout
    args = {"attn_dp_size": rollout.dp_size if rollout.enable_dp_attention else 1, "moe_dp_size": rollout.moe_dp}
    return {key: value for key, value in args.items() if value != 1}


def node_args(cfg: HybridflowConfig, node_rank: int, dist_init_addr: str | None) -> dict[str, Any]:
    """Where this part of the engine runs: from this rank's GPU on (colocated: engine rank i on
    actor GPU i), and, for an engine spanning nodes, which node it is and how its nodes meet."""
    args: dict[str, Any] = {}
    if torch.cuda.is_available():
        args["base_gpu_id"] = torch.cuda.current_device()
    nodes = max(1, cfg.rollout.tp // cfg.rollout.gpus_per_node)
    if nodes > 1:
        args.update(nnodes=nodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    return args


def _adapter_slots(cfg: HybridflowConfig) -> dict:
    """SGLang's LoRA settings when the run pushes adapters (``lora.push=adapter``), else none."""
    if not cfg.lora.pushes_adapters:
        return {}
    from hfschema.lora import engine_target_modules
    from hybridflow.rollout.sglang.cpu import has_cuda_gpu
    from hybridflow.rollout.sglang.engine import lora_args

    return lora_args(
        rank=cfg.lora.rank, target_modules=engine_target_modules(cfg.lora.target_modules), on_cpu=not has_cuda_gpu()
    )


def _deterministic(cfg: HybridflowConfig) -> bool:
    """SGLang's deterministic inference under run.deterministic, on GPUs: SGLang refuses it on
    CPU, where the engine already reproduces (hybridflow/runtime/determinism.py)."""
    return cfg.run.deterministic and torch.cuda.is_available()
