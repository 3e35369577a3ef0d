"""torchrun as the launchers run it: ``python -m launch.torchrun_entry [torchrun's arguments]``.

torch.distributed.run itself, called without its ``@record`` wrapper, so that its own exits
print one line each instead of a traceback: a stop signal (``SignalException``, the launcher
forwarding SIGINT / SIGTERM / SIGHUP) prints nothing, since the launcher says ``stopped by``;
failed ranks (``ChildFailedError``) print one line per rank with its exit code or signal, and
the launcher then names the first failure with its error (``launch.failures``). torchrun's
"Received N death signal" and "Sending process N closing signal" warnings are dropped too: the
launcher's line says the same.
Everything else, the ranks' own output included, passes through as before.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["TORCHRUN", "main"]

TORCHRUN = "launch.torchrun_entry"
"""This module, as the launchers start it (``python -m TORCHRUN``)."""


def _describe(rank: int, failure) -> str:
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    return f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"


_SAID_BY_US = ("closing signal", "death signal", "failed (exitcode")
"""torch elastic's lines that the launcher says better: a stop it forwarded, and a rank that failed
(``_describe`` names it with its error after the job)."""


def _without_signal_warnings(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(said in message for said in _SAID_BY_US)


def main(argv: list[str] | None = None) -> int:
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_without_signal_warnings)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        for rank, failure in sorted(failed.failures.items()):
            sys.stderr.write(_describe(rank, failure) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
