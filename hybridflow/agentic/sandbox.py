"""Running untrusted code (a policy's tool call) outside the trainer, with limits.

```
BubblewrapSandbox.run(code)
   scratch folder (fresh, empty, removed after)            ── the only writable place: /work
   Popen as an unprivileged uid (root: a fresh one per run; else the caller's own)
     rlimits: CPU seconds, address space, processes, file size, no core files
     bwrap: new user / pid / net / ipc / uts / cgroup namespaces (no network at all),
            / is empty but for /usr read-only, /proc, /dev, a private /tmp, /work;
            no environment but PATH and HOME; dies with its parent
       python3 /work/main.py
   stdout + stderr read up to output_bytes; past wall_seconds the process group is killed
   ──► SandboxResult(stdout, stderr, exit_code, error)
```

Why bubblewrap: it is what Flatpak isolates applications with, a Debian package
(``apt-get install bubblewrap``), needs no daemon, and builds the namespaces unprivileged; the
rlimits bound what namespaces do not (CPU, memory, a fork bomb). cgroups would bound memory more
exactly but need a writable cgroup tree, which containers often lack. A cluster without
bubblewrap on its nodes points ``RemoteSandbox`` at a sandbox service instead: both implement
``Sandbox``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "BubblewrapSandbox",
    "RemoteSandbox",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "check_bubblewrap",
]

RUN_UIDS = range(1_500_000_000, 1_600_000_000)
"""Uids a root trainer runs programs as, one drawn per run (no passwd entry needed).
RLIMIT_NPROC counts a uid's processes machine-wide: programs sharing one uid (nobody) would share
one process budget, and a fork bomb, or just many tool calls at once, would refuse the others'
processes."""


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs is missing on this machine; the message says how to get it."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run of untrusted code may use."""

    wall_seconds: float = 10.0
    """Killed after this long, sleeping or not."""
    cpu_seconds: int = 5
    memory_mb: int = 512
    """Address space of each process."""
    processes: int = 32
    """Processes and threads of the sandbox's uid at once (a fork bomb stops here)."""
    output_bytes: int = 16_384
    """stdout and stderr together; past it the run is stopped."""
    file_mb: int = 16
    """The largest file it may write."""


@dataclass(frozen=True)
class SandboxResult:
    """What a run printed and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The process's exit status (negative: killed by that signal); None: it did not end itself."""
    error: str | None = None
    """Why the sandbox stopped it (wall time, output size), or None."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    def describe(self) -> str:
        """One line for a tool's observation when the run failed."""
        if self.error is not None:
            return self.error
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by {signal.Signals(-self.exit_code).name} (a CPU, memory or file limit)"
        last = self.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"exited with status {self.exit_code}: {last[0]}"


class Sandbox(Protocol):
    """Runs a Python program in isolation; never raises for what the program does."""

    def run(self, code: str) -> SandboxResult: ...


