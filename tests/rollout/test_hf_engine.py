"""The transformers engine against transformers itself, on tiny Qwen2 and Qwen3-MoE made here.

Greedy output equals ``model.generate``; returned log-probs equal a teacher-forced forward over
the packed batch (within 1e-5, fp32); sampling is seeded; stop tokens and length caps end
responses; pushed weights change what it generates, and bad pushes leave it as it was.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfschema.model import ModelConfig
from hybridflow.rollout import RolloutEngine, SamplingParams, make_engine
from hybridflow.rollout.base import FINISH_LENGTH, FINISH_STOP
from hybridflow.rollout.hf_engine import HFEngine, sample_next
from hybridflow.rollout.tiny import make_tiny_model_dir, to_hybridflow_model_config
from hybridflow.rollout.tokens import pack_batch

FAMILIES = ("qwen2", "qwen3_moe")
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 7, 250, 3, 90])  # unequal: left padding inside
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and beside other work on a small machine
    spinning OpenMP threads made these tests 5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """A shared engine; tests that push weights start their own."""
    return make_engine("hf", model_path=str(tiny_dir))


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    response = out[0, len(prompt) :].tolist()
    eos = set(model.generation_config.eos_token_id)
    ends = [i for i, t in enumerate(response) if t in eos]
    return response[: ends[0] + 1] if ends else response


def responses(batch):
    return [s.response_ids for s in batch.samples]


# --------------------------------------------------------------------------- tiny model dirs


def test_tiny_dir_has_the_hub_layout(tiny_dir, tmp_path):
    names = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert names <= {p.name for p in tiny_dir.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert "chat_template" in json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(tokenizer) <= json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    again = make_tiny_model_dir(tmp_path, json.loads((tiny_dir / "config.json").read_text())["model_type"], seed=1)
    assert (again / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_dir_maps_to_model_config(tiny_dir):
    config = to_hybridflow_model_config(tiny_dir)
    common = dict(
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_hidden_size=128,
        vocab_size=320,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if config.family == "qwen2":
        assert config == ModelConfig(family="qwen2", num_experts=0, attention_bias=True, **common)
    else:
        assert config == ModelConfig(
            family="qwen3_moe",
            num_experts=4,
            moe_top_k=2,
            moe_ffn_hidden_size=32,
            qk_layernorm=True,
            norm_topk_prob=True,
            **common,
        )


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_other_families(family, tmp_path):
    path = make_tiny_model_dir(tmp_path, family)
    config = to_hybridflow_model_config(path)
    assert (config.family, config.is_moe, config.num_layers) == (family, family == "mixtral", 2)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine("hf", model_path=str(path), return_routed_experts=config.is_moe)
    for sample in engine.generate(PROMPTS, GREEDY).samples:
        assert list(sample.response_ids) == hf_greedy(reference, list(sample.prompt_ids), GREEDY.max_new_tokens)


def test_unknown_family(tmp_path):
    """Any model_type transformers ships is made tiny (an unmapped architecture for FSDP2's day-0
    runs); a name it does not ship is refused before anything is written."""
    with pytest.raises(ValueError, match="model family 'gpt9' is neither one of llama, qwen2, .* nor a transformers"):
        make_tiny_model_dir(tmp_path / "gpt9", "gpt9")
    assert not (tmp_path / "gpt9").exists()


# --------------------------------------------------------------------------- generation


@pytest.mark.claim("engine-registry")
def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)


def test_greedy_equals_transformers_generate(engine, reference):
    batch = engine.generate(PROMPTS, GREEDY)
    assert [s.prompt_ids for s in batch.samples] == [tuple(p) for p in PROMPTS]
    for sample in batch.samples:
        assert list(sample.response_ids) == hf_greedy(reference, list(sample.prompt_ids), GREEDY.max_new_tokens)
        eos = set(reference.generation_config.eos_token_id)
        assert sample.finish_reason == (FINISH_STOP if sample.response_ids[-1] in eos else FINISH_LENGTH)


@pytest.mark.parametrize("side", ["right", "left"])
def test_logprobs_equal_a_teacher_forced_forward(engine, reference, side):
    params = SamplingParams(temperature=0.8, top_p=0.95, n=2, max_new_tokens=8, seed=3)
    batch = engine.generate(PROMPTS, params)
    packed = pack_batch(batch.samples, pad_id=0, padding_side=side)
    with torch.no_grad():
        logits = reference(
            input_ids=packed["input_ids"], attention_mask=packed["attention_mask"], position_ids=packed["position_ids"]
        ).logits
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, packed["input_ids"][:, 1:, None])[..., 0]
    scored = torch.cat([torch.zeros(len(logp), 1), logp], dim=1)  # position t scores token t
    mask = packed["response_mask"].bool()
    assert mask.sum() == batch.num_response_tokens
    assert (scored[mask] - packed["logprobs"][mask]).abs().max() < TOL


def test_seeded_sampling_is_reproducible_and_n_samples_per_prompt(engine):
    params = SamplingParams(temperature=1.0, top_k=50, n=3, max_new_tokens=6, seed=11)
    first, second = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert responses(first) == responses(second)
    assert [(s.prompt_index, s.sample_index) for s in first.samples] == [(p, i) for p in range(3) for i in range(3)]
    other = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=50, n=3, max_new_tokens=6, seed=12))
    assert responses(other) != responses(first)
    assert len(set(responses(first)[:3])) > 1  # the n samples of one prompt differ


def test_stop_token_ends_the_response(engine):
    greedy = engine.generate(PROMPTS[:1], GREEDY).samples[0].response_ids
    at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(greedy[at],))
    sample = engine.generate(PROMPTS[:1], params).samples[0]
    assert sample.response_ids == greedy[: at + 1] and sample.finish_reason == FINISH_STOP
    assert len(sample.logprobs) == at + 1
    assert engine.eos_token_ids == {3, 5}  # <|eos|> and <|im_end|>, from generation_config.json


def test_an_engine_started_without_weights_stops_where_the_directory_says(tiny_dir):
    """A run's engine starts from a directory without weights (load_format="dummy"): its stop ids
    are still generation_config.json's, not config.json's single eos (vLLM and SGLang read the same)."""
    assert make_engine("hf", model_path=str(tiny_dir), load_format="dummy").eos_token_ids == {3, 5}


def test_length_caps(engine, tiny_dir):
    sample = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=3)).samples[0]
    assert len(sample.response_ids) == 3 and sample.finish_reason == FINISH_LENGTH
    short = make_engine("hf", model_path=str(tiny_dir), max_context=len(PROMPTS[0]) + 2)
    capped = short.generate(PROMPTS[:1], GREEDY).samples[0]
    assert capped.response_ids == sample.response_ids[:2] and capped.finish_reason == FINISH_LENGTH


def test_bad_prompts(engine):
    long_prompt = [7] * 256
    with pytest.raises(ValueError, match=r"prompt 1 has 256 tokens; the context holds 256 \(max_context\)"):
        engine.generate([[1, 2], long_prompt], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 320 outside the vocabulary \[0, 320\)"):
        engine.generate([[1, 320]], GREEDY)


def test_pause_resume_release_shutdown(tiny_dir):
    engine = make_engine("hf", model_path=str(tiny_dir))
    engine.pause()
    with pytest.raises(RuntimeError, match="paused"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume()
    engine.flush_cache()
    engine.release_memory()
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory()
    assert len(engine.generate(PROMPTS, GREEDY).samples) == 3
    engine.shutdown()
    assert engine.model is None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS, GREEDY)


def test_start_errors(tiny_dir):
    with pytest.raises(ValueError, match="dtype='int8' is not one of"):
        make_engine("hf", model_path=str(tiny_dir), dtype="int8")
    with pytest.raises(ValueError, match="max_context=300 must be in 2..256"):
        make_engine("hf", model_path=str(tiny_dir), max_context=300)


# --------------------------------------------------------------------------- routed experts


def test_routed_experts_match_the_router(tiny_dir, reference, engine):
    if reference.config.model_type != "qwen3_moe":
        with pytest.raises(ValueError, match="return_routed_experts=True needs an MoE model"):
            make_engine("hf", model_path=str(tiny_dir), return_routed_experts=True)
        return
    routed = make_engine("hf", model_path=str(tiny_dir), return_routed_experts=True)
    batch = routed.generate(PROMPTS, GREEDY)
    assert responses(batch) == responses(engine.generate(PROMPTS, GREEDY))
    for sample in batch.samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            router_logits = reference(ids, output_router_logits=True).router_logits
        expected = torch.stack([torch.topk(layer, 2, dim=-1).indices for layer in router_logits], dim=1)[:-1]
        assert sample.routed_experts.shape == (ids.shape[1] - 1, 2, 2)
        assert torch.equal(sample.routed_experts.long(), expected)


# --------------------------------------------------------------------------- sampling


def test_sample_next_filters_and_scores_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 2.9, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)
    greedy, greedy_logp = sample_next(logits, SamplingParams(temperature=0.0))
    assert greedy.tolist() == [0, 1] and torch.allclose(greedy_logp, raw[[0, 1], [0, 1]])
    generator = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=2.0, top_p=1e-3)):
        tokens, logp = sample_next(logits.repeat(50, 1), params, generator)
        assert tokens.tolist() == [0, 1] * 50
        assert torch.allclose(logp, raw.repeat(50, 1)[torch.arange(100), tokens])  # unscaled by temperature
    tokens, _ = sample_next(logits.repeat(200, 1), SamplingParams(top_k=2), generator)
    assert set(tokens[0::2].tolist()) == {0, 1} and set(tokens[1::2].tolist()) == {1, 2}


# --------------------------------------------------------------------------- weight pushes


def perturbed(state, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


def model_with(tiny_dir, tmp_path, checkpoint):
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    shutil.copy(tiny_dir / "generation_config.json", tmp_path / "generation_config.json")
    save_file(checkpoint, str(tmp_path / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


def test_push_checkpoint_names_changes_generation(tiny_dir, tmp_path, engine):
    before = responses(engine.generate(PROMPTS, GREEDY))
    pushed = perturbed(load_file(str(tiny_dir / "model.safetensors")))  # per-expert names for MoE
    fresh = make_engine("hf", model_path=str(tiny_dir))
    report = fresh.push_weights(pushed)
    assert report.route == "full" and report.bytes_per_rank == (sum(t.nbytes for t in pushed.values()),)
    after = fresh.generate(PROMPTS, GREEDY)
    assert responses(after) != before
    reference = model_with(tiny_dir, tmp_path, pushed)
    for sample in after.samples:
        assert list(sample.response_ids) == hf_greedy(reference, list(sample.prompt_ids), GREEDY.max_new_tokens)


def test_push_in_memory_names_and_a_subset(tiny_dir, engine):
    fresh = make_engine("hf", model_path=str(tiny_dir))
    state = perturbed(fresh.model.state_dict(), seed=1)  # fused expert names for MoE
    fresh.push_weights(state, route="sliced")
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in state.items())
    head = {"lm_head.weight": torch.zeros_like(state["lm_head.weight"])}
    fresh.push_weights(head)
    assert torch.equal(fresh.model.lm_head.weight, head["lm_head.weight"])
    assert torch.equal(fresh.model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("names", ["checkpoint", "in_memory"])
def test_bad_push_keeps_the_old_weights(tiny_dir, engine, names):
    fresh = make_engine("hf", model_path=str(tiny_dir))
    before = responses(fresh.generate(PROMPTS, GREEDY))
    state = load_file(str(tiny_dir / "model.safetensors")) if names == "checkpoint" else fresh.model.state_dict()
    good = perturbed(state)
    last = list(good)[-1]
    wrong_shape = {**good, last: torch.zeros(3, 3)}
    message = rf"pushed weight '{last}' has shape \(3, 3\); the model's is .*keeps its previous weights"
    with pytest.raises(ValueError, match=message):
        fresh.push_weights(wrong_shape)
    with pytest.raises(ValueError, match=r"pushed weight 'model.layers.9.mlp.weight' is not a parameter"):
        fresh.push_weights({**good, "model.layers.9.mlp.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="push route 'nccl' is not one of: full, sliced"):
        fresh.push_weights(good, route="nccl")
    assert responses(fresh.generate(PROMPTS, GREEDY)) == before


def test_dummy_start_refuses_to_generate_until_a_full_push(tiny_dir, engine):
    # the weighted directory serves: a dummy start reads its config only
    fresh = make_engine("hf", model_path=str(tiny_dir), load_format="dummy")
    with pytest.raises(RuntimeError, match="holds no weights yet .*push every tensor"):
        fresh.generate(PROMPTS, GREEDY)
    fresh.push_weights(load_file(str(tiny_dir / "model.safetensors")))
    assert responses(fresh.generate(PROMPTS, GREEDY)) == responses(engine.generate(PROMPTS, GREEDY))
    with pytest.raises(ValueError, match="load_format='safetensors' is not one of: auto, dummy"):
        make_engine("hf", model_path=str(tiny_dir), load_format="safetensors")
