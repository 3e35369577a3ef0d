"""The SGLang adapter's pieces that need no running engine: start-up checks, output parsing."""

import base64
import json

import numpy as np
import pytest

from hybridflow.rollout import engine_names, make_engine
from hybridflow.rollout.sglang import cpu, engine


def test_sglang_is_a_registered_engine():
    assert "sglang" in engine_names()


@pytest.mark.skipif(cpu.has_cuda_gpu(), reason="checks of the CPU engine")
@pytest.mark.parametrize("kwargs,match", [
    (dict(tp=2, ep=2), "ep=2"),
    (dict(deterministic=True), "deterministic"),
    (dict(return_routed_experts=True), "return_routed_experts"),
    (dict(tp=3, ep=2), "ep must divide tp"),
    (dict(pause_mode="freeze"), "pause_mode"),
])
def test_settings_the_cpu_engine_cannot_run_are_refused_before_start(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_engine("sglang", model_path=str(tmp_path), **kwargs)


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
    assert engine._buckets(["a", "b", "c", "d"], [4, 4, 10, 1], bucket_bytes=8) == [["a", "b"], ["c"], ["d"]]


@pytest.mark.parametrize("result,ok", [
    ((True, "Success"), True), ((False, "bad"), False), ({"success": False, "message": "x"}, False), (None, True),
])
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
