"""Point-to-point links the reshard executor (and the runtime's sample exchange) send over.

```
GroupLink(group)        a torch.distributed group (None: the default group): P2POps, batched
ProcessGroupLink(pg)    a process group object that torch.distributed does not know, e.g. one
                        joining two worlds (the actor's and the engines' default groups) for the
                        weight sync of separate placement: its own send / recv
```

``start`` posts every send and receive of a round at once and returns the works to wait on (the
executor packs the next round meanwhile); ``exchange`` is start-and-wait. A round never
deadlocks on the order in which two processes post.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["GroupLink", "Link", "ProcessGroupLink"]

Op = tuple[torch.Tensor, int, int]
"""(tensor, peer rank in the link, tag)."""


class Link(Protocol):
    def rank(self) -> int: ...

    def size(self) -> int: ...

    def start(self, sends: Sequence[Op], receives: Sequence[Op]) -> list: ...

    def exchange(self, sends: Sequence[Op], receives: Sequence[Op]) -> None: ...


class GroupLink:
    """A torch.distributed process group (None: the default group)."""

    def __init__(self, group=None) -> None:
        self.group = group

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start(self, sends: Sequence[Op], receives: Sequence[Op]) -> list:
        ops = [dist.P2POp(dist.isend, t, self._peer(p), group=self.group, tag=tag) for t, p, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peer(p), group=self.group, tag=tag) for t, p, tag in receives]
        return dist.batch_isend_irecv(ops) if ops else []

    def exchange(self, sends: Sequence[Op], receives: Sequence[Op]) -> None:
        _wait(self.start(sends, receives))


class ProcessGroupLink:
    """A ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object built over a store directly."""

    def __init__(self, pg) -> None:
        self.pg = pg

    def rank(self) -> int:
        return self.pg.rank()

    def size(self) -> int:
        return self.pg.size()

    def start(self, sends: Sequence[Op], receives: Sequence[Op]) -> list:
        works = [self.pg.send([t], p, tag) for t, p, tag in sends]
        return works + [self.pg.recv([t], p, tag) for t, p, tag in receives]

    def exchange(self, sends: Sequence[Op], receives: Sequence[Op]) -> None:
        _wait(self.start(sends, receives))


def _wait(works: list) -> None:
    for work in works:
        work.wait()
