"""`naive`: standard attention as the FlashAttention paper's baseline writes it, materialising the scores.

Also the low-precision yardstick of the correctness check: a provider may be as far from the fp64 oracle as a
small multiple of this one's error.
"""

from __future__ import annotations

import math

import torch

from ..case import Case
from .base import Prepared, Provider, make_leaves


def causal_drop_mask(seqlen_q: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may NOT see key j, i.e. j > i + seqlen_k - seqlen_q."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).triu(seqlen_k - seqlen_q + 1)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    drop: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (b, h, sq, d), k/v (b, hk, sk, d) -> (b, h, sq, d).

    Scores in the input dtype, softmax in at least fp32. `drop` is causal_drop_mask, passed in by callers that
    build it ahead of a timed call. In float64 this is an exact dense oracle.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sq, sk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # in place: matmul's backward needs q and k, not its output, so this saves two N² buffers
    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)  # (b, h, sq, d) x (b, h, d, sk) -> (b, h, sq, sk)
    if causal:
        s = s.masked_fill_(drop if drop is not None else causal_drop_mask(sq, sk, q.device), float("-inf"))
    p = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
    if causal and sk < sq:
        # the first sq - sk rows see no key: 0 (flash_attn's convention) rather than softmax's NaN
        p = p.nan_to_num(0.0)
    return torch.matmul(p.to(v.dtype), v)  # (b, h, sq, sk) x (b, h, sk, d) -> (b, h, sq, d)


def _setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    leaves = make_leaves(q, k, v, "bhsd")
    drop = causal_drop_mask(case.seqlen_q, case.seqlen_k, q.device) if case.causal else None
    return Prepared(
        fwd=lambda: naive_attention(*leaves, causal=case.causal, drop=drop), leaves=leaves, layout="bhsd"
    )


PROVIDERS = [
    Provider(
        "naive",
        _setup,
        "explicit torch: S = QKᵀ·scale in the input dtype, causal mask, softmax in fp32, cast, ·V",
    )
]
