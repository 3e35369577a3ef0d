"""Token bookkeeping between the tokenizer, the rollout engines and the trainer.

```
prompts: raw text, or chat messages ([{"role": ..., "content": ...}, ...])
   │ encode_prompts (the tokenizer's chat template for messages)
   ▼
token ids per prompt ──► engine.generate ──► RolloutSample: prompt ids, response ids, log-probs,
   │                                                       finish reason, routed experts
   │ pack_batch (right or left padding)
   ▼
[B, T]  input_ids, attention_mask, response_mask (a trajectory's loss mask: 0 on observations),
        position_ids, logprobs
[B]     prompt_lengths, response_lengths, truncated
[B, T, L, k] routed_experts (when every sample has them; -1 where nothing was routed)
[B, T]  token_versions (partial rollouts, when every sample has segments: the policy version
        that sampled each response token; -1 elsewhere)
```

Alignment follows ``megatron_adapters``: position ``t`` of a ``[B, T]`` tensor scores token
``input_ids[:, t]`` given the tokens before it. So ``logprobs[b, t]`` is the engine's
log p(token t) on response tokens and 0 elsewhere, and ``response_mask`` marks the same places.
``routed_experts[b, t]`` holds the experts token ``t`` was routed to when it was fed to the
model (every prompt token and every response token but the last).

Legend: B samples, T padded length, L MoE layers, k experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import FINISH_LENGTH, RolloutSample

__all__ = ["PADDING_SIDES", "decode_responses", "encode_prompts", "pack_batch"]

PADDING_SIDES = ("right", "left")
"""Where ``pack_batch`` puts padding."""

Prompt = str | Sequence[Mapping[str, str]]


# --------------------------------------------------------------------------- prompts


def _is_chat(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(message, Mapping) for message in prompt)
    )


def _encode_chat(
    tokenizer, index: int, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool, tools
) -> list[int]:
    if not tokenizer.chat_template:
        raise ValueError(
            f"prompt {index} is a chat (a list of messages) but the tokenizer has no "
            f"chat_template; pass raw text or use a tokenizer with a chat template"
        )
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, tools=tools
    )
    return list(ids)


def encode_prompts(
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = True,
    tools: Sequence[Mapping] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt: raw text through ``tokenizer(...)``, chat messages through the
    tokenizer's chat template (ending in the assistant's turn when ``add_generation_prompt``;
    ``tools``: the function schemas the template shows the model, multi-turn rollouts).

    ``add_special_tokens`` applies to raw text (a BOS where the tokenizer adds one); a chat
    template writes its own special tokens.
    """
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        elif _is_chat(prompt):
            ids = _encode_chat(tokenizer, index, prompt, add_generation_prompt, tools)
        else:
            raise ValueError(
                f"prompt {index} is a {type(prompt).__name__}; expected text (str) or chat "
                f"messages (a list of {{'role': ..., 'content': ...}} mappings)"
            )
        if not ids:
            raise ValueError(f"prompt {index} encodes to no tokens; the engines need at least one")
        encoded.append(list(ids))
    return encoded


def decode_responses(tokenizer, samples: Sequence[RolloutSample], *, skip_special_tokens: bool = True) -> list[str]:
    """The text of each sample's response."""
    return [tokenizer.decode(list(s.response_ids), skip_special_tokens=skip_special_tokens) for s in samples]


# --------------------------------------------------------------------------- packing


def _check_sample(index: int, sample: RolloutSample, max_length: int | None) -> None:
    prompt, response = len(sample.prompt_ids), len(sample.response_ids)
    where = f"sample {index} (prompt {sample.prompt_index}, sample {sample.sample_index})"
    if prompt == 0:
        raise ValueError(f"{where} has an empty prompt; a response token needs a prompt token before it")
    if len(sample.logprobs) != response:
        raise ValueError(f"{where} has {len(sample.logprobs)} log-probs for {response} response tokens")
    if max_length is not None and prompt > max_length:
        raise ValueError(f"{where}: its prompt has {prompt} tokens, more than max_length={max_length}")
    if max_length is not None and prompt + response > max_length:
        raise ValueError(
            f"{where}: prompt {prompt} + response {response} = {prompt + response} tokens, more "
            f"than max_length={max_length}; raise max_length or lower the engine's max_new_tokens"
        )


