"""Runs inside each SGLang scheduler process: reseed the rank's torch generator.

Without deterministic inference (GPU only), SGLang's sampler draws from torch's global generator
(``torch.multinomial``), seeded once at engine start. A run resumed from a checkpoint starts a new
engine, so its generator would not be where the uninterrupted run's was. Reseeding every rank
with the same per-step seed before each generate call makes a step's samples a function of
(weights, prompts, seed) only, which is what lets a resumed CPU run reproduce the original.

Called like ``param_report``: ``update_weights_from_tensor(load_format=LOADER)`` with one dummy
tensor whose *name* is the seed. The model's weights are not touched; it never raises (an
exception in a custom loader kills the scheduler).
"""

from __future__ import annotations

import logging

__all__ = ["LOADER", "reseed"]

LOADER = f"{__name__}.reseed"
"""The ``load_format`` / ``custom_weight_loader`` path of ``reseed``."""

logger = logging.getLogger(__name__)


def reseed(model, named_tensors) -> None:
    """``torch.manual_seed(int(name))`` on this rank (and CUDA's generators when present)."""
    try:
        import torch

        seed = int(named_tensors[0][0])
        torch.manual_seed(seed)  # seeds CUDA's generators too when CUDA is initialised
    except Exception:  # never kill the scheduler; the caller's reproducibility check will notice
        logger.exception("reseed failed")
