"""Runs inside each SGLang scheduler process: re-derive what the model builds from its weights.

Some models keep tensors derived from their parameters: DeepSeek-V3's MLA decodes with ``w_kc`` /
``w_vc``, split out of ``kv_b_proj`` by ``post_load_weights``. SGLang re-runs that hook at the end
of a weight-update session only when no tensor was loaded in it, and a ``load_format="direct"``
push counts as a load, so after a sliced push those tensors would still hold the dummy start's
values. The sliced push therefore ends with this loader, called like ``param_report``:
``update_weights_from_tensor(load_format=LOADER)`` with one dummy tensor. Models without the
hook are left alone; it never raises (an exception in a custom loader kills the scheduler), and
logs instead.
"""

from __future__ import annotations

import logging

__all__ = ["LOADER", "rederive"]

LOADER = f"{__name__}.rederive"
"""The ``load_format`` / ``custom_weight_loader`` path of ``rederive``."""

logger = logging.getLogger(__name__)


def rederive(model, named_tensors) -> None:  # noqa: ARG001 (the dummy tensor carries nothing)
    """``model.post_load_weights()`` where the model has one."""
    hook = getattr(model, "post_load_weights", None)
    if hook is None:
        return
    try:
        hook()
    except Exception:  # never kill the scheduler; the engine-vs-trainer log-prob check will show it
        logger.exception("post_load_weights after a direct push failed")
