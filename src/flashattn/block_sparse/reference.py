"""The dense-mask oracle of block-sparse attention: what block_sparse_attn_func must equal.

Plain PyTorch over the whole (batch, heads, seqlen_q, seqlen_k) score matrix (for tests and the benchmark's
check, on slices of long problems), differentiable, never NaN.
"""

from __future__ import annotations

import math

import torch


def masked_attention_ref(q, k, v, mask, *, softmax_scale=None, softcap=0.0, keep=None, dropout_p=0.0,
                         upcast=True):
    """Softmax attention where query i sees key j iff mask[..., i, j].

    q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), h % hk == 0 (GQA); mask bool broadcastable to
    (b, h, sq, sk), True = visible. upcast: float64 throughout (the oracle, returns float64); otherwise like
    plain PyTorch in the input dtype (scores in it, softmax in float32), the low-precision yardstick of the
    tolerance rule. keep: the dropout keep mask (b, h, sq, sk); kept probabilities are scaled by
    1 / (1 - dropout_p). Rows that see no key: output 0, LSE +inf, zero gradients.

    Returns (out (b, sq, h, dv), lse (b, h, sq) natural log).
    """
    d = q.shape[-1]
    group = q.shape[2] // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(group, 2), v.to(dtype).repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (b, sq, h, d) x (b, sk, h, d) -> (b, h, sq, sk)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.to(torch.float64 if upcast else torch.float32).masked_fill(~mask.to(s.device), -math.inf)
    # the max is detached (softmax does not depend on it) and 0 where a row sees nothing, so no inf - inf
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), 0.0, m)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    empty = denom == 0
    denom = torch.where(empty, 1.0, denom)
    lse = torch.where(empty, math.inf, m + torch.log(denom)).squeeze(-1)
    p = e / denom
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)  # (b, h, sq, sk) x (b, sk, h, dv)
    return out.to(dtype), lse
