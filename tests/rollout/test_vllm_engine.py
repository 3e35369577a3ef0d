"""The vLLM engine (``rollout.engine=vllm``) against the transformers engine, on a tiny Qwen3-MoE made here.

vLLM runs in its own venv (``bash scripts/install.sh --vllm``; CI installs it and sets
``HYBRIDFLOW_REQUIRE_VLLM=1``, under which these tests fail instead of skipping without it). One
engine starts for the module (20 s on 2 cores): it starts without weights, takes a full push, and
its greedy tokens and their log-probs equal transformers' (fp32: the MoE experts repacked after
the reload, ``rollout/vllm/cpu.py``); seeded sampling repeats; a bad
push leaves it serving; a killed server is ``EngineLost`` naming the last lines of its log.
"""

import os
import re
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.rollout import RolloutEngine, SamplingParams, make_engine
from hybridflow.rollout.base import FINISH_LENGTH, FINISH_STOP, EngineLost
from hybridflow.rollout.tiny import make_tiny_model_dir
from hybridflow.rollout.vllm import env

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 7, 250, 3, 90])
SHAPE = dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1)  # vLLM's CPU attention: not 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=1, **SHAPE)


@pytest.fixture(scope="module")
def weights(tiny_dir):
    return load_file(str(tiny_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    torch.set_num_threads(1)
    return make_engine("hf", model_path=str(tiny_dir))


@pytest.fixture(scope="module")
def engine(tiny_dir, weights, tmp_path_factory):
    if env.version() is None:
        pytest.skip(f"vLLM is not installed ({env.INSTALL_COMMAND})")
    logs = tmp_path_factory.mktemp("logs")
    engine = make_engine("vllm", model_path=str(tiny_dir), max_context=128, log_dir=str(logs))
    engine.push_weights(weights)
    yield engine
    engine.shutdown()


@pytest.mark.claim("vllm-adapter")
def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.claim("vllm-adapter")
def test_greedy_tokens_and_logprobs_equal_transformers(engine, reference):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ours, theirs = engine.generate(PROMPTS, params), reference.generate(PROMPTS, params)
    for a, b in zip(ours.samples, theirs.samples):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert a.finish_reason == b.finish_reason


@pytest.mark.claim("vllm-adapter")
def test_seeded_sampling_repeats_and_gives_n_samples_per_prompt(engine):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=7)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [s.response_ids for s in first.samples] == [s.response_ids for s in again.samples]
    assert [(s.prompt_index, s.sample_index) for s in first.samples] == [(p, i) for p in range(3) for i in range(4)]
    assert len({s.response_ids for s in first.samples if s.prompt_index == 0}) > 1  # samples differ
    assert all(len(s.logprobs) == len(s.response_ids) for s in first.samples)


@pytest.mark.claim("vllm-adapter")
def test_stop_token_and_length_end_responses(engine, reference):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8)).samples[0]
    stop = greedy.response_ids[3]
    ended = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    sample = ended.samples[0]
    assert sample.response_ids == greedy.response_ids[: greedy.response_ids.index(stop) + 1]
    assert sample.finish_reason == FINISH_STOP
    assert greedy.finish_reason == FINISH_LENGTH and len(greedy.response_ids) == 8


@pytest.mark.claim("vllm-adapter")
def test_a_push_changes_what_it_generates_and_a_bad_one_is_named(engine, weights):
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params).samples
    scaled = {**weights, "lm_head.weight": -weights["lm_head.weight"]}
    report = engine.push_weights(scaled)
    assert report.route == "full" and report.bytes_per_rank[0] == sum(t.numel() * 4 for t in scaled.values())
    assert engine.generate(PROMPTS, params).samples != before
    with pytest.raises(RuntimeError, match=r"vLLM load failed: ValueError: .*'layers\.0\.not_a_weight'"):
        engine.push_weights({"model.layers.0.not_a_weight": torch.zeros(3)})
    engine.push_weights(weights)  # still serving, and back where it was
    assert [s.response_ids for s in engine.generate(PROMPTS, params).samples] == [s.response_ids for s in before]


