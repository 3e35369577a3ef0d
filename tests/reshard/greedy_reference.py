"""The planner's routing rule written as plainly as it reads, every choice a scan over every
candidate: the reference the planner's heaps must equal route for route (tests/reshard/
test_planner.py). Slow on purpose (it was the planner: 96 CPU s for the 1,024-GPU DeepSeek-V3 plan)."""

from __future__ import annotations

import numpy as np

from reshard.planner import PART_BYTES, _bundles
from reshard.topology import Topology

LOCAL, INTRA, INTER = range(3)


def reference_routes(source, destination, topology: Topology, *, max_relays: int = 8, part_bytes: int = PART_BYTES):
    """(src, relay, dst, kind, hop, bundle) columns of every route, in the planner's order."""
    bundles = _bundles(source, destination, part_bytes)
    order = sorted(range(len(bundles)), key=lambda i: (-bundles[i].nbytes, i))
    bundles = [bundles[i] for i in order]
    rough = _Greedy(topology, max_relays, ahead=None)
    first = [rough.route(b) for b in bundles]
    greedy = _Greedy(topology, max_relays, ahead=list(rough.nic_out))
    rows = []
    for index, b in enumerate(bundles):
        for sender, relay, _, kind, _ in first[index]:  # this bundle's sends are no longer ahead
            if kind == INTER:
                greedy.ahead[greedy.device(sender, relay)] -= b.nbytes
        rows += [(*route, index) for route in greedy.route(b)]
    return [np.array(column) for column in zip(*rows)]


class _Greedy:
    def __init__(self, topology: Topology, max_relays: int, ahead) -> None:
        devices = sorted(set(topology.source) | set(topology.destination))
        self.src = [devices.index(d) for d in topology.source]
        self.dst = [devices.index(d) for d in topology.destination]
        self.node = {i: d.node for i, d in enumerate(devices)}
        self.nic_out, self.nic_in, self.nv_out = ([0] * len(devices) for _ in range(3))
        self.ahead = ahead if ahead is not None else [0] * len(devices)
        self.max_relays = max_relays

    def device(self, rank: int, relay: bool) -> int:
        return self.dst[rank] if relay else self.src[rank]

    def route(self, b) -> list[tuple]:
        routes, entries = [], []  # entries: (rank, hop, nodes passed) of earlier nodes' receivers
        for node in sorted({self.node[self.dst[d]] for d in b.needers}):
            have = [(r, False, 0) for r in b.holders if self.node[self.src[r]] == node]
            todo = []
            for d in (d for d in b.needers if self.node[self.dst[d]] == node):
                local = [r for r in b.holders if self.src[r] == self.dst[d]]
                if local:
                    routes.append((local[0], False, d, LOCAL, 0))
                else:
                    todo.append(d)
            relays = not have
            if not have and todo:
                entry = min(todo, key=lambda d: self.nic_in[self.dst[d]])
                todo.remove(entry)
                candidates = [(self._load(r, False), 0, False, r, 0) for r in b.holders]
                candidates += [(self._load(r, True), h, True, r, p) for r, h, p in entries if p <= self.max_relays]
                _, hop, relay, sender, passed = min(candidates)
                self.nic_out[self.device(sender, relay)] += b.nbytes
                self.nic_in[self.dst[entry]] += b.nbytes
                routes.append((sender, relay, entry, INTER, hop))
                have.append((entry, True, hop + 1))
                entries.append((entry, hop + 1, passed + 1))
            for d in todo:
                sender, relay, hop = min(have, key=lambda c: (self.nv_out[self.device(c[0], c[1])], c[2], c[1], c[0]))
                self.nv_out[self.device(sender, relay)] += b.nbytes
                routes.append((sender, relay, d, INTRA, hop))
                if relays:
                    have.append((d, True, hop + 1))
        return routes

    def _load(self, rank: int, relay: bool) -> int:
        device = self.device(rank, relay)
        return self.nic_out[device] + self.ahead[device]
