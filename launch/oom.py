"""Was a rank killed by the kernel's out-of-memory killer? The job's memory cgroup says so.

    launcher, before the job:  snapshot()  ──  the oom_kill count of its memory cgroup (cgroup v2
                                              memory.events, v1 memory.oom_control), and the
                                              machine's (/proc/vmstat) where no cgroup is readable
    the job fails, no rank reported an error (a SIGKILL leaves none):
                               killed_since(snapshot)  ──  a line naming the killer, the memory the
                                                           job peaked at and its limit, what to lower

A rank the OOM killer ends dies by SIGKILL without a word: the job used to end with "no rank
reported an error". Ranks, engines and their children share the launcher's cgroup (Slurm gives
each job one; so does a container), so its counter moves only for this job's processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryCgroup", "OomSnapshot", "killed_since", "snapshot"]

_ROOT = Path("/sys/fs/cgroup")
_GIB = 1 << 30
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True)
class MemoryCgroup:
    """The memory cgroup a process is in, with the files of its version."""

    path: Path
    events: str
    """The file with the ``oom_kill N`` line (v2: memory.events, v1: memory.oom_control)."""
    peak: str
    limit: str

    def read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def oom_kills(self) -> int | None:
        return _field(self.read(self.events), "oom_kill")

    def bytes(self, name: str) -> int | None:
        text = self.read(name)
        if text is None or not text.strip().isdigit():  # v2's "max": no limit
            return None
        value = int(text)
        return None if value >= _UNLIMITED else value


@dataclass(frozen=True)
class OomSnapshot:
    cgroup: MemoryCgroup | None
    cgroup_kills: int | None
    machine_kills: int | None


def _field(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def memory_cgroup(proc_cgroup: str | None = None) -> MemoryCgroup | None:
    """This process's memory cgroup, v2 or v1 (None where neither is readable)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # the v2 (unified) hierarchy
            found = _first(_ROOT, path, "memory.events", "memory.peak", "memory.max")
        elif "memory" in controllers.split(","):
            found = _first(
                _ROOT / "memory", path, "memory.oom_control", "memory.max_usage_in_bytes", "memory.limit_in_bytes"
            )
        else:
            continue
        if found is not None:
            return found
    return None


def _first(mount: Path, path: str, events: str, peak: str, limit: str) -> MemoryCgroup | None:
    """The cgroup's directory: its full path, or the mount itself inside a cgroup namespace
    (a container sees its own cgroup as the root)."""
    for directory in (mount / path.lstrip("/"), mount):
        if (directory / events).exists():
            return MemoryCgroup(directory, events, peak, limit)
    return None


def snapshot(proc_cgroup: str | None = None) -> OomSnapshot:
    """The counters to compare with after the job (``killed_since``)."""
    cgroup = memory_cgroup(proc_cgroup)
    return OomSnapshot(cgroup, cgroup.oom_kills() if cgroup else None, _machine_kills())


def _machine_kills() -> int | None:
    try:
        return _field(Path("/proc/vmstat").read_text(), "oom_kill")
    except OSError:
        return None


def killed_since(before: OomSnapshot) -> str | None:
    """A line saying the out-of-memory killer ended a process of this job since ``before`` (its
    peak and limit, what to lower), or None when the counters did not move."""
    cgroup = before.cgroup
    kills = cgroup.oom_kills() if cgroup else None
    if kills is not None and before.cgroup_kills is not None:
        if kills <= before.cgroup_kills:
            return None
        where = f"the job's memory cgroup ({cgroup.path})"
        peak, limit = cgroup.bytes(cgroup.peak), cgroup.bytes(cgroup.limit)
        held = f"; it peaked at {peak / _GIB:.1f} GiB" if peak else ""
        held += f" of its {limit / _GIB:.1f} GiB limit" if peak and limit else ""
    else:
        machine = _machine_kills()
        if machine is None or before.machine_kills is None or machine <= before.machine_kills:
            return None
        where, held = "the machine", f"; {_available()}"
    return (
        f"a process of the job was killed by the kernel's out-of-memory killer in {where}{held}: lower what the ranks "
        "hold in host memory (rollout.max_total_tokens, train.micro_batch_size, data.max_response_length, "
        "fewer processes per node) or give the job more memory (hybridflow plan estimates it)"
    )


def _available() -> str:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"the machine has {total / _GIB:.1f} GiB"
