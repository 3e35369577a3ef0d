"""scripts/install.sh, as the README's two commands run it: a second run changes nothing, and
``--gpu`` is refused on a machine without CUDA before anything is installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _freeze() -> str:
    return subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout


@pytest.mark.claim("install-idempotent")
@pytest.mark.timeout(600)
def test_a_second_install_changes_nothing() -> None:
    """Run on the venv these tests run in (made by the first run): every pin is already there, so
    uv installs nothing and ``pip check`` still passes."""
    before = _freeze()
    env = {**os.environ, "HYBRIDFLOW_VENV": sys.prefix}
    env.pop("HYBRIDFLOW_INSTALLER", None)
    done = subprocess.run(
        ["bash", "scripts/install.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"using the existing venv {sys.prefix}" in done.stdout
    assert "runtime dependencies (requirements/runtime.txt, with uv)" in done.stdout, done.stdout[-3000:]
    assert "No broken requirements found." in done.stdout
    assert _freeze() == before


@pytest.mark.claim("install-gpu-needs-cuda")
def test_gpu_is_refused_without_cuda_before_anything_is_installed(tmp_path) -> None:
    if subprocess.run(["sh", "-c", "nvidia-smi -L"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a CUDA driver: --gpu is allowed here")
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["bash", "scripts/install.sh", "--gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HYBRIDFLOW_VENV": str(venv)},
        timeout=60,
    )
    assert done.returncode == 1
    assert "--gpu needs a working CUDA driver, but 'nvidia-smi -L' fails here" in done.stderr
    assert not venv.exists()
