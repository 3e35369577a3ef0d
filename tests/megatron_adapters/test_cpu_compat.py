"""Each CPU workaround is needed, and with all of them applied megatron-core runs on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adapters import cpu_compat

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("compat_scenarios.py")
TWO_PROCESS = {"ep2_step", "etp2_uneven_step", "tp2_moe_step"}
# patch left out -> (scenario that then fails, text of the error it avoids)
NEEDED = {
    "block_cuda_only_imports": ("import_attention", "flash_mla"),
    "_patch_cuda_runtime": ("build_moe", "CUDA"),
    "_patch_device_factories": ("build_moe", "Found no NVIDIA driver"),
    "_patch_rng_tracker": ("build_moe", "CUDA"),
    "_patch_torch_norm_sequence_parallel": ("seq_parallel_norm", "sequence parallel not supported by torch LayerNorm"),
    "_patch_gloo_all_to_all_splits": ("ep2_step", "all_to_all_single(): incompatible function arguments"),
    "_patch_gloo_uneven_all_gather": ("etp2_uneven_step", "ProcessGroupGloo::allgather: invalid tensor size"),
    "_patch_moe_utils_te_names": ("train_moe", "te_general_gemm"),
    "_patch_mla_without_te": ("build_mla", "isinstance() arg 2 must be a type"),
    "_patch_distrib_optimizer_step_state": ("resume_adam", "KeyError: 'step'"),
}


ONE_PROCESS_ALL_PATCHES = ["import_attention", "build_mla", "train_moe", "seq_parallel_norm", "resume_adam"]
TWO_PROCESS_ALL_PATCHES = ["ep2_step", "etp2_uneven_step", "tp2_moe_step"]


def _run(*scenarios: str, skip: str = "") -> subprocess.CompletedProcess:
    """The scenarios one after another in one fresh process (one torchrun launch of two)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", cpu_compat.SKIP_ENV: skip}
    if scenarios[0] in TWO_PROCESS:
        assert set(scenarios) <= TWO_PROCESS, scenarios
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPT),
            *scenarios,
        ]
    else:
        assert not set(scenarios) & TWO_PROCESS, scenarios
        cmd = [sys.executable, str(SCRIPT), *scenarios]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)


@pytest.fixture(scope="module")
def all_patches_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every scenario with every patch applied: the one-process ones in one process, the
    two-process ones in one launch (a scenario that fails stops those after it, which fail too)."""
    one, two = _run(*ONE_PROCESS_ALL_PATCHES), _run(*TWO_PROCESS_ALL_PATCHES)
    return {**dict.fromkeys(ONE_PROCESS_ALL_PATCHES, one), **dict.fromkeys(TWO_PROCESS_ALL_PATCHES, two)}


@pytest.mark.claim("cpu-workarounds-each-needed")
def test_every_patch_is_listed_here() -> None:
    assert set(NEEDED) == cpu_compat.patch_names()


@pytest.mark.claim("cpu-workarounds-each-needed")
@pytest.mark.parametrize("patch", sorted(NEEDED))
def test_scenario_fails_without_its_patch(patch: str) -> None:
    scenario, error = NEEDED[patch]
    result = _run(scenario, skip=patch)
    assert result.returncode != 0, f"{scenario} passed without {patch}"
    assert error in result.stdout + result.stderr


@pytest.mark.parametrize("scenario", ONE_PROCESS_ALL_PATCHES + TWO_PROCESS_ALL_PATCHES)
@pytest.mark.claim("cpu-workarounds-each-needed")
def test_scenario_runs_with_all_patches(scenario: str, all_patches_runs) -> None:
    result = all_patches_runs[scenario]
    ranks = 2 if scenario in TWO_PROCESS else 1
    for rank in range(ranks):
        assert f"SCENARIO OK {scenario} rank {rank}\n" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.claim("cpu-workarounds-each-needed")
def test_nothing_is_patched_on_a_gpu_machine(monkeypatch) -> None:
    monkeypatch.setattr(cpu_compat.torch.cuda, "is_available", lambda: True)
    assert not cpu_compat.on_cpu()
    before = set(cpu_compat.applied())
    cpu_compat.apply()
    assert set(cpu_compat.applied()) == before


@pytest.mark.claim("gpu-kernel-imports-skipped")
def test_gpu_kernel_packages_are_skipped_while_megatron_imports_and_import_after() -> None:
    """On CPU, megatron-core's guarded imports of flashinfer and DeepEP take their no-kernel branch
    (about 3.5 s of CPU less per process); the packages still import afterwards, for SGLang."""
    code = (
        "import sys, megatron_adapters\n"
        "from megatron.core.inference.contexts import dynamic_context\n"
        "from megatron.core.transformer.moe import fused_a2a\n"
        "print('LOADED', sorted(n for n in ('flashinfer', 'deep_ep') if n in sys.modules))\n"
        "print('MEGATRON SEES', dynamic_context.HAVE_FLASHINFER, fused_a2a.HAVE_DEEP_EP)\n"
        "import flashinfer\n"
        "print('AFTER', flashinfer.__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED []\nMEGATRON SEES False False\nAFTER flashinfer\n" in result.stdout, result.stdout
