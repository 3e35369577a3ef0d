"""The CPU environment for SGLang and the ``sgl_kernel`` stand-in (no engine started)."""

import os
import subprocess
import sys
import textwrap

import pytest

from hybridflow.rollout.sglang import cpu


@pytest.mark.parametrize(
    "tp,cores,expected",
    [
        (1, [0, 1], "0-1"),
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3], "0-1|2-3"),
        (2, [0, 1, 2], "0-1|2"),
        (2, [0, 2, 4, 6], "0,2|4,6"),
        (3, [0, 1], "0|1|0"),  # fewer cores than ranks: shared round-robin
    ],
)
def test_omp_threads_bind_splits_the_usable_cores(tp, cores, expected):
    assert cpu.omp_threads_bind(tp, cores) == expected


def test_omp_threads_bind_defaults_to_this_process_affinity():
    groups = cpu.omp_threads_bind(2).split("|")
    assert len(groups) == 2


def test_cpu_environment_puts_the_stand_in_first_once():
    env = cpu.cpu_environment(2, {"PYTHONPATH": f"/a{os.pathsep}{cpu.STUB_PATH}{os.pathsep}/b"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(cpu.STUB_PATH), "/a", "/b"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert not os.path.exists(env["SGLANG_NCCL_SO_PATH"])
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2


@pytest.mark.parametrize(
    "architecture,module",
    [
        ("Qwen3MoeForCausalLM", "qwen3_moe"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("DeepseekV3ForCausalLM", "deepseek_v2"),
        ("LlamaForCausalLM", "llama"),
        ("MixtralForCausalLM", "mixtral"),
    ],
)
@pytest.mark.claim("engine-model-modules-skipped")
def test_every_model_module_but_the_architectures_own_is_skipped(architecture, module):
    skipped = cpu.skipped_model_modules([architecture])
    assert module not in skipped
    assert set(cpu._model_sources()) - set(skipped) == {module}
    assert cpu.cpu_environment(1, {}, architectures=[architecture])[cpu.DISABLED_MODELS_ENV] == ",".join(skipped)


def test_an_unknown_architecture_skips_nothing_and_each_start_sets_its_own_list():
    assert cpu.skipped_model_modules(["NoSuchModelForCausalLM"]) == []
    # an engine for another model must not inherit the previous start's list
    assert cpu.cpu_environment(1, {cpu.DISABLED_MODELS_ENV: "qwen2"})[cpu.DISABLED_MODELS_ENV] == ""


@pytest.mark.claim("engine-model-modules-skipped")
def test_a_registry_loaded_for_one_architecture_takes_another_before_the_next_fork(tmp_path):
    """A process whose model registry was loaded with only qwen2's module (what a forked engine
    process would inherit) is given qwen3_moe's before a qwen3_moe engine starts."""
    code = """
        import os, sys
        from hybridflow.rollout.sglang import cpu
        os.environ[cpu.DISABLED_MODELS_ENV] = ",".join(cpu.skipped_model_modules(["Qwen2ForCausalLM"]))
        from sglang.srt.models.registry import ModelRegistry
        print("BEFORE", sorted(ModelRegistry.models))
        cpu.register_architectures(["Qwen3MoeForCausalLM"])
        print("AFTER", sorted(ModelRegistry.models))
    """
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.pathsep.join([str(cpu.STUB_PATH), os.getcwd()]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before = done.stdout.split("BEFORE ")[1].splitlines()[0]
    after = done.stdout.split("AFTER ")[1].splitlines()[0]
    assert "Qwen2ForCausalLM" in before and "Qwen3MoeForCausalLM" not in before, before
    assert "Qwen3MoeForCausalLM" in after and "Qwen2ForCausalLM" in after, after


def test_apply_does_nothing_when_a_gpu_is_present(monkeypatch):
    monkeypatch.setattr(cpu, "has_cuda_gpu", lambda: True)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert cpu.apply_cpu_environment(2) is False
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ


def test_apply_sets_the_environment_without_a_gpu(monkeypatch):
    monkeypatch.setattr(cpu, "has_cuda_gpu", lambda: False)
    for key in ("SGLANG_USE_CPU_ENGINE", "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_NCCL_SO_PATH", "PYTHONPATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert cpu.apply_cpu_environment(1) is True
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(cpu.STUB_PATH)
    assert sys.path[0] == str(cpu.STUB_PATH)


def _run_with_stub(code: str, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / "calls.log"
    env = dict(os.environ, PYTHONPATH=str(cpu.STUB_PATH), **{cpu.STUB_LOG_ENV: str(log)})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )
    return done, log.read_text() if log.exists() else ""


def test_stand_in_shadows_the_cuda_package_and_imports_what_sglang_names(tmp_path):
    done, calls = _run_with_stub(
        """
        import sgl_kernel
        assert sgl_kernel.IS_HYBRIDFLOW_CPU_STUB
        from sgl_kernel.scalar_type import scalar_types
        from sgl_kernel.kvcacheio import transfer_kv_per_layer
        table = [scalar_types.uint4b8, scalar_types.uint8b128]  # sglang builds such tables at import
        print(repr(transfer_kv_per_layer))
    """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "sgl_kernel.kvcacheio.transfer_kv_per_layer" in done.stdout
    assert calls == ""  # naming a kernel is not calling it


@pytest.mark.claim("stub-never-called")
def test_a_stand_in_kernel_records_the_call_and_raises(tmp_path):
    done, calls = _run_with_stub(
        """
        import os, sgl_kernel
        try:
            sgl_kernel.elementwise.silu_and_mul(1, 2)
        except sgl_kernel.StubKernelCalled as error:
            print("raised:", error)
    """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "raised: sgl_kernel.elementwise.silu_and_mul was called" in done.stdout
    pid, name = calls.split()
    assert name == "sgl_kernel.elementwise.silu_and_mul" and pid.isdigit()


@pytest.mark.claim("engine-processes-forked")
@pytest.mark.parametrize("omp,threads,expected", [("1", 1, True), (None, 1, False), ("2", 2, False), ("1", 2, False)])
def test_engine_processes_fork_only_where_openmp_never_ran_threads(monkeypatch, omp, threads, expected):
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert cpu.can_fork_engine_processes() is expected


FORKED_ENGINE = """
    import os, pathlib, sys, psutil, torch, torch.distributed as dist
    from hybridflow.rollout.base import SamplingParams, make_engine
    from megatron_adapters import device_guard
    from tests.rollout.sglang.reference import hf_logprobs, load_hf, tiny_model_dir
    if __name__ == "__main__":
        device_guard.install()  # as in every rank the tests start (parallel.initialize)
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
        marker = open(os.path.join(sys.argv[1], "marker"), "w")  # a forked child inherits this open file
        path = tiny_model_dir(pathlib.Path(sys.argv[1]), "qwen2", seed=0)
        engine = make_engine("sglang", model_path=str(path), tp=2, max_total_tokens=1024)
        children = psutil.Process().children()
        print("FORKED", sorted(marker.name in [f.path for f in c.open_files()] for c in children
                               if "resource_tracker" not in " ".join(c.cmdline())))
        trackers = [p for p in psutil.Process().children(recursive=True) if "resource_tracker" in " ".join(p.cmdline())]
        print("TRACKER_PARENTS", sorted({p.ppid() == os.getpid() for p in trackers}))
        sample = engine.generate([[7, 8, 9, 10]], SamplingParams(max_new_tokens=3)).samples[0]
        print("TOKENS", len(sample.response_ids))
        engine.shutdown()
        reference = hf_logprobs(load_hf(path), list(sample.prompt_ids), list(sample.response_ids))
        print("LOGPROB_DIFF", (torch.tensor(sample.logprobs) - reference).abs().max().item())
        ones = torch.ones(2, device="cpu")  # the rank's device here (the guard is on)
        dist.all_reduce(ones)  # the rank's own process group is untouched by the children's
        print("WORLD", dist.get_world_size(), ones.tolist())
        dist.destroy_process_group()
"""


@pytest.mark.claim("engine-processes-forked", "engine-model-modules-skipped")
def test_a_rank_forks_a_tp2_engines_processes_and_keeps_its_process_group(tmp_path):
    """The hybridflow rank's case under the tests (one OpenMP thread, a gloo process group up, the
    device guard on): the schedulers and the detokenizer are forked (they hold a file the rank
    opened; a spawned process starts with none of its files), they build their own TP group of 2
    and score as the HF model does (the guard inherited by a fork once made every log-prob
    -log V), and the rank's group still works after the engine stops."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(FORKED_ENGINE))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "FORKED [True, True, True]" in done.stdout, done.stdout[-2000:]
    # the children share the rank's resource tracker, as spawned ones would: one of their own would
    # be orphaned by the engine's shutdown and linger as a zombie the rank waits on
    assert "TRACKER_PARENTS [True]" in done.stdout, done.stdout[-2000:]
    assert "TOKENS 3" in done.stdout and "WORLD 1 [1.0, 1.0]" in done.stdout, done.stdout[-2000:]
    # the engine processes loaded qwen2's model module alone (cpu.skipped_model_modules): none of the
    # others' CUDA-only imports was tried
    assert "Ignore import error" not in done.stdout + done.stderr, done.stderr[-2000:]
    diff = float(done.stdout.split("LOGPROB_DIFF ")[1].split()[0])
    assert diff < 1e-4, done.stdout[-2000:]  # fp32 CPU kernels; observed ~2e-6


def test_sglangs_engine_imports_without_the_gpu_kernel_packages_which_import_again_after():
    """``gpu_kernels_absent``: SGLang's engine module imports on a CPU without flashinfer (its
    guarded imports take their no-kernel branch), and the package is importable again after the
    block, as the engine's later imports may need."""
    code = """
        import importlib.util, sys
        import megatron_adapters
        from hybridflow.rollout.sglang import cpu
        cpu.apply_cpu_environment(1)
        with cpu.gpu_kernels_absent():
            import sglang.srt.entrypoints.engine
        print("IMPORTED", "flashinfer" in sys.modules, importlib.util.find_spec("flashinfer") is not None)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORTED False True" in done.stdout, done.stdout[-2000:]
