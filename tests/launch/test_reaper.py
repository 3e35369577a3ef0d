"""Processes a crashed job leaves behind are stopped when the launcher's command returns.

The launcher runs in a subprocess here: becoming a child subreaper is for the life of the
process, and pytest's own process must not adopt (and leave as zombies) every later test's
orphans.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# a crashing "job": it starts a long-lived grandchild, writes its pid, and dies abruptly
_JOB = (
    "import subprocess, sys, os\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "open(sys.argv[1], 'w').write(str(p.pid))\n"
    "os._exit(17)\n"
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.claim("stop-grace")
def test_orphans_of_a_crashed_job_are_reaped(tmp_path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    launcher = textwrap.dedent(f"""
        import os, sys
        from launch.reaper import run_reaped
        code = run_reaped([sys.executable, "-c", {_JOB!r}, {str(pid_file)!r}], os.environ).returncode
        sys.exit(0 if code == 17 else 1)
    """)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", launcher],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(grandchild):
        assert time.monotonic() < deadline, "the orphaned grandchild is still running"
        time.sleep(0.1)
    assert time.monotonic() - started < 30
