"""How a rank stops: on a signal at once (after the checkpoint it is writing), or on a
"checkpoint now" request at the next step boundary.

    SIGINT / SIGTERM / SIGHUP  (from torchrun, which the launcher told; or Slurm, to every process)
      ├─ writing a checkpoint (``deferred()``): noted; raised as Stopped once the checkpoint is out
      │  (or cut short: its ``.partial`` directory is never read, see ``runtime.state``)
      └─ otherwise: Stopped raised where the rank is; the job's clean-up runs (engines shut down,
         the MLflow run marked KILLED) and the rank exits with 128 + signal
    <run dir>/checkpoint.request  (``request_checkpoint``; the Slurm script writes it before the time limit)
      └─ seen by rank 0 at an RL, SFT or reward-model step boundary; every rank agrees (one
         all-reduce per step, ``checkpoint_due``), saves the step (SFT: ``checkpoints/sft_<step>``,
         reward model: ``checkpoints/rm_<step>``) and leaves the loop; the file
         is removed once the checkpoint is complete

Stopped derives from BaseException, as KeyboardInterrupt does, so that no ``except Exception``
on the way swallows it. A rank blocked inside a collective only sees the signal when the call
returns; torchrun's shutdown timeout and the launcher's grace (``launch.reaper``) bound that.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from hfschema.files import write_atomic
from launch.reaper import REQUEST_FILE

__all__ = [
    "REQUEST_FILE",
    "Stopped",
    "checkpoint_due",
    "checkpoint_requested",
    "deferred",
    "done_request",
    "install",
    "request_checkpoint",
]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal reached this rank."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _State:
    deferring = 0
    """Nesting depth of ``deferred()``: a checkpoint is being written."""
    pending: int | None = None
    """A signal that arrived while deferring."""


def _on_signal(signum: int, _frame) -> None:
    if _State.deferring:
        if _State.pending is None:
            logger.warning("%s: stopping once the checkpoint being written is complete", signal.Signals(signum).name)
        _State.pending = signum
        return
    raise Stopped(signum)


def install() -> None:
    """Turn the stop signals into ``Stopped`` in this (main) thread."""
    for sig in _SIGNALS:
        signal.signal(sig, _on_signal)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a stop signal back until the block (a checkpoint save) is done, then raise it.

    An error the block raises once a signal is pending is taken for a consequence of the stop
    (torchrun signals the rank's whole process group, so a save's helper processes die under
    it): Stopped is raised instead, and the checkpoint stays an unread ``.partial``."""
    _State.deferring += 1
    try:
        yield
    except Exception:
        if _State.pending is None:
            raise
        logger.warning("the checkpoint being written was cut short by the stop; resume will not read it")
        raise Stopped(_take_pending()) from None
    finally:
        _State.deferring -= 1
    if not _State.deferring and _State.pending is not None:
        raise Stopped(_take_pending())


def _take_pending() -> int:
    signum, _State.pending = _State.pending, None
    return signum


def request_checkpoint(output_dir: str | Path) -> Path:
    """Ask the running job in ``output_dir`` to checkpoint at its next step and stop."""
    path = Path(output_dir) / REQUEST_FILE
    write_atomic(path, "checkpoint at the next step boundary and stop\n")
    return path


def checkpoint_requested(output_dir: Path, *, is_driver: bool, group) -> bool:
    """Whether the run was asked to checkpoint now; the same answer on every rank of ``group``
    (a gloo group of every rank, None alone: one small all-reduce)."""
    flag = torch.tensor([float(is_driver and (output_dir / REQUEST_FILE).exists())])
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def checkpoint_due(output_dir: Path, *, done: int, total: int, every: int, is_driver: bool, group) -> tuple[bool, bool]:
    """At the end of step ``done`` of a phase of ``total`` steps (RL, SFT, reward-model training):
    (whether its schedule saves now: every ``every`` steps, 0 = none, and at the last step;
    whether a checkpoint was requested, after which the phase saves and stops). Collective over
    ``group`` like ``checkpoint_requested``."""
    requested = done < total and checkpoint_requested(output_dir, is_driver=is_driver, group=group)
    return bool(every and done % every == 0) or done == total, requested


def done_request(output_dir: Path) -> None:
    """The requested checkpoint is complete (rank 0)."""
    (output_dir / REQUEST_FILE).unlink(missing_ok=True)
