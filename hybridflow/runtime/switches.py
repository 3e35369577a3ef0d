"""Colocation switches on this rank, executed as the ExecutionPlan lists them.

```
plan.stages[i].switch  (hybridflow.lowering.Switch: a value, the same one `hybridflow plan` prints)
    offload:        actor / critic  offload_training_state()        grads freed, optimizer -> host
    engine_release: driver          engine.release_memory(tags)     (no-op on a CPU)
    engine_resume:  driver          engine.resume_memory(tags)
    restore:        actor / critic  restore_training_state()
```

``enter(s, mode)`` brings the GPUs from the session's current mode to ``mode`` outside the
graph (held-out scoring, checkpoints) by the same rule the lowering uses. Only colocated runs
switch; with separate placement nothing moves.
"""

from __future__ import annotations

from hybridflow.lowering import Switch, satisfies, switch
from hybridflow.runtime.session import Session

__all__ = ["apply", "enter"]


def _trained(s: Session, role: str):
    policy = {"actor": s.models.actor, "critic": s.models.critic}[role]
    if policy is None:
        raise AssertionError(f"the plan switches {role}'s training state, but this run built no {role}")
    return policy


def apply(s: Session, change: Switch) -> None:
    """Execute ``change`` on this rank (every rank calls it; the driver moves the engine)."""
    for role in change.offload:
        _trained(s, role).offload_training_state()
    engine = s.engines.engine
    if engine is not None:
        if change.engine_release:
            engine.release_memory(change.engine_release)
        if change.engine_resume:
            engine.resume_memory(change.engine_resume)
    for role in change.restore:
        _trained(s, role).restore_training_state()
    s.mode = change.target


def enter(s: Session, mode: str) -> None:
    """Switch to ``mode`` unless the current one serves (colocated runs only)."""
    if s.cfg.rollout.placement != "colocated" or satisfies(s.mode, mode):
        return
    apply(s, switch(s.cfg, s.mode, mode))
