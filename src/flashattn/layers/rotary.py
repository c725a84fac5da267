"""flash_attn 2.x's `flash_attn.layers.rotary` functions: rotary embeddings applied to q / k with per-sequence
position offsets, packed (varlen) sequences and in-place updates, with its arguments and conventions.

Token m of sequence b sits at position m + seqlen_offsets[b] (or + seqlen_offsets, an int) and rotates by
row `position` of cos / sin ((seqlen_ro, rotary_dim / 2)); the first rotary_dim features rotate, the rest
pass through. Non-interleaved (GPT-NeoX): feature i pairs with i + rotary_dim / 2; interleaved (GPT-J): 2i
with 2i + 1. The rotation is computed in float32 and stored in x's dtype; its gradient is the inverse
rotation. Positions outside [0, seqlen_ro) are left unrotated (flash_attn's kernel reads cos = 1, sin = 0
there; with an int offset it rejects them instead, and so does this module), and so are varlen rows past
cu_seqlens[-1]. Plain PyTorch: runs on every device.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from flashattn import _validate
from flashattn.errors import FlashAttnError

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_"]


def _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, names=("cos", "sin")) -> tuple[int, int]:
    """Returns (batch, seqlen) of x: the padded length, or max_seqlen for varlen. names: what the caller
    calls the two tables, for the messages."""
    varlen = cu_seqlens is not None
    layout = "(total_seqlen, nheads, headdim) + cu_seqlens" if varlen else "(batch, seqlen, nheads, headdim)"
    if not isinstance(x, Tensor) or x.dim() != (3 if varlen else 4):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise FlashAttnError(f"x must be a tensor of layout {layout}, got {got}")
    c_name, s_name = names
    for name, t in ((c_name, cos), (s_name, sin)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.device != x.device or not t.is_floating_point():
            got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, Tensor) else type(t).__name__
            raise FlashAttnError(f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2) on {x.device}, "
                                 f"got {got}")
    if sin.shape != cos.shape:
        raise FlashAttnError(f"{s_name} has shape {tuple(sin.shape)} but {c_name} {tuple(cos.shape)}; they "
                             f"must match")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= x.shape[-1]:
        raise FlashAttnError(f"rotary_dim = 2 * {c_name}.shape[1] = {rotary_dim}; expected 0 < rotary_dim <= "
                             f"headdim {x.shape[-1]}")
    if varlen:
        batch = _validate.check_cu_seqlens_shapes(cu_seqlens, cu_seqlens, x)
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0:
            raise FlashAttnError(f"max_seqlen must be an int >= 0 with cu_seqlens, got {max_seqlen!r}")
        seqlen = int(max_seqlen)
    else:
        batch, seqlen = x.shape[0], x.shape[1]
    if isinstance(seqlen_offsets, Tensor):
        if (seqlen_offsets.dtype not in (torch.int32, torch.int64) or tuple(seqlen_offsets.shape) != (batch,)
                or seqlen_offsets.device != x.device):
            raise FlashAttnError(
                f"seqlen_offsets must be an int or an int32/int64 tensor of shape ({batch},) on {x.device}, "
                f"got {seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)} on {seqlen_offsets.device}")
    elif isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, numbers.Integral):
        raise FlashAttnError(
            f"seqlen_offsets must be an int or a ({batch},) int tensor, got {seqlen_offsets!r}")
    elif not 0 <= seqlen_offsets <= cos.shape[0] - seqlen:
        raise FlashAttnError(f"seqlen_offsets is {seqlen_offsets} with seqlen {seqlen}: positions reach "
                             f"{seqlen_offsets + seqlen} but {c_name} / {s_name} have {cos.shape[0]} rows "
                             f"(seqlen_ro); expected 0 <= seqlen_offsets <= seqlen_ro - seqlen")
    return batch, seqlen


def _positions(x, seqlen_offsets, cu_seqlens):
    """Each token's position, int64 shaped like x's leading dims, and whether it belongs to a sequence."""
    dev = x.device
    if cu_seqlens is None:
        pos = torch.arange(x.shape[1], device=dev).view(1, -1)
        offsets = seqlen_offsets.view(-1, 1).long() if isinstance(seqlen_offsets, Tensor) else seqlen_offsets
        return (pos + offsets).expand(x.shape[0], -1), None
    # varlen: token t belongs to sequence searchsorted(cu[1:], t) and sits at t - cu[seq] in it
    t = torch.arange(x.shape[0], device=dev)
    cu = cu_seqlens.long()
    batch = cu.shape[0] - 1
    seq = torch.searchsorted(cu[1:], t, right=True).clamp_(max=max(batch - 1, 0))
    inside = (t >= cu[0]) & (t < cu[-1]) if batch else torch.zeros_like(t, dtype=torch.bool)
    pos = t - cu[seq] if batch else t
    if isinstance(seqlen_offsets, Tensor):
        pos = pos + (seqlen_offsets.long()[seq] if batch else 0)
    else:
        pos = pos + seqlen_offsets
    return pos, inside


def _rotate(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, conjugate):
    """x rotated (a new tensor in x's dtype); conjugate: by the opposite angles (the backward)."""
    half = cos.shape[1]
    rd = 2 * half
    pos, inside = _positions(x, seqlen_offsets, cu_seqlens)
    seen = (pos >= 0) & (pos < cos.shape[0])
    if inside is not None:
        seen &= inside
    idx = pos.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(seen.unsqueeze(-1), cos.float()[idx], 1.0).unsqueeze(-2)  # (..., 1, rotary_dim / 2)
    s = torch.where(seen.unsqueeze(-1), sin.float()[idx], 0.0).unsqueeze(-2)
    if conjugate:
        s = -s
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rd:]), dim=-1)