def _check_pack_args(samples: Sequence[RolloutSample], max_length: int | None, padding_side: str) -> None:
    if not samples:
        raise ValueError("pack_batch needs at least one sample")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side={padding_side!r} is not one of: {', '.join(PADDING_SIDES)}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length} must be >= 1 (or None: the longest sample)")
    for index, sample in enumerate(samples):
        _check_sample(index, sample, max_length)


def _pack_row(sample: RolloutSample, length: int, pad_id: int, left: bool) -> dict[str, torch.Tensor]:
    """One sample's ``[T]`` tensors; padding first when ``left``."""
    ids = list(sample.prompt_ids) + list(sample.response_ids)
    prompt, used = len(sample.prompt_ids), len(ids)
    start = length - used if left else 0
    real, response = slice(start, start + used), slice(start + prompt, start + used)
    row = {
        "input_ids": torch.full((length,), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(length, dtype=torch.long),
        "response_mask": torch.zeros(length, dtype=torch.float32),
        "position_ids": torch.zeros(length, dtype=torch.long),
        "logprobs": torch.zeros(length, dtype=torch.float32),
    }
    row["input_ids"][real] = torch.tensor(ids, dtype=torch.long)
    row["attention_mask"][real] = 1
    # a multi-turn trajectory trains on the policy's own tokens only, not its observations
    row["response_mask"][response] = torch.tensor(sample.loss_mask, dtype=torch.float32) if sample.loss_mask else 1.0
    row["position_ids"][real] = torch.arange(used)
    row["logprobs"][response] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return row


def _pack_experts(samples: Sequence[RolloutSample], length: int, left: bool) -> torch.Tensor | None:
    """``[B, T, L, k]`` routed experts, -1 where none; None unless every sample has them."""
    have = [s.routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"sample {have.index(False)} has no routed_experts but others do; pack samples from one engine call"
        )
    experts = [torch.as_tensor(s.routed_experts, dtype=torch.long) for s in samples]
    layers_k = experts[0].shape[1:]
    packed = torch.full((len(samples), length, *layers_k), -1, dtype=torch.long)
    for index, (sample, routed) in enumerate(zip(samples, experts)):
        used = len(sample.prompt_ids) + len(sample.response_ids)
        if routed.shape[1:] != layers_k or len(routed) > used:
            raise ValueError(
                f"sample {index}: routed_experts of shape {tuple(routed.shape)} do not fit "
                f"{used} tokens x {tuple(layers_k)} (layers, top-k) like sample 0"
            )
        start = length - used if left else 0
        packed[index, start : start + len(routed)] = routed
    return packed


def pack_batch(
    samples: Sequence[RolloutSample],
    *,
    pad_id: int,
    max_length: int | None = None,
    padding_side: str = "right",
) -> dict[str, torch.Tensor]:
    """Pad prompt + response of each sample into trainer tensors (see the module docstring).

    ``T`` is ``max_length`` when given (a sample that does not fit is a ValueError naming it),
    else the longest sample. Left padding keeps ``position_ids`` counting from 0 at each
    sample's first real token; padding positions hold ``pad_id``, 0 in masks, positions and
    log-probs. ``truncated`` is True where the response hit its length cap.
    """
    _check_pack_args(samples, max_length, padding_side)
    length = max_length or max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    left = padding_side == "left"
    rows = [_pack_row(s, length, pad_id, left) for s in samples]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["prompt_lengths"] = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    batch["response_lengths"] = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    batch["truncated"] = torch.tensor([s.finish_reason == FINISH_LENGTH for s in samples])
    experts = _pack_experts(samples, length, left)
    if experts is not None:
        batch["routed_experts"] = experts
    versions = _pack_versions(samples, length, left)
    if versions is not None:
        batch["token_versions"] = versions
    return batch


def _pack_versions(samples: Sequence[RolloutSample], length: int, left: bool) -> torch.Tensor | None:
    """``[B, T]`` policy version of each response token, -1 elsewhere; None unless every sample
    has ``segments``."""
    have = [bool(s.segments) for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"sample {have.index(False)} has no segments but others do; pack samples of one batch")
    out = torch.full((len(samples), length), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        used = len(s.prompt_ids) + len(s.response_ids)
        first = (length - used if left else 0) + len(s.prompt_ids)
        ends = [begin for begin, _ in s.segments[1:]] + [len(s.response_ids)]
        for (begin, version), end in zip(s.segments, ends):
            out[row, first + begin : first + end] = version
    return out
