"""The rollout interface: SamplingParams validation and the engine registry."""

import pytest

from hybridflow.rollout import base
from hybridflow.rollout.base import (
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    engine_names,
    make_engine,
    register_engine,
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "n=0 must be >= 1"),
        ("temperature", -0.1, "temperature=-0.1 must be >= 0"),
        ("top_p", 0.0, "top_p=0.0 must be in (0, 1]"),
        ("top_p", 1.5, "top_p=1.5 must be in (0, 1]"),
        ("top_k", 0, "top_k=0 must be -1 (all) or >= 1"),
        ("top_k", -2, "top_k=-2 must be -1 (all) or >= 1"),
        ("max_new_tokens", 0, "max_new_tokens=0 must be >= 1"),
    ],
)
def test_sampling_params_reject_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_sampling_params_accept_edges():
    params = SamplingParams(n=4, temperature=0.0, top_p=1.0, top_k=1, max_new_tokens=1, stop_token_ids=(3,))
    assert params.temperature == 0 and params.stop_token_ids == (3,)
    with pytest.raises(TypeError):
        SamplingParams(4)  # keyword-only


@pytest.mark.claim("engine-registry")
def test_unknown_engine_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown rollout engine 'trtllm'; registered engines: hf, sglang, vllm"):
        make_engine("trtllm")
    assert {"hf", "sglang", "vllm"} <= set(engine_names())


def test_register_engine_adds_a_name_once(monkeypatch):
    monkeypatch.setattr(base, "_ENGINES", dict(base._ENGINES))
    made = []

    @register_engine("fake")
    def start(**kwargs):
        made.append(kwargs)
        return kwargs

    assert make_engine("fake", x=1) == {"x": 1} and made == [{"x": 1}]
    assert "fake" in engine_names()
    with pytest.raises(ValueError, match="'fake' is already registered"):
        register_engine("fake")(start)


def test_batch_counts_response_tokens():
    def sample(i, response):
        return RolloutSample(
            prompt_index=i,
            sample_index=0,
            prompt_ids=(1,),
            response_ids=response,
            logprobs=(0.0,) * len(response),
            finish_reason="stop",
        )

    batch = RolloutBatch(samples=(sample(0, (4, 5)), sample(1, (6,))), seconds=0.0)
    assert batch.num_response_tokens == 3
