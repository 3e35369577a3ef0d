"""Where each rank of both sides runs: its node and its device.

Two ranks on the same ``Device`` (same node, same GPU index) are colocated: a box moves between
them by a local copy. Ranks on one node reach each other over the intra-node fabric (NVLink),
the rest over the network.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "Topology"]


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class Device:
    """One accelerator: the node it is in and its index there."""

    node: int
    """Node (host) index."""
    gpu: int
    """Device index on the node."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The device of every source (Megatron) and destination (SGLang) rank."""

    source: tuple[Device, ...]
    """Device of source rank i at index i."""
    destination: tuple[Device, ...]
    """Device of destination rank i at index i."""

    @classmethod
    def colocated(cls, num_ranks: int, *, gpus_per_node: int = 8, num_destination: int | None = None) -> Topology:
        """Source rank i and destination rank i share device i (node i // gpus_per_node)."""
        dst = num_ranks if num_destination is None else num_destination
        return cls(source=_devices(0, num_ranks, gpus_per_node), destination=_devices(0, dst, gpus_per_node))

    @classmethod
    def separate(cls, num_source: int, num_destination: int, *, gpus_per_node: int = 8) -> Topology:
        """Destination ranks on their own devices, on the nodes after the sources' nodes."""
        first = -(-num_source // gpus_per_node) * gpus_per_node
        return cls(
            source=_devices(0, num_source, gpus_per_node), destination=_devices(first, num_destination, gpus_per_node)
        )

    @property
    def num_devices(self) -> int:
        """Distinct devices used by either side."""
        return len(set(self.source) | set(self.destination))

    def check(self, num_source: int, num_destination: int) -> None:
        """Raise ValueError unless every rank of each side has exactly one device of its own."""
        for side, have, need in (
            ("source", len(self.source), num_source),
            ("destination", len(self.destination), num_destination),
        ):
            if have < need:
                raise ValueError(
                    f"{side} rank {have} has no place in the topology: topology.{side} lists "
                    f"{have} devices but the {side} layout has {need} ranks; give one Device "
                    f"per rank"
                )
            if have > need:
                raise ValueError(
                    f"topology.{side} lists {have} devices but the {side} layout has only "
                    f"{need} ranks; give exactly one Device per rank"
                )
            _check_distinct(side, getattr(self, side))


def _check_distinct(side: str, devices: tuple[Device, ...]) -> None:
    """Two ranks of one side on one device would share its links and memory: the planner's
    link loads and the executor's one-rank-per-process rule both assume they do not."""
    seen: dict[Device, int] = {}
    for rank, dev in enumerate(devices):
        if dev in seen:
            raise ValueError(
                f"{side} ranks {seen[dev]} and {rank} are both on node {dev.node} gpu {dev.gpu}: "
                f"topology.{side} lists that device twice; give each {side} rank its own device"
            )
        seen[dev] = rank


def _devices(first: int, count: int, gpus_per_node: int) -> tuple[Device, ...]:
    return tuple(Device(node=(first + i) // gpus_per_node, gpu=(first + i) % gpus_per_node) for i in range(count))
