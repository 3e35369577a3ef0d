"""The SGLang adapter's pieces that need no running engine: start-up checks, output parsing."""

import asyncio
import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest

from hfschema.buckets import fill_buckets
from hybridflow.rollout import SamplingParams, engine_names, make_engine
from hybridflow.rollout.sglang import cpu, engine, handles


@pytest.mark.claim("engine-registry")
def test_sglang_is_a_registered_engine():
    assert "sglang" in engine_names()


@pytest.mark.skipif(cpu.has_cuda_gpu(), reason="checks of the CPU engine")
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=2, ep=2), "ep=2"),
        (dict(deterministic=True), "deterministic"),
        (dict(return_routed_experts=True), "return_routed_experts"),
        (dict(tp=3, ep=2), "ep must divide tp"),
        (dict(pause_mode="freeze"), "pause_mode"),
    ],
)
def test_settings_the_cpu_engine_cannot_run_are_refused_before_start(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_engine("sglang", model_path=str(tmp_path), **kwargs)


@pytest.mark.skipif(cpu.has_cuda_gpu(), reason="checks of the CPU engine")
def test_a_cpu_engine_that_would_spawn_is_refused_lora_before_start(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "can_fork_engine_processes", lambda: False)  # e.g. OMP_NUM_THREADS unset
    with pytest.raises(ValueError, match="LoRA adapters only from forked processes"):
        make_engine(
            "sglang", model_path=str(tmp_path), **engine.lora_args(rank=8, target_modules=["q_proj"], on_cpu=True)
        )


def test_routed_experts_keep_every_fed_position_and_drop_dense_layers():
    prompt_len, response_len, layers, top_k = 3, 2, 3, 2
    rows = np.arange((prompt_len + response_len - 1) * layers * top_k, dtype=np.int32).reshape(-1, layers, top_k)
    meta = {"routed_experts": base64.b64encode(rows.tobytes()).decode()}
    got = engine._routed_experts(meta, prompt_len, response_len, layers, top_k)
    assert got.shape == (prompt_len + response_len - 1, layers, top_k)  # RolloutSample's layout
    assert np.array_equal(got, rows)
    deepseek = engine._routed_experts(meta, prompt_len, response_len, layers, top_k, first_dense=1)
    assert np.array_equal(deepseek, rows[:, 1:])
    assert engine._routed_experts({}, prompt_len, response_len, layers, top_k) is None
    with pytest.raises(RuntimeError, match="routed experts for 4 positions.*feeds 5"):
        engine._routed_experts(meta, prompt_len + 1, response_len, layers, top_k)


def test_buckets_keep_order_and_size():
    assert fill_buckets(["a", "b", "c", "d"], [4, 4, 10, 1], 8) == [["a", "b"], ["c"], ["d"]]


@pytest.mark.parametrize(
    "result,ok",
    [
        ((True, "Success"), True),
        ((False, "bad"), False),
        ({"success": False, "message": "x"}, False),
        (None, True),
    ],
)
def test_check_result_reads_every_shape_of_sglang_reply(result, ok):
    if ok:
        engine._check_result(result, "call")
    else:
        with pytest.raises(RuntimeError, match="call failed"):
            engine._check_result(result, "call")


def test_is_moe_reads_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    assert engine._is_moe(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_experts_per_tok": 0}}))
    assert not engine._is_moe(str(tmp_path))
    assert not engine._is_moe(str(tmp_path / "missing"))


class _FakeSGLang:
    """Stands in for ``sglang.Engine`` to follow the adapter's GPU memory bookkeeping (a GPU
    engine cannot start here); records the calls SGLang would receive."""

    tokenizer_manager = SimpleNamespace(
        context_len=64,
        model_config=SimpleNamespace(
            vocab_size=320, hf_text_config=SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2)
        ),
        _subprocess_watchdog=None,
        auto_create_handle_loop=lambda: None,
    )

    def __init__(self):
        self.calls = []
        self.loop = asyncio.new_event_loop()  # the watch takes SIGQUIT over on it

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))

    def begin_weight_update(self):
        self.calls.append(("begin",))

    def end_weight_update(self):
        self.calls.append(("end",))

    def generate(self, input_ids, sampling_params, return_logprob, return_routed_experts):
        self.calls.append(("generate", len(input_ids)))
        meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.5, 9, None)]}
        return [{"output_ids": [9], "meta_info": meta} for _ in input_ids]


@pytest.mark.claim("engine-memory-release")
def test_gpu_memory_release_resume_and_push_order_is_enforced(tmp_path, monkeypatch):
    fake = _FakeSGLang()
    monkeypatch.setattr(engine, "_shutdown", lambda *_args: None)  # nothing to shut down
    gpu = engine.SGLangEngine(
        fake,
        tp=1,
        on_cpu=False,
        model_path=str(tmp_path),
        routed_experts=False,
        deterministic=False,
        pause_mode="retract",
        own_processes=(),
    )
    sent = []
    monkeypatch.setattr(gpu, "_send_payloads", lambda payloads, flush_cache: sent.append(len(payloads)))
    payload = [handles.RankPayload(rank=0, handles={"model.norm.weight": b"handle"}, nbytes=256)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)

    gpu.resume_memory()  # nothing released: SGLang is not asked (it refuses to resume what is resident)
    gpu.release_memory()
    gpu.release_memory(["kv_cache"])  # already released
    assert fake.calls == [("release", ("weights", "kv_cache", "cuda_graph"))]
    with pytest.raises(RuntimeError, match="released: call resume_memory"):
        gpu.generate([[7, 8]], greedy)
    with pytest.raises(RuntimeError, match=r"resume_memory\(\('weights',\)\) first"):
        gpu.push_rank_payloads(payload)
    assert sent == []

    gpu.resume_memory(["weights"])
    gpu.resume_memory()  # the rest
    assert fake.calls[1:] == [("resume", ("weights",)), ("resume", ("kv_cache", "cuda_graph"))]
    with pytest.raises(RuntimeError, match="values are gone"):  # resident again, but not restored
        gpu.generate([[7, 8]], greedy)
    gpu.push_rank_payloads(payload)
    assert sent == [1]
    assert gpu.generate([[7, 8]], greedy).samples[0].response_ids == (9,)
    with pytest.raises(ValueError, match="memory tags"):
        gpu.release_memory(["kv"])


