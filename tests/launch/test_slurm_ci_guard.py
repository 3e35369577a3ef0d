"""In CI a Slurm test cannot skip quietly: with ``HYBRIDFLOW_REQUIRE_SLURM=1`` (set by ``.ci/run``
after it starts the cluster) a ``slurm`` test that skips is a failure (``tests/conftest.py``).

The real cluster tests run in a child pytest with no ``sbatch`` on PATH, so they take their
"Slurm is not installed" skip, which must stay a skip by default and become a failure when the
cluster is required.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_cluster_tests_without_slurm(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "HYBRIDFLOW_REQUIRE_SLURM"}
    clean.update(PATH=str(tmp_path), **env)  # an empty directory: no sbatch
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/launch/test_slurm_cluster.py"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.claim("slurm-required-in-ci")
@pytest.mark.parametrize("required", [False, True])
def test_a_missing_slurm_skips_unless_ci_requires_it(tmp_path: Path, required: bool):
    env = {"HYBRIDFLOW_REQUIRE_SLURM": "1"} if required else {}
    done = _run_cluster_tests_without_slurm(tmp_path, **env)
    summary = done.stdout.strip().splitlines()[-1]
    if required:
        # the skip is raised in setup, so pytest counts the failure as an error: exit status 1 either way
        assert done.returncode == 1 and re.search(r"\b\d+ errors?\b", summary) and "skipped" not in summary, done.stdout
        assert "HYBRIDFLOW_REQUIRE_SLURM=1 says a Slurm cluster is up, but this test skipped" in done.stdout
    else:
        assert done.returncode == 0 and re.search(r"\b\d+ skipped\b", summary) and "error" not in summary, done.stdout
        assert "Slurm is not installed" in done.stdout
