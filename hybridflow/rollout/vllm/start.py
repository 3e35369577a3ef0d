"""How a run's settings start vLLM: a replica's engine and a judge's
(``hfschema.engines.ENGINES["vllm"].start`` / ``.judge_args``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.config import HybridflowConfig


def start_replica(cfg: HybridflowConfig, model_dir: Path, *, device: str, node_rank: int, dist_init_addr: str | None):
    """vLLM's engine: a server process under vLLM's own interpreter, its KV cache sized as the plan
    counts it (``memory.kv_bytes_per_token``), its log in the run's ``logs/``, its ``rollout.tp``
    workers on the GPUs from ``device`` on. A replica on one node (the config refuses more), so
    ``node_rank`` is 0."""
    from hybridflow.memory import kv_bytes_per_token
    from hybridflow.rollout import make_engine

    return make_engine(
        "vllm",
        model_path=str(model_dir),
        dtype=cfg.rollout.dtype,
        seed=cfg.run.seed,
        tp=cfg.rollout.tp,
        # a trajectory's whole context (multi-turn ones too), within what the KV cache holds
        max_context=min(cfg.model.max_position_embeddings, cfg.rollout.max_total_tokens),
        kv_cache_bytes=cfg.rollout.max_total_tokens * kv_bytes_per_token(cfg),
        log_dir=str(Path(cfg.run.output_dir) / "logs"),
        generate_timeout_s=cfg.rollout.generate_timeout_s,
        bucket_bytes=cfg.rollout.push_bucket_mb << 20,
        device=device,
    )


def judge_args(cfg: HybridflowConfig, *, device: str) -> dict[str, Any]:
    """The judge section as vLLM's factory arguments; its KV cache is vLLM's engine default
    (1 GiB): ``judge.max_total_tokens`` sizes SGLang's alone."""
    return dict(
        dtype=cfg.judge.dtype,
        seed=cfg.run.seed,
        tp=cfg.judge.tp,
        log_dir=str(Path(cfg.run.output_dir) / "logs"),
        generate_timeout_s=cfg.rollout.generate_timeout_s,
        device=device,
    )
