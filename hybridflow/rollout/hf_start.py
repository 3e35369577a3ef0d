"""How a run's settings start the transformers engine: a replica's and a judge's
(``hfschema.engines.ENGINES["hf"].start`` / ``.judge_args``). It runs in the driver's process,
on the driver's device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.config import HybridflowConfig


def start_replica(cfg: HybridflowConfig, model_dir: Path, *, device: str, node_rank: int, dist_init_addr: str | None):
    from hybridflow.rollout import make_engine

    return make_engine(
        "hf",
        model_path=str(model_dir),
        dtype=cfg.rollout.dtype,
        seed=cfg.run.seed,
        device=device,
        return_routed_experts=cfg.moe.routing_replay == "r3",
        load_format="dummy",
    )


def judge_args(cfg: HybridflowConfig, *, device: str) -> dict[str, Any]:
    return dict(dtype=cfg.judge.dtype, seed=cfg.run.seed, device=device)