def check_bubblewrap() -> str:
    """The path of ``bwrap``; SandboxUnavailable (one line: how to install it) when missing."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "the code sandbox needs bubblewrap (bwrap), which is not installed: run "
            "'apt-get install bubblewrap' (scripts/install.sh does it as root), or set "
            "agentic.sandbox=remote with agentic.sandbox_url pointing at a sandbox service"
        )
    return path


class BubblewrapSandbox:
    """``Sandbox`` on this machine: bubblewrap's namespaces and rlimits (see the module doc)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, python: str = "/usr/bin/python3") -> None:
        self.limits, self.python = limits, python
        self.bwrap = check_bubblewrap()
        if not Path(python).is_file():
            raise SandboxUnavailable(f"the sandbox's interpreter {python} does not exist: install python3 there")
        self._draw = random.SystemRandom()

    def run(self, code: str) -> SandboxResult:
        uid = self._draw.choice(RUN_UIDS) if os.geteuid() == 0 else os.geteuid()
        scratch = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
        try:
            (scratch / "main.py").write_text(code)
            if uid != os.geteuid():
                os.chown(scratch, uid, uid)
            return self._run(scratch, uid)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _command(self, scratch: Path) -> list[str]:
        mounts = ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for link in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
            if Path("/", link).is_symlink():
                mounts += ["--symlink", os.readlink(Path("/", link)), f"/{link}"]
        return [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            *mounts,
            "--bind",
            str(scratch),
            "/work",
            "--chdir",
            "/work",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            self.python,
            "-I",  # isolated: no user site, no PYTHON* variables
            "main.py",
        ]

    def _limit(self, uid: int) -> None:
        """In the child before exec (still the trainer's uid): the rlimits every process under
        it inherits."""
        lim = self.limits
        own = 0 if uid in RUN_UIDS else _processes_of(uid)  # the caller's other processes count too
        for kind, value in (
            (resource.RLIMIT_CPU, lim.cpu_seconds),
            (resource.RLIMIT_AS, lim.memory_mb << 20),
            (resource.RLIMIT_NPROC, own + lim.processes),
            (resource.RLIMIT_FSIZE, lim.file_mb << 20),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(kind, (value, value))

    def _run(self, scratch: Path, uid: int) -> SandboxResult:
        as_other = uid != os.geteuid()
        process = subprocess.Popen(
            self._command(scratch),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=functools.partial(self._limit, uid),
            start_new_session=True,
            user=uid if as_other else None,
            group=uid if as_other else None,
            extra_groups=[] if as_other else None,
        )
        reader = _CappedReader(process, self.limits.output_bytes)
        error = None
        try:
            process.wait(timeout=self.limits.wall_seconds)
        except subprocess.TimeoutExpired:
            error = f"stopped after the sandbox's wall-time limit of {self.limits.wall_seconds:g} s"
        if reader.overflowed.is_set() and error is None:
            error = f"stopped: printed more than the sandbox's {self.limits.output_bytes} output bytes"
        _kill_group(process)
        out, err = reader.join()
        code = None if error is not None else process.returncode
        if code is not None and code > 128:  # bwrap exits 128 + N for a program killed by signal N
            code = 128 - code
        return SandboxResult(out, err, code, error)


def _processes_of(uid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                count += 1
        except OSError:  # gone meanwhile
            continue
    return count


def _kill_group(process: subprocess.Popen) -> None:
    """Kill whatever is left of the run (bwrap's namespace goes with its first process)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


class _CappedReader:
    """Reads a process's stdout and stderr in threads, keeping at most ``cap`` bytes in all; sets
    ``overflowed`` (and the caller stops the process) when there is more."""

    def __init__(self, process: subprocess.Popen, cap: int) -> None:
        self.cap, self.overflowed = cap, threading.Event()
        self._kept = {"out": bytearray(), "err": bytearray()}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._read, args=(process, stream, name), daemon=True)
            for stream, name in ((process.stdout, "out"), (process.stderr, "err"))
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, process: subprocess.Popen, stream, name: str) -> None:
        while chunk := stream.read1(4096):
            with self._lock:
                room = self.cap - sum(len(k) for k in self._kept.values())
                self._kept[name] += chunk[: max(room, 0)]
            if len(chunk) > room:
                self.overflowed.set()
                _signal_group(process)
                return

    def join(self) -> tuple[str, str]:
        for thread in self._threads:
            thread.join(timeout=5)
        return tuple(bytes(self._kept[k]).decode("utf-8", "replace") for k in ("out", "err"))


def _signal_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class RemoteSandbox:
    """``Sandbox`` as a service: POSTs ``{"code", "limits"}`` as JSON to ``url`` and reads a
    ``SandboxResult``'s fields back (``hybridflow.agentic.sandbox_server`` serves one)."""

    def __init__(self, url: str, limits: SandboxLimits = SandboxLimits()) -> None:
        self.url, self.limits = url, limits

    def run(self, code: str) -> SandboxResult:
        body = json.dumps({"code": code, "limits": asdict(self.limits)}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.limits.wall_seconds + 30) as reply:
                return SandboxResult(**json.loads(reply.read()))
        except (OSError, ValueError, TypeError) as error:
            return SandboxResult("", "", None, f"the sandbox service at {self.url} failed: {error}")
