"""Padding masks <-> the varlen layout, with the helpers and signatures of ``flash_attn.bert_padding``.

A padded batch ``(batch, seqlen, ...)`` with a mask of real tokens becomes the packed ``(total, ...)``
tensor that the varlen functions take, plus ``cu_seqlens`` and ``max_seqlen``; ``pad_input`` puts the
results back.  Both directions are differentiable.  The row gather and scatter are custom autograd
functions: each one's backward is the other (an index copy), rather than advanced indexing, whose backward
is an accumulating ``index_put`` (slower, and non-deterministic on CUDA) that unique indices never need.

``unpad_input`` returns Python ints (max_seqlen_in_batch) and a packed tensor sized by the mask's count, so it
reads the mask on the host: a device synchronisation, as in flash_attn. ``unpad_indices_static`` packs without
one, into a tensor of static size (every token, the padding ones last).
"""

from __future__ import annotations

import torch

from flashattn.errors import FlashAttnError

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_indices_static", "unpad_input"]


def _gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, indices)


def _scatter_rows(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_copy_(0, indices, values)


class _IndexFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        return _gather_rows(x, indices)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return _scatter_rows(grad, indices, ctx.first_axis_dim), None


class _IndexPutFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        return _scatter_rows(values, indices, first_axis_dim)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return _gather_rows(grad, indices), None, None


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along dim 0, differentiable.  x ``(n, ...)``, indices int64 ``(k,)`` -> ``(k, ...)``."""
    return _IndexFirstAxis.apply(x, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros ``(first_axis_dim, ...)`` with rows ``indices`` set to ``values`` ``(k, ...)``, differentiable.
    ``indices`` must be unique (as the ones from :func:`unpad_input` are)."""
    return _IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Packs the real tokens of a padded batch.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)`` bool or 0/1 integers, True/1 = real token.  Any padding side
            (left, right, or holes); tokens keep their order within each sequence.
        unused_mask: optional ``(batch, seqlen)``, tokens that are allocated but not attended to (e.g. free
            KV-cache slots): packed and counted in ``cu_seqlens`` but not in ``seqused``.

    Returns:
        ``(hidden_unpadded, indices, cu_seqlens, max_seqlen_in_batch, seqused)``: hidden_unpadded
        ``(total, ...)``; indices int64 ``(total,)`` into the flattened ``batch * seqlen`` positions;
        cu_seqlens int32 ``(batch + 1,)``; max_seqlen_in_batch a Python int; seqused int32 ``(batch,)``,
        the count of ``attention_mask`` tokens per sequence.
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise FlashAttnError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, seqlen) = "
            f"{tuple(hidden_states.shape[:2])} of hidden_states"
        )
    used = attention_mask.bool()
    every = used if unused_mask is None else used | unused_mask.bool()
    seqlens = every.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(every.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=seqlens.device)
    torch.cumsum(seqlens, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    packed = index_first_axis(hidden_states.flatten(0, 1), indices)
    return packed, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total, ...)`` -> ``(batch, seqlen, ...)`` with zeros at padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.unflatten(0, (batch, seqlen))


def unpad_indices_static(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen layout of a padded batch without reading the mask on the host (no device sync).

    Args:
        attention_mask: ``(batch, seqlen)`` bool or 0/1 integers, True/1 = real token, any padding side.

    Returns ``(indices, cu_seqlens, real)``: indices int64 ``(batch * seqlen,)``, a permutation of the
    flattened padded positions: packed row r holds padded position ``indices[r]``, the real tokens first (in
    order, sequence by sequence), then the padding ones; cu_seqlens int32 ``(batch + 1,)`` over the real
    tokens; real ``(batch * seqlen,)`` bool, whether packed row r is a real token (r < cu_seqlens[-1]).
    ``index_first_axis(x.flatten(0, 1), indices)`` packs ``x``; ``index_put_first_axis(y, indices, batch *
    seqlen)`` puts packed rows back (every row: zero the padding ones first). The varlen functions read only
    the rows cu_seqlens covers, so seqlen serves as max_seqlen.
    """
    if attention_mask.dim() != 2:
        raise FlashAttnError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, "
                             f"seqlen)")
    used = attention_mask.flatten().bool()
    n_real = used.sum()
    real_rank = torch.cumsum(used, 0) - 1
    pad_rank = torch.cumsum(~used, 0) - 1
    dest = torch.where(used, real_rank, n_real + pad_rank)  # the packed row of each padded position
    positions = torch.arange(used.numel(), device=used.device)
    indices = torch.empty_like(positions).scatter_(0, dest, positions)
    cu_seqlens = torch.zeros(attention_mask.shape[0] + 1, dtype=torch.int32, device=used.device)
    torch.cumsum(attention_mask.bool().sum(-1, dtype=torch.int32), 0, dtype=torch.int32, out=cu_seqlens[1:])
    return indices, cu_seqlens, positions < n_real
