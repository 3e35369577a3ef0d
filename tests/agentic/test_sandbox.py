"""The code sandbox against hostile programs: each is contained, reported, and the next run works."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hybridflow.agentic.sandbox import BubblewrapSandbox, RemoteSandbox, SandboxLimits, SandboxResult

LIMITS = SandboxLimits(wall_seconds=4.0, cpu_seconds=2, memory_mb=256, processes=16, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox() -> BubblewrapSandbox:
    return BubblewrapSandbox(LIMITS)  # SandboxUnavailable (how to install bubblewrap) fails the module


def _still_works(sandbox: BubblewrapSandbox) -> None:
    after = sandbox.run("print(6 * 7)")
    assert after.ok and after.stdout == "42\n", after


def test_a_plain_program_runs_and_prints(sandbox) -> None:
    result = sandbox.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    assert result.ok and (result.stdout, result.stderr) == ("out\n", "err\n")
    failed = sandbox.run("raise ValueError('bad input')")
    assert not failed.ok and failed.describe() == "exited with status 1: ValueError: bad input"


@pytest.mark.claim("sandbox-contains-hostile-code")
@pytest.mark.parametrize(
    ("name", "code", "said"),
    [
        # RLIMIT_CPU: SIGXCPU, then SIGKILL; on a machine loaded enough that the CPU seconds take
        # longer than the wall time, the wall-time limit stops it first: contained either way
        ("infinite loop", "while True:\n    pass\n", ("SIGKILL", "wall-time limit of 4 s")),
        ("sleeping forever", "import time\ntime.sleep(3600)\n", ("wall-time limit of 4 s",)),
        ("10 GB allocation", "x = bytearray(10 * 2**30)\n", ("MemoryError",)),
        ("huge output", "while True:\n    print('x' * 1000)\n", ("more than the sandbox's 4096 output bytes",)),
    ],
)
def test_runaway_programs_are_stopped_and_reported(sandbox, name: str, code: str, said: tuple[str, ...]) -> None:
    began = time.monotonic()
    result = sandbox.run(code)
    assert not result.ok and any(s in result.describe() for s in said), (name, result)
    assert time.monotonic() - began < LIMITS.wall_seconds + 3
    if name == "huge output":
        assert len(result.stdout) + len(result.stderr) <= LIMITS.output_bytes
    _still_works(sandbox)


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_a_fork_bomb_is_held_to_the_process_limit(sandbox) -> None:
    code = (
        "import os, time\n"
        "children = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(children, flush=True)\n"
        "time.sleep(30)\n"
    )
    result = sandbox.run(code)
    assert not result.ok and "wall-time limit" in result.describe()
    assert 0 < int(result.stdout) < LIMITS.processes  # refused well before 200
    _still_works(sandbox)  # every child was killed with the run: the limit is free again


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_the_run_directory_the_network_and_the_host_are_out_of_reach(sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "run" / "checkpoints" / "secret.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text("weights")
    escape = tmp_path / "escaped.txt"
    code = f"""
import os, socket
tries = {{}}
def attempt(name, fn):
    try:
        fn()
        tries[name] = "done"
    except OSError as error:
        tries[name] = type(error).__name__
