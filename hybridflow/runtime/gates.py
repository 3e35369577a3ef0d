"""Correctness gates: checks every RL step makes on its own metrics (``checks`` in the config).

    step metrics ──► failures(cfg.checks, metrics, step) ──► [] : nothing to say
                                                         └─► ["...", ...] ──► warn: logged, checks/failed
                                                                          └─► stop: GateFailed (no checkpoint)

    first step   |actor/ppo_kl_first_mini| < first_step_ppo_kl, actor/clipfrac_first_mini == 0:
                 before its first update the trainer must reproduce its own old log-probs
    every step   rollout/token_mult_prob_error < token_mult_prob_error: the engine samples from
                 the trainer's distribution (a stale or broken weight sync does not)
    refit pushes checks/refit_max_rel_diff < refit_tolerance: the engine's weights, read back,
                 are what the trainer pushed (runtime/sync.py, every checks.refit_every pushes)

The metrics are global (reduced over the data-parallel ranks), so every rank decides alike.
"""

from __future__ import annotations

import logging

from hybridflow.config import ChecksConfig

__all__ = ["GateFailed", "apply", "failures"]

logger = logging.getLogger(__name__)


class GateFailed(RuntimeError):
    """A correctness gate failed under ``checks.on_fail=stop``."""


def failures(checks: ChecksConfig, metrics: dict[str, float], step: int) -> list[str]:
    """One line per failed gate of RL step ``step`` (0-based), naming the metric and the key."""
    out = []
    if step == 0:
        kl = metrics.get("actor/ppo_kl_first_mini")
        if kl is not None and abs(kl) >= checks.first_step_ppo_kl:
            out.append(
                f"first step: actor/ppo_kl_first_mini={kl:.3g}, not below checks.first_step_ppo_kl="
                f"{checks.first_step_ppo_kl:g}: the trainer does not reproduce its own old log-probs "
                f"(nondeterministic forward, or training-time dropout)"
            )
        clip = metrics.get("actor/clipfrac_first_mini")
        if clip:
            out.append(
                f"first step: actor/clipfrac_first_mini={clip:.3g}, not 0: the first update clipped "
                f"tokens before any update moved the policy"
            )
    refit = metrics.get("checks/refit_max_rel_diff")
    if refit is not None and refit >= checks.refit_tolerance:
        out.append(
            f"step {step + 1}: checks/refit_max_rel_diff={refit:.3g}, not below checks.refit_tolerance="
            f"{checks.refit_tolerance:g}: the engine's weights read back differ from what the trainer "
            f"pushed"
        )
    error = metrics.get("rollout/token_mult_prob_error")
    if error is not None and error >= checks.token_mult_prob_error:
        out.append(
            f"step {step + 1}: rollout/token_mult_prob_error={error:.4g}, not below "
            f"checks.token_mult_prob_error={checks.token_mult_prob_error:g}: the engine's log-probs "
            f"differ from the trainer's (is the weight sync complete?)"
        )
    return out


def apply(checks: ChecksConfig, metrics: dict[str, float], step: int) -> dict[str, float]:
    """Evaluate the gates; warn or raise ``GateFailed`` as configured. Returns ``checks/failed``."""
    failed = failures(checks, metrics, step)
    if failed and checks.on_fail == "stop":
        raise GateFailed("; ".join(failed) + " (checks.on_fail=stop)")
    for line in failed:
        logger.warning("%s", line)
    return {"checks/failed": float(len(failed))}