@pytest.mark.claim("vllm-adapter")
def test_a_full_push_in_buckets_of_whole_modules_serves_as_one_file_does(engine, reference, weights):
    """One fusion group a file (``bucket_bytes=1``): every layer reloaded on its own, its MoE
    experts repacked once (a second repack of a layer another bucket filled would scramble them)."""
    from hybridflow.rollout.vllm.engine import fusion_groups

    groups = fusion_groups(list(weights))
    attention = next(g for g in groups if "model.layers.0.self_attn.q_proj.weight" in g)
    assert {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} <= set(attention)
    experts = next(g for g in groups if "model.layers.1.mlp.experts.0.gate_proj.weight" in g)
    assert len(experts) == 4 * 3 and all(n.startswith("model.layers.1.mlp.experts.") for n in experts)
    engine.bucket_bytes, kept = 1, engine.bucket_bytes
    try:
        report = engine.push_weights(weights)
    finally:
        engine.bucket_bytes = kept
    assert report.bytes_per_rank[0] == sum(t.numel() * 4 for t in weights.values())
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ours, theirs = engine.generate(PROMPTS, params), reference.generate(PROMPTS, params)
    for a, b in zip(ours.samples, theirs.samples):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    with pytest.raises(ValueError, match="sliced: push_rank_payloads"):
        engine.push_weights(weights, route="sliced")


@pytest.mark.claim("vllm-adapter")
def test_environment_checks_say_what_to_run(monkeypatch):
    from hfschema.model import ModelConfig

    assert "Qwen3MoeForCausalLM" in env.served_architectures() or env.version() is None
    narrow_heads = ModelConfig(family="qwen3_moe", head_dim=16)
    narrow_experts = ModelConfig(family="qwen3_moe", head_dim=64, moe_ffn_hidden_size=16)
    if env.version() is not None:
        assert 64 in env.cpu_head_sizes() and 16 not in env.cpu_head_sizes()
        with pytest.raises(ValueError, match=r"model.head_dim=16 with rollout.engine=vllm .* model.head_dim=64"):
            env.check_environment(narrow_heads, on_gpu=False)
        with pytest.raises(ValueError, match=r"model.moe_ffn_hidden_size=16 .* a multiple of 32"):
            env.check_environment(narrow_experts, on_gpu=False)
        env.check_environment(narrow_heads, on_gpu=True)  # GPU attention backends take it
        fits_one = ModelConfig(family="qwen3_moe", head_dim=64, moe_ffn_hidden_size=32)
        env.check_environment(fits_one, on_gpu=False)
        split = r"moe_ffn_hidden_size=32 .* split 2 ways \(rollout.tp=2\) is 16: .* a multiple of 64"
        with pytest.raises(ValueError, match=split):
            env.check_environment(fits_one, on_gpu=False, tp=2)
    monkeypatch.setenv("HYBRIDFLOW_VLLM_VENV", "/nonexistent/venv")
    with pytest.raises(ValueError, match=r"needs vLLM .* run bash scripts/install.sh --vllm"):
        env.check_environment(narrow_heads, on_gpu=False)


@pytest.mark.claim("vllm-adapter")
def test_a_killed_server_is_engine_lost_naming_its_log(engine):
    """Last in the module: it kills the shared engine."""
    os.killpg(engine._process.pid, signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(EngineLost, match=rf"vLLM engine process \d+ .*exited with code -9.*its log {engine.log_path}"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))


@pytest.mark.claim("vllm-adapter")
@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["rollout.ep=2", "rollout.tp=2"],
            "rollout.ep=2 needs rollout.engine=sglang: rollout.engine=vllm splits a replica by tp only",
        ),
        (
            ["rollout.tp=2", "rollout.gpus_per_node=1"],
            "rollout.tp=2 (over gpus_per_node=1: a replica across nodes) needs rollout.engine=sglang",
        ),
        (["rollout.enable_dp_attention=true"], "rollout.enable_dp_attention=true needs rollout.engine=sglang"),
        (["lora.enabled=true", "lora.push=adapter"], "lora.push=adapter with rollout.engine=vllm: that engine takes"),
    ],
)
def test_settings_only_sglang_has_are_refused_by_name_before_any_rank(overrides, says):
    from hybridflow.config import load_config
    from hybridflow.preflight import check_runtime_support

    with pytest.raises(ValueError, match=re.escape(says)):
        check_runtime_support(load_config("configs/quickstart_cpu_vllm.yaml", overrides))


@pytest.mark.claim("vllm-adapter")
def test_an_architecture_vllm_does_not_serve_is_named_before_any_rank(tmp_path):
    from hybridflow.config import load_config
    from hybridflow.preflight import check_engine_serves

    if env.version() is None:
        pytest.skip(f"vLLM is not installed ({env.INSTALL_COMMAND})")
    path = make_tiny_model_dir(tmp_path / "helium", "helium")  # transformers builds it, vLLM 0.32 lacks it
    engine = ["rollout.engine=vllm", "rollout.tp=1", f"model.path={path}"]
    cfg = load_config("configs/quickstart_cpu_day0.yaml", engine, model_path_must_exist=True)
    says = r"the installed vLLM has no model class for HeliumForCausalLM.*rollout\.engine=hf"
    with pytest.raises(ValueError, match=says):
        check_engine_serves(cfg)
