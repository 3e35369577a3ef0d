"""This process's handle on the rollout engines, the one place it keeps them.

An actor rank holds one (``Session.engines``); so does an engine rank in separate placement
(``engine_ranks.serve``). The weight push (``sync.EngineSync``) and the restarts
(``recovery.EngineRestarts``) read the engine from here, so a restarted engine replaces it for
all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.config import HybridflowConfig
    from hybridflow.rollout.base import RolloutEngine
    from hybridflow.runtime.recovery import EngineRestarts
    from hybridflow.runtime.sync import EngineSync

__all__ = ["EngineClient"]


@dataclass
class EngineClient:
    """The engines as one process sees them."""

    cfg: HybridflowConfig
    model_dir: Path
    """The directory every engine starts from (config and tokenizer; the pushes fill the weights)."""
    replica: int | None = None
    """The rollout replica this process drives, or None."""
    engine: RolloutEngine | None = None
    """That replica's engine (on its driver), or None."""
    node_part: Any = None
    """This node's part of a multi-node engine that another rank drives (``SGLangNode``), or None."""
    sync: EngineSync | None = None
    """The weight push every process of the channel takes part in."""
    restarts: EngineRestarts | None = None
    """Replaces lost engines; None before the rollout started."""
    calls: int = 0
    """Generate calls so far, counted alike on every rank (names each call's shared chunk counter)."""
