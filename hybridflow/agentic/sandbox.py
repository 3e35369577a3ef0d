"""Running untrusted code (a policy's tool call) outside the trainer, with limits.

```
BubblewrapSandbox.run(code)
   Popen bwrap with an environment of PATH alone, as an unprivileged uid (root: a fresh one per
   run; else the caller's own); rlimits every process inherits: CPU seconds, address space,
   processes, file size, no core files
     bwrap: new user / pid / net / ipc / uts / cgroup namespaces (no network, no further user
            namespaces); / read-only: /usr read-only, /proc, /dev read-only, and one sized tmpfs
            /work (the program, its files, /tmp) as the only writable place;
            environment PATH, HOME and LANG; dies with its parent; the program is the namespace's pid 1
            (nothing of bwrap's or the trainer's to read there), under a seccomp filter
       python3 -I /work/main.py
   stdout + stderr read to their end; past wall_seconds the namespace is killed
   ──► SandboxResult(stdout, stderr, exit_code, error)
```

Why bubblewrap: it is what Flatpak isolates applications with, a Debian package
(``apt-get install bubblewrap``), needs no daemon, and builds the namespaces unprivileged; the
rlimits bound what namespaces do not (CPU, memory, a fork bomb). The memory budget is sized
mounts and rlimits, not a cgroup: a writable cgroup tree (v1 or v2, delegated or not) is what
containers differ in most, while a tmpfs's size and an address-space limit hold everywhere.
Each process may take ``memory_mb - disk_mb`` of address space and the files of the run
``disk_mb`` in all, so a one-process program stays within ``memory_mb``; one that forks is held
to ``processes`` of those. A cluster without bubblewrap on its nodes points ``RemoteSandbox`` at
a sandbox service instead: both implement ``Sandbox``. docs/agentic.md gives the threat model.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import random
import resource
import shutil
import signal
import subprocess
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

BWRAP_ENVIRONMENT = {"PATH": "/usr/bin:/bin"}
"""All of the trainer's environment bwrap itself sees: what it is started with stays readable
in its processes (``/proc/<pid>/environ``), and a trainer's holds tokens (HF_TOKEN,
WANDB_API_KEY, cloud credentials)."""

DENIED_SYSCALLS = (
    # namespaces (clone's namespace flags are refused below): a nested user namespace is where
    # most unprivileged kernel exploits start
    "unshare",
    "setns",
    # the kernel interfaces with the worst record, none of which a Python program needs
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "bpf",
    "perf_event_open",
    # the keyrings: a process's session keyring is its parent's
    "keyctl",
    "add_key",
    "request_key",
    # other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    # the filesystem tree and the machine
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
)
"""Syscalls the program's seccomp filter refuses (EPERM); everything else a Python program uses
is allowed. ``clone3`` answers ENOSYS instead, so the C library falls back to ``clone``, whose
flags the filter can read (clone3 passes them in memory)."""

CLONE_NAMESPACE_FLAGS = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
"""CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: a clone with any is refused."""


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs is missing on this machine; the message says how to get it."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run of untrusted code may use."""

    wall_seconds: float = 10.0
    """Killed after this long, sleeping or not."""
    cpu_seconds: int = 5
    memory_mb: int = 512
    """The budget of a process together with the files of the run (``disk_mb`` of it): each
    process's address space is ``memory_mb - disk_mb``."""
    disk_mb: int = 64
    """The run's files in all: /work, the program's only writable place, is a tmpfs of this size
    (/tmp is a folder in it)."""
    processes: int = 32
    """Processes and threads of the sandbox's uid at once (a fork bomb stops here)."""
    output_bytes: int = 16_384
    """stdout and stderr together; past it the run is stopped."""
    file_mb: int = 16
    """The largest file it may write."""

    def __post_init__(self) -> None:
        if not 0 < self.disk_mb < self.memory_mb:
            raise ValueError(
                f"the sandbox's disk_mb={self.disk_mb} must be above 0 and below memory_mb={self.memory_mb}"
            )


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
    version = _bwrap_version(path)
    if version < BWRAP_AT_LEAST:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap {'.'.join(map(str, BWRAP_AT_LEAST))} or newer (--size, "
            f"--disable-userns); {path} is {'.'.join(map(str, version))}: install a newer bubblewrap "
            "(Debian 12's is 0.8.0), or set agentic.sandbox=remote"
        )
    return path


BWRAP_AT_LEAST = (0, 8, 0)


@functools.cache
def _bwrap_version(path: str) -> tuple[int, ...]:
    said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.split()
    try:
        return tuple(int(part) for part in said[-1].split("."))
    except (IndexError, ValueError):
        return (0,)  # a build that does not say: treated as too old