@pytest.mark.claim("engine-starts-without-weights")
def test_an_engine_started_without_weights_generates_only_after_a_push(tmp_path, monkeypatch):
    fake = _FakeSGLang()
    monkeypatch.setattr(engine, "_shutdown", lambda *_args: None)
    empty = engine.SGLangEngine(
        fake,
        tp=1,
        on_cpu=True,
        model_path=str(tmp_path),
        routed_experts=False,
        deterministic=False,
        pause_mode="retract",
        own_processes=(),
        weights_loaded=False,
    )  # load_format="dummy"
    monkeypatch.setattr(empty, "_send_payloads", lambda payloads, flush_cache: None)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    with pytest.raises(RuntimeError, match="load_format='dummy'"):
        empty.generate([[7, 8]], greedy)
    empty.push_rank_payloads([handles.RankPayload(rank=0, handles={"model.norm.weight": b"handle"}, nbytes=256)])
    assert empty.generate([[7, 8]], greedy).samples[0].response_ids == (9,)


@pytest.mark.claim("gpu-layout-pins")
def test_gpu_engines_start_with_the_layout_the_reshard_plan_writes(tmp_path):
    args = engine._engine_args(
        str(tmp_path),
        tp=2,
        ep=1,
        dtype="bfloat16",
        max_total_tokens=64,
        seed=0,
        on_cpu=False,
        routed=False,
        deterministic=False,
    )
    for key, pinned in engine.GPU_LAYOUT_PINS.items():
        assert args[key] == pinned
    assert args["disable_shared_experts_fusion"] is True and args["moe_runner_backend"] == "triton"
    cpu_args = engine._engine_args(
        str(tmp_path),
        tp=2,
        ep=1,
        dtype="float32",
        max_total_tokens=64,
        seed=0,
        on_cpu=True,
        routed=False,
        deterministic=False,
    )
    assert not set(engine.GPU_LAYOUT_PINS) & set(cpu_args)  # CPU layouts never take those paths


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(moe_runner_backend="flashinfer_cutlass"), "moe_runner_backend='flashinfer_cutlass'"),
        (dict(disable_shared_experts_fusion=False), "disable_shared_experts_fusion=False"),
        (dict(moe_a2a_backend="deepep"), "moe_a2a_backend='deepep'"),
        (dict(ep_num_redundant_experts=8), "ep_num_redundant_experts=8"),
    ],
)
@pytest.mark.claim("gpu-layout-pins")
def test_layout_changing_overrides_are_refused_before_start(override, key, tmp_path):
    with pytest.raises(ValueError, match=f"sglang {key} changes the engine's parameter layout"):
        engine._check_layout_overrides(override, on_cpu=False)
    engine._check_layout_overrides({"moe_runner_backend": "triton"}, on_cpu=False)  # the pinned value is fine


@pytest.mark.claim("gpu-layout-pins")
def test_layout_changing_environment_is_refused_on_gpus(monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED", "1")
    with pytest.raises(ValueError, match="SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED=1 re-lays"):
        engine._check_layout_overrides({}, on_cpu=False)
    engine._check_layout_overrides({}, on_cpu=True)  # the CPU engine has no such path


@pytest.mark.claim("gpu-layout-pins")
def test_the_sliced_push_ends_by_rederiving_what_the_model_builds_from_weights():
    from hybridflow.rollout.sglang import post_load

    class Model:
        calls = 0

        def post_load_weights(self):
            Model.calls += 1

    post_load.rederive(Model(), [("post_load", None)])
    assert Model.calls == 1
    post_load.rederive(object(), [])  # no hook: nothing to do

    class Broken:
        def post_load_weights(self):
            raise RuntimeError("boom")

    post_load.rederive(Broken(), [])  # logged, never raised: an exception would kill the scheduler


def test_a_shutdown_spares_a_process_that_took_the_pid_of_an_engine_process_gone_before():
    """Pids wrap (32768 by default): a scheduler that died earlier in a long run can have its pid
    given to another process of the trainer's (CI saw its wandb service killed mid-test by a
    garbage-collected engine). The engine keeps its processes with their start times, so the pid's
    new owner is not its to kill; its own live processes still are."""
    import subprocess
    import sys

    import psutil

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # the engine's record of a process that had the stranger's pid and started earlier
        recorded = psutil.Process(stranger.pid)
        pid, started = recorded._ident
        recorded._ident = (pid, started - 100.0)
        tree = engine._descendants((recorded, psutil.Process(ours.pid)))
        assert [p.pid for p in tree] == [ours.pid]
        engine._kill_and_reap(tree, quiet=True)
        assert not tree[0].is_running() and stranger.poll() is None
    finally:
        for process in (stranger, ours):
            process.kill()
            process.wait()
