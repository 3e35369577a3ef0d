"""The code sandbox against hostile programs: each is contained, reported, and the next run works."""

from __future__ import annotations

import json
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
    assert tries.pop("write_scratch") == "done"  # its own folder, removed after the run
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