@functools.cache
def seccomp_filter() -> bytes:
    """The program's seccomp filter as BPF (libseccomp through pyseccomp builds it for this
    machine's architecture; a foreign one is killed): ``DENIED_SYSCALLS`` and namespace clones
    refused, ``clone3`` unknown, the rest allowed."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as error:  # pyseccomp loads libseccomp.so.2 when imported
        raise SandboxUnavailable(
            f"the code sandbox's syscall filter needs libseccomp and pyseccomp ({error}): run "
            "'apt-get install libseccomp2' and 'pip install pyseccomp' (scripts/install.sh does both)"
        ) from None
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NAMESPACE_FLAGS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    fd = os.memfd_create("seccomp")
    with os.fdopen(fd, "w+b") as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def _memfd(name: str, data: bytes) -> int:
    """An in-memory file holding ``data``, read from its start (bwrap's ``--file`` and
    ``--seccomp`` read such fds: nothing of the run touches the host's disk). Closed on exec
    but in the one child that ``Popen(pass_fds=...)`` hands it to, so concurrent runs' children
    never hold each other's programs."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class BubblewrapSandbox:
    """``Sandbox`` on this machine: bubblewrap's namespaces, a seccomp filter and rlimits (see the
    module doc)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, python: str = "/usr/bin/python3") -> None:
        self.limits, self.python = limits, python
        self.bwrap = check_bubblewrap()
        if not Path(python).is_file():
            raise SandboxUnavailable(f"the sandbox's interpreter {python} does not exist: install python3 there")
        self._filter = seccomp_filter()
        self._draw = random.SystemRandom()

    def run(self, code: str) -> SandboxResult:
        uid = self._draw.choice(RUN_UIDS) if os.geteuid() == 0 else os.geteuid()
        program, rules = _memfd("main.py", code.encode()), _memfd("seccomp", self._filter)
        try:
            return self._run(self._command(program, rules), (program, rules), uid)
        finally:
            os.close(program)
            os.close(rules)

    def _command(self, program: int, rules: int) -> list[str]:
        disk = self.limits.disk_mb << 20
        mounts = ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        for link in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
            if Path("/", link).is_symlink():
                mounts += ["--symlink", os.readlink(Path("/", link)), f"/{link}"]
        mounts += ["--size", str(disk), "--tmpfs", "/work", "--dir", "/work/.tmp", "--symlink", "/work/.tmp", "/tmp"]
        mounts += ["--file", str(program), "/work/main.py", "--remount-ro", "/"]
        return [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            *mounts,
            "--chdir",
            "/work",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "LANG",
            "C.UTF-8",  # UTF-8 text (Python would otherwise set LC_CTYPE itself)
            "--seccomp",
            str(rules),
            self.python,
            "-I",  # isolated: no user site, no PYTHON* variables
            "main.py",
        ]

    def _limit(self, uid: int) -> None:
        """In the child before exec: the rlimits every process under it inherits."""
        lim = self.limits
        own = 0 if uid in RUN_UIDS else _processes_of(uid)  # the caller's other processes count too
        for kind, value in (
            (resource.RLIMIT_CPU, lim.cpu_seconds),
            (resource.RLIMIT_AS, (lim.memory_mb - lim.disk_mb) << 20),
            (resource.RLIMIT_NPROC, own + lim.processes),
            (resource.RLIMIT_FSIZE, lim.file_mb << 20),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(kind, (value, value))

    def _run(self, command: list[str], fds: tuple[int, ...], uid: int) -> SandboxResult:
        as_other = uid != os.geteuid()
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=BWRAP_ENVIRONMENT,
            pass_fds=fds,
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
        _kill(process)
        out, err, overflowed = reader.join()  # to the last byte: the cap is decided on all of it
        if overflowed and error is None:
            error = f"stopped: printed more than the sandbox's {self.limits.output_bytes} output bytes"
        code = None if error is not None else process.returncode
        if code is not None and code > 128:  # bwrap exits 128 + N for a program killed by signal N
            code = 128 - code
        if error is None and code and "[Errno 28] No space left on device" in err:
            error = f"exited with status {code}: its files passed the sandbox's disk budget of {self.limits.disk_mb} MB"
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


def _kill(process: subprocess.Popen) -> None:
    """End whatever is left of the run, and reap it. The program is its pid namespace's first
    process, a child of bwrap: killed, the kernel kills the rest of the namespace and bwrap exits
    on its own, reaped here. Killing bwrap first would leave that child a zombie for whichever
    process adopts it (bwrap's ``--new-session`` puts it out of bwrap's process group)."""
    if process.poll() is None:
        for child in _children(process.pid):
            _signal(child)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # bwrap had not started the program yet
            _signal(-process.pid)
    process.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _signal(pid: int) -> None:
    """SIGKILL to ``pid`` (a process group where negative); one gone already is fine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _CappedReader:
    """Reads a process's stdout and stderr to their end in threads, keeping at most ``cap`` bytes
    in all; past the cap it stops the run (bwrap's child, as ``_kill``), and ``join`` says so
    once both streams are read."""

    def __init__(self, process: subprocess.Popen, cap: int) -> None:
        self.cap, self.seen, self.process = cap, 0, process
        self._kept = {"out": bytearray(), "err": bytearray()}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._read, args=(stream, name), daemon=True)
            for stream, name in ((process.stdout, "out"), (process.stderr, "err"))
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, stream, name: str) -> None:
        while chunk := stream.read1(4096):
            with self._lock:
                room = self.cap - sum(len(k) for k in self._kept.values())
                self._kept[name] += chunk[: max(room, 0)]
                self.seen += len(chunk)
            if len(chunk) > room:
                for child in _children(self.process.pid):
                    _signal(child)

    def join(self) -> tuple[str, str, bool]:
        """(stdout, stderr, whether there was more than the cap), after both streams ended."""
        for thread in self._threads:
            thread.join()
        out, err = (bytes(self._kept[k]).decode("utf-8", "replace") for k in ("out", "err"))
        return out, err, self.seen > self.cap


class RemoteSandbox:
    """``Sandbox`` as a service: POSTs ``{"code", "limits"}`` as JSON to ``url`` and reads a
    ``SandboxResult``'s fields back. hybridflow ships no such service: a deployment runs its own
    (tests/agentic/test_sandbox.py serves one with ``BubblewrapSandbox`` behind it)."""

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
