"""Plan statistics: bytes moved, the lower bound, the gather-and-broadcast baseline, and time.

    Plan --> per-route bytes (bundle sizes) --> local / intra / inter totals,
                                                bytes sent and received per rank,
                                                simulated seconds (model below)
    source, destination, topology --> lower bound  (computed from the layouts, not the plan)
    destination --------------------> baseline     (computed from the layouts, not the plan)

Definitions:

- ``bytes``: bytes crossing from one device to another (intra + inter node); local copies
  (source and destination rank on the same device) are counted apart in ``local_bytes``.
- ``lower_bound_bytes``: for every destination rank, the bytes of everything it needs, minus
  what a source rank on its own device already holds; summed over destination ranks. No plan
  that delivers every needed element can move fewer bytes between devices.
- ``baseline_bytes``: the gather-and-broadcast scheme of verl / slime / OpenRLHF
  (``update_weights_from_tensor`` with full HF tensors): every destination rank receives every
  canonical tensor of the model whole, and its loader keeps only its part. Baseline = number of
  destination ranks x bytes of the whole (unpadded) model. It ignores the trainer-side gather.
- ``simulated_seconds``: every rank sends its intra-node bytes at ``intra_node_gbps`` and its
  inter-node bytes at ``inter_node_gbps`` (GB/s = 1e9 bytes/s), one after the other; sending
  and receiving overlap fully (full duplex); the network core never congests; latency and
  local copies are free. Time = the slowest rank's max(send time, receive time).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from reshard.families import DTYPE_BYTES
from reshard.layouts import TensorLayout
from reshard.planner import INTER, INTRA, LOCAL, Plan
from reshard.regions import intersect, num_elements
from reshard.topology import Device, Topology

__all__ = ["Bandwidth", "PlanStats", "baseline_bytes", "lower_bound_bytes", "plan_stats"]


@dataclass(frozen=True, kw_only=True)
class Bandwidth:
    """Per-rank link speeds of the time model, in GB/s (1e9 bytes per second)."""

    intra_node_gbps: float
    """One rank's intra-node (NVLink) bandwidth per direction (a run's: ``rollout.intra_node_gbps``)."""
    inter_node_gbps: float
    """One rank's network (NIC) bandwidth per direction (a run's: ``rollout.inter_node_gbps``)."""


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """What a plan moves, against the lower bound and the gather baseline."""

    bytes: int
    """Bytes moved between devices (intra + inter node)."""
    local_bytes: int
    """Bytes copied on the same device."""
    intra_node_bytes: int
    """Bytes moved between devices of one node."""
    inter_node_bytes: int
    """Bytes moved between nodes."""
    max_sent_bytes: int
    """Most bytes one source rank sends to other devices."""
    max_received_bytes: int
    """Most bytes one destination rank receives from other devices."""
    lower_bound_bytes: int
    """Bytes destinations need that are not on their own device (see module docstring)."""
    baseline_bytes: int
    """Bytes the gather-and-broadcast scheme moves (see module docstring)."""
    simulated_seconds: float
    """Time under the bandwidth model (see module docstring)."""
    num_routes: int
    """(source rank, destination rank, bundle) routes."""
    num_transfers: int
    """Transfers (single boxes) the routes expand to."""

    @property
    def ratio_to_lower_bound(self) -> float:
        """bytes / lower bound (1.0 is optimal); 1.0 when both are 0."""
        return self.bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    @property
    def baseline_ratio(self) -> float:
        """baseline / bytes: how many times more the gather scheme moves."""
        return self.baseline_bytes / self.bytes if self.bytes else float("inf")

    def as_dict(self) -> dict:
        """All fields plus the two ratios (JSON-ready)."""
        return {**asdict(self), "ratio_to_lower_bound": self.ratio_to_lower_bound,
                "baseline_ratio": self.baseline_ratio}

    def describe(self) -> str:
        """A few lines for a terminal (``hybridflow plan``)."""
        b = format_bytes
        return "\n".join([
            f"reshard: {b(self.bytes)} across devices ({b(self.intra_node_bytes)} intra-node, "
            f"{b(self.inter_node_bytes)} inter-node), {b(self.local_bytes)} local copies",
            f"  lower bound {b(self.lower_bound_bytes)} (ratio {self.ratio_to_lower_bound:.3f}); "
            f"gather-and-broadcast baseline {b(self.baseline_bytes)} "
            f"({self.baseline_ratio:.2f}x the plan)",
            f"  max per rank: sent {b(self.max_sent_bytes)}, received "
            f"{b(self.max_received_bytes)}; simulated {self.simulated_seconds:.3g} s; "
            f"{self.num_routes} routes, {self.num_transfers} transfers",
        ])


def format_bytes(n: float) -> str:
    """Bytes in decimal units with three significant digits (``1.94 TB``, ``98.3 kB``)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def _per_rank(ranks: np.ndarray, nbytes: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, np.int64)
    np.add.at(out, ranks[mask], nbytes[mask])
    return out


