"""Per-token log-probabilities and entropy over vocab-parallel logits.

Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary,
``logits_BSv`` with ``v = V_padded / tp``. Nothing here gathers the full vocabulary: the
softmax normaliser, the target logit and the entropy are reduced across the TP group as
scalars per token. Vocabulary padding rows (ids >= the real vocab size) are masked out, so the
numbers equal those of the unpadded Hugging Face model.

Legend: B batch, S sequence, v local vocab slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["token_logprobs", "token_scores"]


def token_scores(
    logits_BSv: torch.Tensor, labels_BS: torch.Tensor, *, vocab_size: int, tp_group, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) and, ``with_entropy``, the entropy of the full-vocabulary softmax at each
    position (else None): both differentiable, in fp32, from one softmax (``_Scores``)."""
    logp_BS, entropy_BS = _Scores.apply(logits_BSv, labels_BS, vocab_size, tp_group, with_entropy)
    return logp_BS, (entropy_BS if with_entropy else None)


def token_logprobs(logits_BSv: torch.Tensor, labels_BS: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """log p(labels) under the full-vocabulary softmax, differentiable, in fp32."""
    return token_scores(logits_BSv, labels_BS, vocab_size=vocab_size, tp_group=tp_group, with_entropy=False)[0]


class _Scores(torch.autograd.Function):
    """Log-prob of the label and entropy from one softmax of the vocab-parallel logits z.

    Forward, per position: m = max z, S = sum exp(z - m), log p = z_label - m - log S,
    H = log S - E_p[z - m] (m, S, z_label and sum exp(z - m)(z - m) all-reduced over the TP group,
    three reductions in all). It keeps p and, for the entropy, z - m: two [B, S, v] tensors, where
    separate autograd graphs for the log-prob (megatron's cross entropy) and the entropy made
    about five [B, S, v] passes more and kept as many tensors (``benchmarks/train_step.py``).
    Backward, with g and h the incoming gradients of log p and H (every TP rank's loss is the same
    replica, so nothing is reduced): dz = onehot(label) g + p (h E_p[z - m] - g - h (z - m)).
    Vocabulary padding columns (ids >= vocab_size, at the end of the last rank's slice) are left
    out of the computation, so every z is finite, and take a zero gradient.
    """

    @staticmethod
    def forward(ctx, logits_BSv, labels_BS, vocab_size, tp_group, with_entropy):
        local, start = logits_BSv.shape[-1], _vocab_start(logits_BSv, tp_group)
        valid = max(0, min(local, vocab_size - start))
        shifted_BSv = logits_BSv[..., :valid].float()
        if shifted_BSv.data_ptr() == logits_BSv.data_ptr():
            shifted_BSv = shifted_BSv.clone()  # worked on in place below: never the caller's tensor
        max_BS = (
            shifted_BSv.max(dim=-1).values if valid else torch.full_like(labels_BS, -torch.inf, dtype=torch.float32)
        )
        _all_reduce(max_BS, dist.ReduceOp.MAX, tp_group)
        shifted_BSv.sub_(max_BS.unsqueeze(-1))
        probs_BSv = shifted_BSv.exp()
        target_BS = labels_BS - start
        outside_BS = (target_BS < 0) | (target_BS >= valid)  # another rank's slice
        target_BS = target_BS.masked_fill(outside_BS, 0)
        picked_BS = shifted_BSv.gather(-1, target_BS.unsqueeze(-1)).squeeze(-1) if valid else torch.zeros_like(max_BS)
        sums = [probs_BSv.sum(dim=-1), picked_BS.masked_fill(outside_BS, 0.0)]
        if with_entropy:
            sums.append((probs_BSv * shifted_BSv).sum(dim=-1))
        sums_KBS = torch.stack(sums)
        _all_reduce(sums_KBS, dist.ReduceOp.SUM, tp_group)
        log_sum_BS = sums_KBS[0].log()
        probs_BSv.div_(sums_KBS[0].unsqueeze(-1))
        ctx.with_entropy, ctx.dtype, ctx.padding = with_entropy, logits_BSv.dtype, local - valid
        if not with_entropy:
            ctx.save_for_backward(probs_BSv, target_BS, outside_BS)
            return sums_KBS[1] - log_sum_BS, torch.zeros_like(log_sum_BS)
        expected_BS = sums_KBS[2] / sums_KBS[0]
        ctx.save_for_backward(probs_BSv, target_BS, outside_BS, shifted_BSv, expected_BS)
        return sums_KBS[1] - log_sum_BS, log_sum_BS - expected_BS

    @staticmethod
    def backward(ctx, grad_logp_BS, grad_entropy_BS):
        # the saved tensors are reused in place: one backward per forward, as the trainer runs it
        probs_BSv, target_BS, outside_BS, *entropy_terms = ctx.saved_tensors
        if ctx.with_entropy:
            shifted_BSv, expected_BS = entropy_terms
            offset_BS = grad_entropy_BS * expected_BS - grad_logp_BS
            factor_BSv = shifted_BSv.mul_(-grad_entropy_BS.unsqueeze(-1)).add_(offset_BS.unsqueeze(-1))
            grad_BSv = probs_BSv.mul_(factor_BSv)
        else:
            grad_BSv = probs_BSv.mul_(-grad_logp_BS.unsqueeze(-1))
        if grad_BSv.shape[-1]:
            own_BS = grad_logp_BS.masked_fill(outside_BS, 0.0)
            grad_BSv.scatter_add_(-1, target_BS.unsqueeze(-1), own_BS.unsqueeze(-1))
        if ctx.padding:
            grad_BSv = torch.nn.functional.pad(grad_BSv, (0, ctx.padding))
        return grad_BSv.to(ctx.dtype), None, None, None, None


def _vocab_start(logits_BSv: torch.Tensor, tp_group) -> int:
    return dist.get_rank(tp_group) * logits_BSv.shape[-1] if _tp_size(tp_group) > 1 else 0


def _tp_size(tp_group) -> int:
    return dist.get_world_size(tp_group) if tp_group is not None else 1


def _all_reduce(tensor: torch.Tensor, op, tp_group) -> None:
    if _tp_size(tp_group) > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)
