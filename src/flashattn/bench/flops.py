"""FLOP counting by the FlashAttention convention, so TFLOP/s compare with the papers and the anchors page."""

from __future__ import annotations

# Backward does five matmuls of the forward's size (QKᵀ again, dV, dP, dQ, dK) against the forward's two:
# 2.5x, the papers' and the anchors page's convention.
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> float:
    """Number of (query, key) pairs that take part in the softmax.

    Causal is bottom-right aligned (query i sees key j iff j <= i + seqlen_k - seqlen_q). For seqlen_q ==
    seqlen_k we keep the papers' "half the square" (N²/2, the diagonal counted half) so numbers line up with
    published tables; otherwise we count the visible pairs exactly, which matters for short queries against a
    long cache.
    """
    if not causal:
        return float(seqlen_q * seqlen_k)
    if seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2
    if seqlen_k >= seqlen_q:
        # every row sees the (seqlen_k - seqlen_q) prefix plus a triangle 1..seqlen_q
        return float(seqlen_q * (seqlen_k - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2)
    # the first seqlen_q - seqlen_k rows see nothing; the rest form a triangle 1..seqlen_k
    return float(seqlen_k * (seqlen_k + 1) // 2)


def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    headdim: int,
    causal: bool,
    mode: str = "fwd",
    headdim_v: int | None = None,
) -> float:
    """Forward = 4·b·h·pairs·d (QKᵀ and PV, 2 flops per multiply-add); bwd 2.5x, fwd+bwd 3.5x."""
    return pair_flops(batch * nheads * visible_pairs(seqlen_q, seqlen_k, causal), headdim, headdim_v, mode)


def pair_flops(head_pairs: float, headdim: int, headdim_v: int | None = None, mode: str = "fwd") -> float:
    """FLOPs of `head_pairs` (query, key) pairs summed over heads: 2·pairs·(d + dv) forward (QKᵀ over d, PV
    over dv; 4·pairs·d when they agree), the same 2.5x / 3.5x for backward and forward+backward."""
    dv = headdim if headdim_v is None else headdim_v
    return 2.0 * head_pairs * (headdim + dv) * MODE_FACTOR[mode]


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