class _ApplyRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens):
        out = _rotate(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, False)
        offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        ctx.save_for_backward(cos, sin, cu_seqlens, offsets)
        ctx.interleaved = interleaved
        ctx.offset = None if offsets is not None else seqlen_offsets
        if inplace:
            ctx.mark_dirty(x)
            return x.copy_(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin, cu_seqlens, offsets = ctx.saved_tensors
        offsets = ctx.offset if offsets is None else offsets
        return _rotate(grad, cos, sin, ctx.interleaved, offsets, cu_seqlens, True), *(None,) * 6


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotary embedding of the first rotary_dim features of x (differentiable in x).

    Arguments:
        x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens.
        cos, sin: (seqlen_ro, rotary_dim / 2), any float dtype, on x's device; rotary_dim <= headdim.
        interleaved: bool, default False. Rotate the pairs (2i, 2i + 1) (GPT-J) instead of (i, i +
            rotary_dim / 2) (GPT-NeoX).
        inplace: bool, default False. Write the result into x and return x.
        seqlen_offsets: int >= 0 or (batch,) int32/int64 tensor, default 0. Position of each sequence's first
            token (the cached tokens when decoding). An int needs seqlen_offsets + seqlen <= seqlen_ro.
        cu_seqlens: (batch + 1,) int32, default None. Packed sequences (varlen layout).
        max_seqlen: int, the longest sequence; required with cu_seqlens.
    Returns:
        out: like x (x itself when inplace).
    """
    _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    return _ApplyRotary.apply(x, cos, sin, bool(interleaved), bool(inplace), seqlen_offsets, cu_seqlens)


apply_rotary_emb_func = apply_rotary_emb  # flash_attn's older name


def _parts(packed, num_heads_q, kv_only):
    """The parts of a packed tensor that rotate, as views: (q, k) of a qkv, (k,) of a kv."""
    if kv_only:
        return (packed[:, :, 0],)
    if packed.dim() == 5:
        if packed.shape[2] != 3:
            raise FlashAttnError(
                f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(packed.shape)}")
        return packed[:, :, 0], packed[:, :, 1]
    if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, numbers.Integral):
        raise FlashAttnError("num_heads_q is required (an int) when qkv is (batch, seqlen, num_heads_q + "
                             f"2 * num_heads_k, headdim); got {num_heads_q!r} with qkv {tuple(packed.shape)}")
    hk2 = packed.shape[2] - num_heads_q
    if num_heads_q <= 0 or hk2 <= 0 or hk2 % 2:
        raise FlashAttnError(f"qkv has {packed.shape[2]} heads and num_heads_q is {num_heads_q}; expected "
                             f"num_heads_q + 2 * num_heads_k heads")
    return packed[:, :, :num_heads_q], packed[:, :, num_heads_q : num_heads_q + hk2 // 2]


class _ApplyRotaryPacked(torch.autograd.Function):
    """In place on the q and k parts of a packed qkv (or the k part of a kv); tables (cos, sin) for q and
    (cos_k, sin_k) for k."""

    @staticmethod
    def forward(ctx, packed, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, kv_only,
                names_k):
        parts = _parts(packed, num_heads_q, kv_only)
        tables = ((cos_k, sin_k),) if kv_only else ((cos, sin), (cos_k, sin_k))
        # k's tables go by their own names when they are k's own; every part is checked before any is
        # rotated, so a call that raises leaves the packed tensor as it was
        names = (names_k,) if kv_only else (("cos", "sin"), names_k)
        for part, (c, s), n in zip(parts, tables, names, strict=True):
            _check(part, c, s, seqlen_offsets, None, None, n)
        for part, (c, s) in zip(parts, tables, strict=True):
            part.copy_(_rotate(part, c, s, interleaved, seqlen_offsets, None, False))
        offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        ctx.save_for_backward(cos, sin, cos_k, sin_k, offsets)
        ctx.interleaved, ctx.num_heads_q, ctx.kv_only = interleaved, num_heads_q, kv_only
        ctx.offset = None if offsets is not None else seqlen_offsets
        ctx.mark_dirty(packed)
        return packed

    @staticmethod
    def backward(ctx, grad):
        cos, sin, cos_k, sin_k, offsets = ctx.saved_tensors
        offsets = ctx.offset if offsets is None else offsets
        grad = grad.clone()
        tables = ((cos_k, sin_k),) if ctx.kv_only else ((cos, sin), (cos_k, sin_k))
        for part, (c, s) in zip(_parts(grad, ctx.num_heads_q, ctx.kv_only), tables, strict=True):
            part.copy_(_rotate(part, c, s, ctx.interleaved, offsets, None, True))
        return grad, *(None,) * 9


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                          num_heads_q=None):
    """Rotary embedding of q and k inside a packed qkv, in place (differentiable in qkv).

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)
            for GQA / MQA (then num_heads_q is required).
        cos, sin: (seqlen_ro, rotary_dim / 2) for q (and k, unless cos_k / sin_k are given).
        cos_k, sin_k: (seqlen_ro, rotary_dim / 2), default None: k's own tables (e.g. XPos).
        interleaved, seqlen_offsets: as apply_rotary_emb's.
        num_heads_q: int, default None; see qkv.
    Returns:
        qkv itself, with its q and k parts rotated.
    """
    if not isinstance(qkv, Tensor) or qkv.dim() not in (4, 5):
        raise FlashAttnError(f"qkv must be a (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, nheads_q "
                             f"+ 2 * nheads_k, headdim) tensor, got "
                             f"{getattr(qkv, 'shape', type(qkv).__name__)}")
    names_k = ("cos" if cos_k is None else "cos_k", "sin" if sin_k is None else "sin_k")
    cos_k, sin_k = (cos if cos_k is None else cos_k), (sin if sin_k is None else sin_k)
    return _ApplyRotaryPacked.apply(qkv, cos, sin, cos_k, sin_k, bool(interleaved), seqlen_offsets,
                                    num_heads_q, False, names_k)


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """Rotary embedding of k inside a packed kv (batch, seqlen, 2, nheads, headdim), in place; arguments as
    apply_rotary_emb_qkv_'s. Returns kv."""
    if not isinstance(kv, Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise FlashAttnError(f"kv must be (batch, seqlen, 2, nheads, headdim), got "
                             f"{getattr(kv, 'shape', type(kv).__name__)}")
    return _ApplyRotaryPacked.apply(kv, cos, sin, cos, sin, bool(interleaved), seqlen_offsets, None, True,
                                    ("cos", "sin"))
