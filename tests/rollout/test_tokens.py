"""Token bookkeeping: prompt encoding, padding on both sides, masks, log-prob alignment, errors."""

import pytest
import torch

from hybridflow.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutSample
from hybridflow.rollout.tiny import SPECIAL_TOKENS, make_tiny_tokenizer
from hybridflow.rollout.tokens import decode_responses, encode_prompts, pack_batch

PAD = 1


def sample(prompt, response, *, finish=FINISH_STOP, prompt_index=0, sample_index=0, experts=None):
    logprobs = tuple(-0.5 - i for i in range(len(response)))
    return RolloutSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        logprobs=logprobs,
        finish_reason=finish,
        routed_experts=experts,
    )


SAMPLES = (
    sample([10, 11, 12], [20, 21], prompt_index=0),
    sample([13], [22, 23, 24, 25], finish=FINISH_LENGTH, prompt_index=1),
)


def test_right_padding():
    batch = pack_batch(SAMPLES, pad_id=PAD)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21], [13, 22, 23, 24, 25]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5]
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert batch["prompt_lengths"].tolist() == [3, 1]
    assert batch["response_lengths"].tolist() == [2, 4]
    assert batch["truncated"].tolist() == [False, True]
    assert batch["input_ids"].dtype == torch.long and batch["response_mask"].dtype == torch.float32


def test_right_padding_to_max_length():
    batch = pack_batch(SAMPLES, pad_id=PAD, max_length=7)
    assert batch["input_ids"].tolist()[0] == [10, 11, 12, 20, 21, PAD, PAD]
    assert batch["attention_mask"].tolist()[0] == [1, 1, 1, 1, 1, 0, 0]
    assert batch["response_mask"].tolist()[0] == [0, 0, 0, 1, 1, 0, 0]
    assert batch["position_ids"].tolist()[0] == [0, 1, 2, 3, 4, 0, 0]
    assert batch["logprobs"].tolist()[0] == [0, 0, 0, -0.5, -1.5, 0, 0]


def test_left_padding_positions_skip_the_pad():
    batch = pack_batch((SAMPLES[0], sample([13], [22])), pad_id=PAD, padding_side="left")
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21], [PAD, PAD, PAD, 13, 22]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [0, 0, 0, 1, 1]]
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]
    assert batch["logprobs"].tolist() == [[0, 0, 0, -0.5, -1.5], [0, 0, 0, 0, -0.5]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_logprob_t_scores_input_token_t(side):
    """Position t holds the log-prob of input_ids[t], where response_mask is 1 and nowhere else."""
    batch = pack_batch(SAMPLES, pad_id=PAD, max_length=8, padding_side=side)
    for row, s in enumerate(SAMPLES):
        where = batch["response_mask"][row].nonzero().squeeze(-1)
        assert batch["input_ids"][row, where].tolist() == list(s.response_ids)
        assert batch["logprobs"][row, where].tolist() == list(s.logprobs)
        assert (batch["logprobs"][row][batch["response_mask"][row] == 0] == 0).all()
        assert batch["attention_mask"][row].sum() == len(s.prompt_ids) + len(s.response_ids)


@pytest.mark.parametrize("side", ["right", "left"])
def test_routed_experts_align_with_fed_tokens(side):
    """Row t of a sample's routed experts lands at the position of its t-th token; -1 elsewhere."""
    experts = [torch.arange(8).reshape(4, 2, 1), torch.arange(8).reshape(4, 2, 1) + 100]
    samples = (sample([10, 11, 12], [20, 21], experts=experts[0]), sample([13, 14], [22, 23, 24], experts=experts[1]))
    batch = pack_batch(samples, pad_id=PAD, max_length=6, padding_side=side)
    routed = batch["routed_experts"]
    assert routed.shape == (2, 6, 2, 1)
    for row, used in enumerate((5, 5)):
        start = 6 - used if side == "left" else 0
        assert torch.equal(routed[row, start : start + 4], experts[row])
        assert (routed[row, :start] == -1).all() and (routed[row, start + 4 :] == -1).all()


def test_routed_experts_all_or_none():
    assert "routed_experts" not in pack_batch(SAMPLES, pad_id=PAD)
    mixed = (sample([1], [2], experts=torch.zeros(1, 2, 2)), sample([1], [2]))
    with pytest.raises(ValueError, match="sample 1 has no routed_experts but others do"):
        pack_batch(mixed, pad_id=PAD)


@pytest.mark.parametrize(
    ("samples", "kwargs", "message"),
    [
        ((), {}, "at least one sample"),
        (SAMPLES, {"padding_side": "middle"}, "padding_side='middle' is not one of: right, left"),
        (SAMPLES, {"max_length": 0}, "max_length=0 must be >= 1"),
        (
            (SAMPLES[0], sample([1] * 9, [2], prompt_index=4, sample_index=1)),
            {"max_length": 8},
            r"sample 1 \(prompt 4, sample 1\): its prompt has 9 tokens, more than max_length=8",
        ),
        (
            SAMPLES,
            {"max_length": 4},
            r"sample 0 \(prompt 0, sample 0\): prompt 3 \+ response 2 = 5 tokens, more than max_length=4",
        ),
        ((sample([], [2]),), {}, "sample 0 .* has an empty prompt"),
    ],
)
def test_pack_errors(samples, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_batch(samples, pad_id=PAD, **kwargs)


def test_logprob_count_must_match_response():
    bad = RolloutSample(
        prompt_index=0, sample_index=0, prompt_ids=(1,), response_ids=(2, 3), logprobs=(0.0,), finish_reason=FINISH_STOP
    )
    with pytest.raises(ValueError, match="1 log-probs for 2 response tokens"):
        pack_batch((bad,), pad_id=PAD)


# --------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def test_encode_raw_text_and_chat(tokenizer):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    raw, templated = encode_prompts(tokenizer, ["hello world", chat])
    assert raw == tokenizer("hello world")["input_ids"]
    assert tokenizer.decode(raw) == "hello world"
    text = tokenizer.decode(templated)
    assert text == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert templated[0] == tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["im_start"])
    no_prompt = encode_prompts(tokenizer, [chat], add_generation_prompt=False)[0]
    assert tokenizer.decode(no_prompt).endswith("<|im_end|>\n")


def test_encode_errors(tokenizer):
    with pytest.raises(ValueError, match="prompt 1 is a int; expected text"):
        encode_prompts(tokenizer, ["ok", 7])
    with pytest.raises(ValueError, match="prompt 0 encodes to no tokens"):
        encode_prompts(tokenizer, [""])
    plain = make_tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="prompt 0 is a chat .* no chat_template"):
        encode_prompts(plain, [[{"role": "user", "content": "hi"}]])


def test_decode_responses(tokenizer):
    ids = tokenizer("the answer is 42")["input_ids"]
    eos = tokenizer.eos_token_id
    texts = decode_responses(tokenizer, [sample([1], ids + [eos])])
    assert texts == ["the answer is 42"]
