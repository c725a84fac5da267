"""Rotary position embeddings (RoPE) in plain PyTorch, with flash_attn's conventions.

A rotary embedding of dimension ``rotary_dim`` (even, <= headdim) rotates the first ``rotary_dim`` features of
every query and key head by position-dependent angles ``pos * base ** (-2i / rotary_dim)``,
``i = 0 .. rotary_dim/2 - 1``; the remaining features pass through.  Two ways of pairing features:

- non-interleaved (GPT-NeoX, Llama in Hugging Face): feature ``i`` pairs with ``i + rotary_dim/2``;
- interleaved (GPT-J): feature ``2i`` pairs with ``2i + 1``.

The angles are recomputed per call in float32 rather than cached or kept in a buffer: no Python-side cache for
torch.compile to guard on, and ``module.to(torch.bfloat16)`` cannot round the frequencies.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashattn.errors import FlashAttnError

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "rotary_cos_sin"]


def _inv_freq(rotary_dim: int, base: float, device=None) -> Tensor:
    if rotary_dim <= 0 or rotary_dim % 2:
        raise FlashAttnError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rotary_cos_sin(
    seqlen: int,
    rotary_dim: int,
    base: float = 10000.0,
    offset: int = 0,
    device=None,
    inv_freq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles, each ``(seqlen, rotary_dim // 2)`` float32, positions offset, offset+1..."""
    if inv_freq is None:
        inv_freq = _inv_freq(rotary_dim, base, device)
    pos = torch.arange(offset, offset + seqlen, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(pos, inv_freq)  # (seqlen, rotary_dim / 2)
    return angles.cos(), angles.sin()


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x``.

    Arguments:
        x: ``(batch, seqlen, nheads, headdim)``, any float dtype.
        cos, sin: ``(seqlen, rotary_dim / 2)`` (from rotary_cos_sin), or ``(batch, seqlen, rotary_dim / 2)``
            for per-sequence positions.
        interleaved: pair features (2i, 2i+1) (GPT-J) instead of (i, i + rotary_dim/2) (GPT-NeoX).
    Returns:
        a new tensor like ``x``; the rotation is computed in float32 and cast back.
    """
    half = cos.shape[-1]
    rd = 2 * half
    if rd > x.shape[-1]:
        raise FlashAttnError(f"rotary_dim {rd} is larger than the head dimension {x.shape[-1]}")
    # broadcast over heads: (..., seqlen, 1, rotary_dim / 2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rd == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rd:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE for q and k of layout ``(batch, seqlen, nheads, headdim)``.

    ``forward(q, k, seqlen_offset=0)`` returns the rotated ``(q, k)``; ``seqlen_offset`` is the position of
    the first token (the number of cached tokens when decoding).  k may have fewer heads than q (GQA).
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        _inv_freq(dim, self.base)  # validates dim now rather than at the first call

    def forward(self, q: Tensor, k: Tensor, seqlen_offset: int = 0) -> tuple[Tensor, Tensor]:
        if k.shape[1] != q.shape[1]:
            raise FlashAttnError(
                f"q has seqlen {q.shape[1]} but k has {k.shape[1]}; self-attention rotates both alike"
            )
        cos, sin = rotary_cos_sin(q.shape[1], self.dim, self.base, offset=seqlen_offset, device=q.device)
        return (
            apply_rotary_emb(q, cos, sin, self.interleaved),
            apply_rotary_emb(k, cos, sin, self.interleaved),
        )

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}"
