"""Processes a crashed job leaves behind are stopped when the launcher's command returns."""

from __future__ import annotations

import os
import sys
import time

import psutil

from launch.reaper import run_reaped

# the child starts a long-lived grandchild, prints its pid, and dies abruptly (like a killed rank)
_CHILD = (
    "import subprocess, sys, os\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "open(sys.argv[1], 'w').write(str(p.pid))\n"
    "os._exit(17)\n"
)


def test_orphans_of_a_crashed_child_are_reaped(tmp_path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    started = time.monotonic()
    code = run_reaped([sys.executable, "-c", _CHILD, str(pid_file)], os.environ)
    assert code == 17
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the orphaned grandchild is still running"
        time.sleep(0.1)
    assert time.monotonic() - started < 30