def _simulated_seconds(plan: Plan, nbytes: np.ndarray, bw: Bandwidth) -> float:
    intra, inter = plan.route_kind == INTRA, plan.route_kind == INTER
    times = []
    for ranks, n in ((plan.route_src, plan.source.num_ranks),
                     (plan.route_dst, plan.destination.num_ranks)):
        seconds = (_per_rank(ranks, nbytes, intra, n) / (bw.intra_node_gbps * 1e9)
                   + _per_rank(ranks, nbytes, inter, n) / (bw.inter_node_gbps * 1e9))
        times.append(float(seconds.max(initial=0.0)))
    return max(times)


def plan_stats(plan: Plan, *, bandwidth: Bandwidth) -> PlanStats:
    """Exact statistics of ``plan`` (bounds computed from its layouts, independently)."""
    nbytes = plan.route_nbytes()
    kind = plan.route_kind
    moved = kind != LOCAL
    return PlanStats(
        bytes=int(nbytes[moved].sum()),
        local_bytes=int(nbytes[kind == LOCAL].sum()),
        intra_node_bytes=int(nbytes[kind == INTRA].sum()),
        inter_node_bytes=int(nbytes[kind == INTER].sum()),
        max_sent_bytes=int(_per_rank(plan.route_src, nbytes, moved,
                                     plan.source.num_ranks).max(initial=0)),
        max_received_bytes=int(_per_rank(plan.route_dst, nbytes, moved,
                                         plan.destination.num_ranks).max(initial=0)),
        lower_bound_bytes=lower_bound_bytes(plan.source, plan.destination, plan.topology),
        baseline_bytes=baseline_bytes(plan.destination),
        simulated_seconds=_simulated_seconds(plan, nbytes, bandwidth),
        num_routes=plan.num_routes,
        num_transfers=plan.num_transfers(),
    )


def baseline_bytes(destination: TensorLayout) -> int:
    """Every destination rank receives the whole model (see module docstring)."""
    model = sum(num_elements(tuple((0, n) for n in t.shape)) * DTYPE_BYTES[t.dtype]
                for t in destination.tensors.values())
    return destination.num_ranks * model


def _needed_bytes(destination: TensorLayout) -> int:
    return sum(destination.shard_nbytes(s) * len(s.ranks)
               for shards in destination.shards.values() for s in shards)


def _device_holdings(source: TensorLayout, devices: set[Device],
                     topology: Topology) -> dict[Device, dict[str, set]]:
    """Per device that also hosts a destination rank: tensor -> source boxes held there."""
    held: dict[Device, dict[str, set]] = {}
    for name, shards in source.shards.items():
        for s in shards:
            for r in s.ranks:
                dev = topology.source[r]
                if dev in devices:
                    held.setdefault(dev, {}).setdefault(name, set()).add(s.region)
    return held


def lower_bound_bytes(source: TensorLayout, destination: TensorLayout, topology: Topology) -> int:
    """Bytes destination ranks need minus what colocated source ranks already hold.

    Computed from the two layouts and the topology only (not from a plan). Boxes of one source
    tensor are disjoint (copies repeat the same box), so summing overlaps does not double count.
    """
    topology.check(source.num_ranks, destination.num_ranks)
    dst_devices = set(topology.destination)
    held = _device_holdings(source, dst_devices, topology)
    members: dict[int, frozenset] = {}
    local = 0
    for d, dev in enumerate(topology.destination):
        for name, regions in held.get(dev, {}).items():
            itemsize = DTYPE_BYTES[destination.tensors[name].dtype]
            for shard in destination.shards[name]:
                ranks = members.setdefault(id(shard.ranks), frozenset(shard.ranks))
                if d not in ranks:
                    continue
                for region in regions:
                    overlap = intersect(region, shard.region)
                    if overlap is not None:
                        local += num_elements(overlap) * itemsize
    return _needed_bytes(destination) - local
