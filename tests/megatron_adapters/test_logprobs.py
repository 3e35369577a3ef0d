"""``megatron_adapters.logprobs.token_scores``: the label's log-prob and the entropy from one
softmax, against plain torch on the unpadded vocabulary (values, and gradients for losses that
weigh both), in one process; the TP=2 split against the same reference is checked in
``tests/megatron_adapters/test_equivalence.py`` (its two-rank pool runs ``worker.fused_scores``)."""

from __future__ import annotations

import pytest
import torch

from megatron_adapters.logprobs import token_logprobs, token_scores

VOCAB, PADDED = 250, 256


def reference(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and entropy over the real vocabulary, by autograd of the textbook formulas."""
    logp_BSV = torch.log_softmax(logits_BSV[..., :VOCAB].float(), dim=-1)
    return logp_BSV.gather(-1, labels_BS.unsqueeze(-1)).squeeze(-1), -(logp_BSV.exp() * logp_BSV).sum(-1)


def case(seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, PADDED, generator=g) * 4).to(dtype)
    logits[0, 0, :VOCAB] = -1e4  # a position whose softmax underflows in places
    logits[0, 0, 3] = 0.0
    labels = torch.randint(0, VOCAB, (3, 7), generator=g)
    return logits, labels, torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)


@pytest.mark.parametrize("seed", [0, 1])
def test_log_probs_entropy_and_their_gradients_equal_plain_torch(seed: int) -> None:
    logits, labels, weight_logp, weight_entropy = case(seed)
    ours = logits.clone().requires_grad_(True)
    logp, entropy = token_scores(ours, labels, vocab_size=VOCAB, tp_group=None, with_entropy=True)
    (logp * weight_logp + entropy * weight_entropy).sum().backward()
    theirs = logits.clone().requires_grad_(True)
    ref_logp, ref_entropy = reference(theirs, labels)
    (ref_logp * weight_logp + ref_entropy * weight_entropy).sum().backward()
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-5)
    assert torch.all(ours.grad[..., VOCAB:] == 0)  # the padding columns take no gradient
    assert torch.equal(logits, ours.detach())  # the caller's logits are left as they were


def test_without_entropy_only_the_log_prob_is_computed_and_its_gradient_is_the_same() -> None:
    logits, labels, weight, _ = case(2)
    ours = logits.clone().requires_grad_(True)
    logp, entropy = token_scores(ours, labels, vocab_size=VOCAB, tp_group=None, with_entropy=False)
    assert entropy is None
    (logp * weight).sum().backward()
    theirs = logits.clone().requires_grad_(True)
    (reference(theirs, labels)[0] * weight).sum().backward()
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-5)
    assert torch.equal(token_logprobs(logits, labels, vocab_size=VOCAB, tp_group=None), logp.detach())


def test_bf16_logits_are_scored_in_fp32_and_get_a_bf16_gradient() -> None:
    logits, labels, weight, _ = case(3, torch.bfloat16)
    ours = logits.clone().requires_grad_(True)
    logp, entropy = token_scores(ours, labels, vocab_size=VOCAB, tp_group=None, with_entropy=True)
    assert logp.dtype == entropy.dtype == torch.float32
    (logp * weight).sum().backward()
    assert ours.grad.dtype == torch.bfloat16
    ref_logp, ref_entropy = reference(logits, labels)
    assert torch.allclose(logp, ref_logp, atol=1e-4) and torch.allclose(entropy, ref_entropy, atol=1e-4)