attempt("read_run_dir", lambda: open({str(secret)!r}).read())
attempt("read_home", lambda: os.listdir("/root"))
attempt("write_outside", lambda: open({str(escape)!r}, "w").write("x"))
attempt("write_usr", lambda: open("/usr/owned", "w").write("x"))
attempt("socket", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2))
attempt("write_scratch", lambda: open("/work/mine.txt", "w").write("x"))
print(sorted(tries.items()))
"""
    result = sandbox.run(code)
    assert result.ok, result
    tries = dict(eval(result.stdout))
    assert tries.pop("write_scratch") == "done"  # its own tmpfs, gone with the run
    assert all(outcome != "done" for outcome in tries.values()), tries
    assert not escape.exists() and not Path("/usr/owned").exists()


class _Service(BaseHTTPRequestHandler):
    """A sandbox service for the test: runs the posted code in the local sandbox."""

    sandbox: BubblewrapSandbox

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps(vars(self.sandbox.run(request["code"]))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def test_a_remote_sandbox_service_stands_in_for_the_local_one(sandbox) -> None:
    _Service.sandbox = sandbox
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = RemoteSandbox(f"http://127.0.0.1:{server.server_port}/run", LIMITS)
        assert remote.run("print(1 + 1)") == SandboxResult("2\n", "", 0)
    finally:
        server.shutdown()
        server.server_close()
    gone = RemoteSandbox(f"http://127.0.0.1:{server.server_port}/run", LIMITS).run("print(1)")
    assert not gone.ok and "sandbox service" in gone.describe()


def test_hostile_code_through_the_python_tool_is_a_tool_error_and_the_trajectory_goes_on(sandbox) -> None:
    """The sandboxed tool in a ToolEnvironment: a fork bomb and a memory grab come back as error
    observations, counted, and the next call in the same trajectory works."""
    import concurrent.futures

    from hybridflow.agentic.builtin_tools import python_tool
    from hybridflow.agentic.env import ToolEnvironment
    from hybridflow.agentic.parsers import parse_hermes

    def call(code: str) -> str:
        return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        env = ToolEnvironment([python_tool(sandbox)], parse_hermes, pool=pool)
        hostile = env.step(call("x = bytearray(10 * 2**30)") + call("import os\nwhile True:\n    os.fork()"))
        fine = env.step(call("print(sum(range(10)))"))
    assert hostile.outcome.errors == 2 and not hostile.done
    assert "MemoryError" in hostile.messages[0]["content"]
    assert "Resource temporarily unavailable" in hostile.messages[1]["content"]  # fork refused: the process limit
    assert fine.messages == [{"role": "tool", "content": "45\n"}] and fine.outcome.errors == 0


def test_programs_running_at_once_do_not_share_one_process_budget(sandbox) -> None:
    """Four programs at once, each with 10 children under a limit of 16: each has its own budget
    (as root every run gets a uid of its own; sharing one, 44 processes would meet one limit)."""
    import concurrent.futures

    code = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(10):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(1.5)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "for pid in kids:\n"
        "    os.waitpid(pid, 0)\n"
        "print('forked', len(kids))\n"
    )
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sandbox.run, [code] * 4))
    assert [(r.ok, r.stdout) for r in results] == [(True, "forked 10\n")] * 4, results


# What a sandbox that keeps the trainer's secrets must hold beyond its walls (issue 58): each test
# fails on the sandbox before it (the trainer's environment passed to bwrap, the session keyring
# shared, / and /dev writable tmpfs of half the host's RAM, no syscall filter, bwrap's pid 1 left
# a zombie, the output cap decided before the last byte was read).

_ATTEMPT = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(number, *args)
    return result if result >= 0 else os.strerror(ctypes.get_errno())
"""


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_nothing_of_the_trainers_environment_or_memory_is_readable_inside(sandbox, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_planted_by_the_test")
    code = _ATTEMPT + (
        "seen = b''\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    for name in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            seen += open(f'/proc/{pid}/{name}', 'rb').read()\n"
        "        except OSError:\n"
        "            pass\n"
        "print(json.dumps({'pids': sorted(p for p in os.listdir('/proc') if p.isdigit()), 'me': os.getpid(),\n"
        "    'planted': b'hf_planted' in seen, 'environ': sorted(os.environ),\n"
        "    'attach': call(101, 16, 1, 0, 0)}))\n"  # PTRACE_ATTACH to pid 1
    )
    result = sandbox.run(code)
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert not seen["planted"] and seen["environ"] == ["HOME", "LANG", "PATH", "PWD"]
    assert seen["me"] == 1 and seen["pids"] == ["1"]  # the program is pid 1: no bwrap process to read
    assert seen["attach"] == "Operation not permitted"


def _add_key(description: bytes, payload: bytes) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(248, b"user", description, payload, len(payload), ctypes.c_int(-3))  # add_key, session
    if key < 0:
        pytest.fail(f"add_key in the test's own session keyring failed: {os.strerror(ctypes.get_errno())}")
    return key


def _find_key(description: bytes) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(250, 10, ctypes.c_int(-3), b"user", description, 0)  # KEYCTL_SEARCH


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_the_trainers_session_keyring_is_out_of_reach(sandbox) -> None:
    _add_key(b"hybridflow-test-secret", b"hunter2")
    code = _ATTEMPT + (
        "found = call(250, 10, ctypes.c_int(-3), b'user', b'hybridflow-test-secret', 0)\n"
        "added = call(248, b'user', b'hybridflow-test-planted', b'x', 1, ctypes.c_int(-3))\n"
        "print(json.dumps([found, added]))\n"
    )
    result = sandbox.run(code)
    assert result.ok and json.loads(result.stdout) == ["Operation not permitted"] * 2, result
    assert _find_key(b"hybridflow-test-planted") < 0  # nothing the program added reached the trainer's


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_memory_and_disk_are_bounded_as_a_whole_and_reported(sandbox) -> None:
    """/ and /dev are read-only; /work (and /tmp inside it) hold ``disk_mb`` in all, and a
    process's address space is what is left of ``memory_mb``."""
    writable = sandbox.run(
        "import json\nout = {}\n"
        "for d in ('/', '/dev', '/dev/shm', '/tmp', '/work'):\n"
        "    try:\n"
        "        open(d.rstrip('/') + '/x', 'w').write('x'); out[d] = 'written'\n"
        "    except OSError as error:\n"
        "        out[d] = error.strerror\n"
        "print(json.dumps(out))\n"
    )
    assert json.loads(writable.stdout) == {
        "/": "Read-only file system",
        "/dev": "Read-only file system",
        "/dev/shm": "Read-only file system",
        "/tmp": "written",
        "/work": "written",
    }
    chunk = "open(f'{d}/f{i}', 'wb').write(bytes(10 << 20))"  # under the 16 MB file limit each
    disk = sandbox.run(f"for i in range(10):\n    d = '/tmp' if i % 2 else '/work'\n    {chunk}\n")
    assert not disk.ok and disk.describe() == (
        f"exited with status 1: its files passed the sandbox's disk budget of {LIMITS.disk_mb} MB"
    )
    left = LIMITS.memory_mb - LIMITS.disk_mb
    assert "MemoryError" in sandbox.run(f"x = bytearray({left + 8} << 20)").describe()
    assert sandbox.run(f"x = bytearray({left - 64} << 20)").ok
    _still_works(sandbox)


@pytest.mark.claim("sandbox-contains-hostile-code")
@pytest.mark.parametrize(
    ("name", "attempt"),
    [
        ("unshare a user namespace", "call(272, 0x10000000)"),
        ("clone into a new mount namespace", "call(56, 0x20000 | 17, 0, 0, 0, 0)"),  # CLONE_NEWNS | SIGCHLD
        ("io_uring", "call(425, 8, ctypes.create_string_buffer(120))"),
        ("userfaultfd", "call(323, 0)"),
        ("keyctl", "call(250, 0, ctypes.c_int(-3), 0)"),  # KEYCTL_GET_KEYRING_ID of the session
        ("ptrace", "call(101, 0, 0, 0, 0)"),  # PTRACE_TRACEME
        ("mount", "call(165, b'none', b'/work', b'tmpfs', 0, 0)"),
    ],
)
def test_the_kernels_riskiest_interfaces_are_refused(sandbox, name: str, attempt: str) -> None:
    result = sandbox.run(_ATTEMPT + f"print(json.dumps({attempt}))\n")
    assert result.ok and json.loads(result.stdout) == "Operation not permitted", (name, result)


def _zombies() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and (entry / "comm").read_text().strip() in ("bwrap", "python3"):
            found.add(int(entry.name))
    return found


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_no_process_is_left_behind_after_ten_calls(sandbox) -> None:
    """Programs that end, fail, print too much and sleep past the wall time: each run is reaped."""
    quick = BubblewrapSandbox(dataclasses.replace(LIMITS, wall_seconds=0.5))
    before = _zombies()
    programs = ["print(1)", "raise SystemExit(3)", "print('x' * 10**5)", "import time; time.sleep(9)"]
    results = [quick.run(programs[i % len(programs)]) for i in range(10)]
    assert [r.ok for r in results[:4]] == [True, False, False, False]
    time.sleep(0.2)
    assert _zombies() - before == set()


@pytest.mark.claim("sandbox-contains-hostile-code")
def test_output_past_the_cap_is_reported_every_time_even_with_a_busy_trainer(sandbox) -> None:
    """The cap is decided once both streams are read to their end: a program that prints 20,000
    bytes and exits at once is reported cut, however late the reading threads got the bytes."""
    stop = threading.Event()

    def busy() -> None:  # a trainer thread holding the GIL most of the time
        while not stop.is_set():
            sum(range(10_000))

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        results = [sandbox.run("import sys; sys.stdout.write('x' * 20_000)") for _ in range(100)]
    finally:
        stop.set()
    cut = [r for r in results if r.error and f"more than the sandbox's {LIMITS.output_bytes}" in r.error]
    assert len(cut) == 100, [r for r in results if r not in cut][:1]
    assert all(len(r.stdout) == LIMITS.output_bytes for r in cut)


def test_a_bubblewrap_too_old_for_the_sandbox_is_one_line_naming_the_fix(tmp_path: Path, monkeypatch) -> None:
    from hybridflow.agentic.sandbox import SandboxUnavailable

    old = tmp_path / "bwrap"
    old.write_text("#!/bin/sh\necho bubblewrap 0.6.1\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(SandboxUnavailable) as raised:
        BubblewrapSandbox(LIMITS)
    assert str(raised.value) == (
        f"the code sandbox needs bubblewrap 0.8.0 or newer (--size, --disable-userns); {old} is 0.6.1: install "
        "a newer bubblewrap (Debian 12's is 0.8.0), or set agentic.sandbox=remote"
    )
