"""Ulysses sequence parallel for transformers' own models (DeepSpeed-Ulysses, Jacobs et al., 2023),
through transformers' attention-function registry: no model's code is patched.

```
each rank of a sequence-parallel group of size sp holds s = T'/sp tokens of every row (T' = T padded
to a multiple of sp) and runs the decoder on them; only attention needs the whole sequence:

  q [B, H, s, D], k v [B, Hkv, s, D]  ──all-to-all──►  [B, H/sp, T', D], [B, Hkv/sp, T', D]
        (heads scattered over the group, the sequence gathered)
  the model's own attention function (sdpa, flash ...) on its H/sp heads, causal over T'
  out [B, T', H/sp, D]  ──all-to-all──►  [B, s, H, D]
```

Each rank's positions are its own slice of ``0..T'-1`` (the rotary embedding reads them), so every
layer but attention is the one-rank computation on a part of the sequence. Rows are right-padded
and attention is causal, so the padding appended changes no real token. The scores of the slices
are gathered along the sequence (``gather_sequence``: its backward keeps each rank's own slice of
the gradient, so that the loss every rank of the group computes on the whole row counts once).
The heads must split evenly: sp divides the query and the key/value heads (``check_heads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["IMPLEMENTATION", "check_heads", "enable", "gather_sequence", "shard_sequence"]

IMPLEMENTATION = "ulysses"
"""The name under which the attention function is registered with transformers."""


def check_heads(heads: int, kv_heads: int, sp: int, *, key: str = "sequence parallel size") -> None:
    """ValueError unless ``sp`` divides the query and the key/value heads."""
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % sp:
            raise ValueError(f"{key}={sp} does not divide the model's {count} {name}: Ulysses splits them evenly")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of equal parts along dim 0; the backward is the same exchange back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # and the output too: empty_like would copy a transposed input's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x_BHsD: torch.Tensor, group) -> torch.Tensor:
    """[B, H, s, D] (this rank's tokens, every head) -> [B, H/sp, T', D] (its heads, every token)."""
    sp = group.size()
    b, h, s, d = x_BHsD.shape
    parts = x_BHsD.reshape(b, sp, h // sp, s, d).transpose(0, 1)  # part j: the heads rank j keeps
    got = _AllToAll.apply(parts, group)  # got[j]: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(x_BTHD: torch.Tensor, group) -> torch.Tensor:
    """[B, T', H/sp, D] (its heads, every token) -> [B, s, H, D] (its tokens, every head)."""
    sp = group.size()
    b, t, h, d = x_BTHD.shape
    parts = x_BTHD.reshape(b, sp, t // sp, h, d).transpose(0, 1)  # part j: rank j's tokens
    got = _AllToAll.apply(parts, group)  # got[j]: my tokens of rank j's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * h, d)


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered function: the all-to-alls around the model's own attention function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group = module.ulysses_group
    q, k, v = (_seq_to_heads(t, group) for t in (query, key, value))
    for name in ("is_causal", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):  # this rank's slice's, not the whole's
        kwargs.pop(name, None)
    inner = ALL_ATTENTION_FUNCTIONS[module.ulysses_inner]
    out, _ = inner(module, q, k, v, None, is_causal=True, **kwargs)  # the whole sequence: causal, no mask
    return _heads_to_seq(out, group), None


def enable(model: nn.Module, config, group) -> None:
    """Route the attention of ``model`` (of transformers ``config``) through Ulysses over
    ``group``: every decoder layer's ``self_attn`` learns the group and the implementation it wraps."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    inner = config._attn_implementation
    if inner == IMPLEMENTATION:
        raise ValueError("Ulysses is already enabled on this model")
    attention = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not attention:
        raise ValueError(f"{type(model).__name__} has no self_attn modules for Ulysses to wrap")
    for module in attention:
        module.ulysses_group, module.ulysses_inner = group, inner
    config._attn_implementation = IMPLEMENTATION


def shard_sequence(ids_BT: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's slice of every row, its positions, and the tokens its positions score (the
    next ones): ``(ids [B, s], positions [B, s], labels [B, s])``, the rows right-padded with 0 to
    ``sp * s`` tokens (and one more for the last label)."""
    sp, rank = group.size(), group.rank()
    rows, length = ids_BT.shape
    s = -(-length // sp)
    padded = torch.nn.functional.pad(ids_BT, (0, sp * s + 1 - length))
    start = rank * s
    positions = torch.arange(start, start + s, device=ids_BT.device).expand(rows, s)
    return padded[:, start : start + s], positions, padded[:, start + 1 : start + s + 1]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_Bs: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local_Bs) for _ in range(group.size())]
        dist.all_gather(parts, local_Bs.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad_BT: torch.Tensor):
        s = grad_BT.shape[1] // ctx.group.size()
        rank = ctx.group.rank()
        return grad_BT[:, rank * s : (rank + 1) * s].contiguous(), None


def gather_sequence(local_Bs: torch.Tensor, group) -> torch.Tensor:
    """Every rank's slices joined along the sequence, ``[B, sp * s]``; the gradient each rank
    keeps is its own slice's (every rank of the group computes the same loss of the whole)."""
    return _GatherSequence.apply(local_Bs, group)
