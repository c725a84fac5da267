"""Dense attention oracle and the blockwise online-softmax reference.

Both follow the semantics in ``design.md`` (flash_attn 2.x): bottom-right aligned causal mask, sliding
window, softcap, ALiBi, learnable sink, padding masks and an explicit dropout keep-mask.  They are plain
PyTorch, differentiable, and meant for correctness checks, not speed: the dense oracle materialises the
full ``(batch, nheads, seqlen_q, seqlen_k)`` score matrix.

A query row that sees no key gets output 0 and LSE ``+inf`` (or LSE = sink when a learnable sink is given);
nothing along the way produces NaN, in the forward or the backward pass.
"""

from __future__ import annotations

import math

import torch

from flashattn.errors import FlashAttnError

__all__ = ["attention_ref", "attention_ref_varlen", "blockwise_attention_ref", "masked_attention_ref"]


def _check_inputs(q, k, v, alibi_slopes, learnable_sink):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise FlashAttnError(
            f"q, k, v must be 4-D (batch, seqlen, nheads, headdim); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, _, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise FlashAttnError(f"batch mismatch: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise FlashAttnError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in seqlen_k and nheads_k")
    if k.shape[3] != d:
        raise FlashAttnError(f"k has headdim {k.shape[3]} but q has {d}; q and k must share the head "
                             "dimension")
    hk = k.shape[2]
    if hk == 0 or h % hk != 0:
        raise FlashAttnError(
            f"k has {hk} heads but q has {h}; nheads must be a multiple of nheads_k (GQA)"
        )
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise FlashAttnError(
            f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({h},) or ({b}, {h})"
        )
    if learnable_sink is not None and tuple(learnable_sink.shape) != (h,):
        raise FlashAttnError(f"learnable_sink has shape {tuple(learnable_sink.shape)}; expected ({h},)")
    return b, h, hk, d


def _offsets(b, sq, sk, query_padding_mask, key_padding_mask, device):
    """Per-batch ``seqlen_k - seqlen_q``: with padding the alignment uses each sequence's real lengths,
    as a varlen call on the unpadded tokens would."""
    q_len = query_padding_mask.sum(-1) if query_padding_mask is not None else torch.full((b,), sq)
    k_len = key_padding_mask.sum(-1) if key_padding_mask is not None else torch.full((b,), sk)
    return (k_len.to(device) - q_len.to(device)).long().view(b, 1, 1, 1)


def _visible(rows, cols, offset, *, causal, window_size, query_padding_mask, key_padding_mask):
    """Bool ``(b|1, 1, len(rows), len(cols))``: True where query ``rows[i]`` may attend to key ``cols[j]``."""
    left, right = window_size
    if causal:
        right = 0
    diag = rows.view(-1, 1) + offset  # key index aligned with each query (b|1, 1, m, 1)
    j = cols.view(1, -1)
    vis = torch.ones(diag.shape[:-1] + (cols.numel(),), dtype=torch.bool, device=rows.device)
    if right >= 0:
        vis = vis & (j <= diag + right)
    if left >= 0:
        vis = vis & (j >= diag - left)
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[:, cols].view(-1, 1, 1, cols.numel())
    if query_padding_mask is not None:
        vis = vis & query_padding_mask[:, rows].view(-1, 1, rows.numel(), 1)
    return vis


def _alibi_bias(alibi_slopes, rows, cols, offset, b, h, dtype):
    """``-slope * |i + sk - sq - j|`` as ``(b|1, h, m, n)``; the same formula for causal and non-causal."""
    slopes = alibi_slopes.to(dtype)
    slopes = slopes.view(1, h, 1, 1) if slopes.dim() == 1 else slopes.view(b, h, 1, 1)
    dist = (rows.view(-1, 1) + offset - cols.view(1, -1)).abs().to(dtype)  # (b|1, 1, m, n)
    return -slopes * dist


def _repeat_kv(x, h):
    """Expand kv heads to query heads; GQA query head i reads kv head ``i // (h // hk)``."""
    g = h // x.shape[2]
    return x if g == 1 else x.repeat_interleave(g, dim=2)


def _safe_softmax(scores, sink):
    """Softmax over the last dim with an optional extra sink logit; returns (probs, lse).

    Masked entries are -inf.  The row max is detached: softmax and LSE are invariant to it, and a fully
    masked row would otherwise push inf/NaN through the gradient.
    """
    if scores.shape[-1] == 0:  # no keys at all (seqlen_k = 0): amax has nothing to reduce
        m = scores.new_full(scores.shape[:-1] + (1,), -math.inf)
    else:
        m = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = m.detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    empty = denom == 0
    denom_safe = torch.where(empty, torch.ones_like(denom), denom)
    lse = torch.where(empty, torch.full_like(denom, math.inf), m + torch.log(denom_safe))
    return p / denom_safe, lse.squeeze(-1)


def _sink_view(learnable_sink, h, dtype):
    return None if learnable_sink is None else learnable_sink.to(dtype).view(1, h, 1, 1)


def _dropout_scale(dropout_p, dropout_mask):
    if not 0.0 <= dropout_p < 1.0:
        raise FlashAttnError(f"dropout_p={dropout_p}; expected 0 <= dropout_p < 1")
    if dropout_p > 0.0 and dropout_mask is None:
        raise FlashAttnError(
            "dropout_p > 0 needs dropout_mask, a bool keep-mask of shape (b, h, seqlen_q, seqlen_k)"
        )
    return 1.0 / (1.0 - dropout_p)


def attention_ref(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    learnable_sink=None,
    query_padding_mask=None,
    key_padding_mask=None,
    dropout_p=0.0,
    dropout_mask=None,
    upcast=True,
    reorder_ops=False,
):
    """Dense reference attention.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (GQA/MQA).
        v: ``(batch, seqlen_k, nheads_k, headdim_v)``.
        causal: bottom-right aligned, query i sees key j iff ``j <= i + seqlen_k - seqlen_q``.
            seqlen_q=2, seqlen_k=5::

                1 1 1 1 0
                1 1 1 1 1

        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        window_size: ``(left, right)``; query i sees keys in
            ``[i + sk - sq - left, i + sk - sq + right]``, -1 means unbounded on that side.
        softcap: if > 0, scaled scores become ``softcap * tanh(s / softcap)`` (before masking).
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)``; ``s -= slope * |i + sk - sq - j|`` after softcap.
        learnable_sink: ``(nheads,)`` extra logit per head in the softmax denominator (no value).
        query_padding_mask, key_padding_mask: ``(batch, seqlen)`` bool, True = real token.  The causal /
            window / ALiBi alignment then uses each sequence's real lengths.
        dropout_p: dropout probability; kept probabilities are scaled by ``1 / (1 - dropout_p)``.
        dropout_mask: ``(batch, nheads, seqlen_q, seqlen_k)`` bool, True = keep.
        upcast: compute in float64 and return float64.  False computes like plain PyTorch in the input
            dtype (scores in that dtype, softmax in float32) -- the low-precision baseline of the tests.
        reorder_ops: scale q before the matmul instead of the scores after it (only matters when not
            upcast).

    Returns:
        ``(out, lse)``: out ``(batch, seqlen_q, nheads, headdim_v)`` (float64 if upcast, else q's dtype);
        lse ``(batch, nheads, seqlen_q)`` natural log (float64 if upcast, else float32), ``+inf`` for rows
        that see no key.
    """
    b, h, _, d = _check_inputs(q, k, v, alibi_slopes, learnable_sink)
    sq, sk = q.shape[1], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    drop_scale = _dropout_scale(dropout_p, dropout_mask)
    dtype_out = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    soft_dtype = torch.float64 if upcast else torch.float32
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)

    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.to(soft_dtype)

    rows = torch.arange(sq, device=q.device)
    cols = torch.arange(sk, device=q.device)
    offset = _offsets(b, sq, sk, query_padding_mask, key_padding_mask, q.device)
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, rows, cols, offset, b, h, soft_dtype)
    vis = _visible(
        rows,
        cols,
        offset,
        causal=causal,
        window_size=window_size,
        query_padding_mask=query_padding_mask,
        key_padding_mask=key_padding_mask,
    )
    scores = scores.masked_fill(~vis, -math.inf)
    probs, lse = _safe_softmax(scores, _sink_view(learnable_sink, h, soft_dtype))
    probs = probs.to(v.dtype)
    if dropout_mask is not None:
        probs = probs.masked_fill(~dropout_mask, 0.0) * drop_scale
    out = torch.einsum("bhts,bshd->bthd", probs, v)
    return (out if upcast else out.to(dtype_out)), lse


def attention_ref_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    alibi_slopes=None,
    dropout_mask=None,
    **kwargs,
):
    """:func:`attention_ref` on the varlen layout, one sequence at a time.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim[_v])``.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` token offsets; zero-length sequences are allowed.
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` (row b for sequence b).
        dropout_mask: ``(batch, nheads, >= max len_q, >= max len_k)`` bool, True = keep; sequence b uses
            ``[b, :, :len_q, :len_k]`` (the layout of :func:`flashattn.dropout.dropout_keep_mask` called
            with the varlen call's ``max_seqlen_*``).
        kwargs: the other keyword arguments of :func:`attention_ref` (not the padding masks); every mask
            is aligned with the sequence's own lengths.

    Returns:
        ``(out, lse)``: out ``(total_q, nheads, headdim_v)``; lse ``(nheads, total_q)`` (flash_attn's varlen
        layout).  Tokens past ``cu_seqlens_q[-1]`` get out 0 and lse ``+inf``.  Differentiable.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise FlashAttnError(
            f"q, k, v must be 3-D (total, nheads, headdim); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    cq, ck = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck):
        raise FlashAttnError(f"cu_seqlens_q has {len(cq)} entries and cu_seqlens_k {len(ck)}; both are "
                             "batch + 1")
    outs, lses = [], []
    for bi in range(len(cq) - 1):
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[bi : bi + 1]
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[bi : bi + 1, :, : cq[bi + 1] - cq[bi], : ck[bi + 1] - ck[bi]]
        o, lse = attention_ref(
            q[cq[bi] : cq[bi + 1]].unsqueeze(0),
            k[ck[bi] : ck[bi + 1]].unsqueeze(0),
            v[ck[bi] : ck[bi + 1]].unsqueeze(0),
            alibi_slopes=slopes,
            dropout_mask=mask,
            **kwargs,
        )
        outs.append(o[0])
        lses.append(lse[0])
    rest = q.shape[0] - cq[-1]
    h, dv = q.shape[1], v.shape[2]
    upcast = kwargs.get("upcast", True)
    out_dtype = torch.float64 if upcast else q.dtype
    lse_dtype = torch.float64 if upcast else torch.float32
    outs = [q.new_zeros(cq[0], h, dv, dtype=out_dtype)] + outs + [q.new_zeros(rest, h, dv, dtype=out_dtype)]
    lses = (
        [q.new_full((h, cq[0]), math.inf, dtype=lse_dtype)] + lses
        + [q.new_full((h, rest), math.inf, dtype=lse_dtype)]
    )
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def blockwise_attention_ref(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    block_n=64,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    learnable_sink=None,
    query_padding_mask=None,
    key_padding_mask=None,
    dropout_p=0.0,
    dropout_mask=None,
):
    """The FlashAttention online softmax over key blocks of ``block_n``, in float64.

    Same arguments and outputs as :func:`attention_ref` with ``upcast=True``; exists to show (and test)
    that streaming keys with a running max m, normaliser l and unnormalised accumulator gives the dense
    result exactly.
    """
    b, h, _, d = _check_inputs(q, k, v, alibi_slopes, learnable_sink)
    if block_n < 1:
        raise FlashAttnError(f"block_n={block_n}; expected a positive block size")
    sq, sk, dv = q.shape[1], k.shape[1], v.shape[3]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    drop_scale = _dropout_scale(dropout_p, dropout_mask)
    f64 = torch.float64
    q, k, v = q.to(f64), _repeat_kv(k.to(f64), h), _repeat_kv(v.to(f64), h)
    rows = torch.arange(sq, device=q.device)
    offset = _offsets(b, sq, sk, query_padding_mask, key_padding_mask, q.device)

    # The sink is a key with no value: starting from (m, l) = (sink, 1) folds it in before any block.
    if learnable_sink is not None:
        m = learnable_sink.to(f64).view(1, h, 1).expand(b, h, sq).clone()
        l_i = torch.ones(b, h, sq, dtype=f64, device=q.device)
    else:
        m = torch.full((b, h, sq), -math.inf, dtype=f64, device=q.device)
        l_i = torch.zeros(b, h, sq, dtype=f64, device=q.device)
    acc = torch.zeros(b, h, sq, dv, dtype=f64, device=q.device)

    for j0 in range(0, sk, block_n):
        cols = torch.arange(j0, min(j0 + block_n, sk), device=q.device)
        s = torch.einsum("bthd,bshd->bhts", q, k[:, j0 : j0 + block_n]) * scale  # (b, h, sq, n)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if alibi_slopes is not None:
            s = s + _alibi_bias(alibi_slopes, rows, cols, offset, b, h, f64)
        vis = _visible(
            rows,
            cols,
            offset,
            causal=causal,
            window_size=window_size,
            query_padding_mask=query_padding_mask,
            key_padding_mask=key_padding_mask,
        )
        s = s.masked_fill(~vis, -math.inf)
        # -- update m and l; a row with nothing seen yet keeps m = -inf, so exponentiate against 0 there
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref.unsqueeze(-1))
        l_i = alpha * l_i + p.sum(dim=-1)
        if dropout_mask is not None:
            p = p.masked_fill(~dropout_mask[..., j0 : j0 + block_n], 0.0) * drop_scale
        # -- rescale the accumulator and add this block: (b, h, sq, n) x (b, n, h, dv) -> (b, h, sq, dv)
        acc = alpha.unsqueeze(-1) * acc + torch.einsum("bhts,bshd->bhtd", p, v[:, j0 : j0 + block_n])
        m = m_new

    empty = l_i == 0
    l_safe = torch.where(empty, torch.ones_like(l_i), l_i)
    out = (acc / l_safe.unsqueeze(-1)).transpose(1, 2)
    lse = torch.where(empty, torch.full_like(l_i, math.inf), m + torch.log(l_safe))
    return out, lse

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


def _descale_view(descale, heads: int, dtype):
    """descale (1,) or (batch, heads'), heads' a divisor of heads (each group of heads shares one, as q's
    per-kv-head descale), as a factor broadcastable to (batch, seqlen, heads, d)."""
    d = descale.to(dtype)
    if d.numel() == 1:
        return d.reshape(())
    return d.repeat_interleave(heads // d.shape[1], dim=1)[:, None, :, None]


def dequantize_fp8(x8, descale, dtype=torch.float64):
    """x8 · descale in `dtype`: x8 (batch, seqlen, heads, d) e4m3, descale (1,) or (batch, heads'), heads' a
    divisor of heads."""
    return x8.to(dtype) * _descale_view(descale, x8.shape[2], dtype)


def fp8_scores(q8, k8, q_descale, k_descale):
    """q·kᵀ of e4m3 tensors as PyTorch computes it in FP8: ``torch._scaled_mm`` of the raw e4m3 values per
    (batch, query head), with fast accumulation (on a GPU the FP8 tensor cores' own accumulation, which an
    FP8 attention kernel's q·k products share; on the CPU exact float32), times the descales in float32.

    q8: (batch, seqlen_q, heads, d), k8: (batch, seqlen_k, heads_k, d) e4m3 with descales (1,) or
    (batch, heads'), heads' a divisor of the tensor's heads. Returns float32 (batch, heads, seqlen_q,
    seqlen_k).
    """
    b, sq, h, d = q8.shape
    sk = k8.shape[1]
    sq16, sk16, d16 = (n + (-n % 16) for n in (sq, sk, d))  # _scaled_mm takes multiples of 16
    a = q8.new_zeros(sq16, d16)
    kt = k8.new_zeros(sk16, d16)
    one = torch.ones((), device=q8.device)
    raw = torch.empty(b, h, sq, sk, device=q8.device)
    g = h // k8.shape[2]
    for bi in range(b):
        for hi in range(h):
            a[:sq, :d] = q8[bi, :, hi]
            kt[:sk, :d] = k8[bi, :, hi // g]
            raw[bi, hi] = torch._scaled_mm(a, kt.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                           use_fast_accum=True)[:sq, :sk]
    factor = _descale_view(q_descale, h, torch.float32) * _descale_view(k_descale, h, torch.float32)
    if factor.dim():  # per (batch, head): (batch, 1, heads, 1) -> (batch, heads, 1, 1)
        factor = factor.transpose(1, 2)
    return raw * factor.to(raw.device)


def attention_ref_fp8(q8, k8, v8, q_descale, k_descale, v_descale, *, upcast=True, out_dtype=torch.bfloat16,
                      causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      learnable_sink=None):
    """An FP8 call's oracle, or plain PyTorch computing it at FP8's precision.

    q8, k8, v8: e4m3 (batch, seqlen, heads, d) with descales (1,) or (batch, heads) (q's may be per kv head);
    the options as :func:`attention_ref`.  upcast: :func:`attention_ref` in float64 of the dequantised
    inputs, returned in float64.  upcast=False: the baseline of the tolerance rule, what an FP8 kernel
    computes without its tiling: q·k as PyTorch's own FP8 product (:func:`fp8_scores`) times the descales,
    the softmax numerators exp(s - row max) rounded to e4m3 (in [0, 1], as an FP8 P·V product takes them),
    P·V in float32 over the raw e4m3 values of v, divided by the unrounded row sum, times v's descale, out in
    out_dtype.

    Returns ``(out, lse)`` as :func:`attention_ref`'s.
    """
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                  alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    if upcast:
        return attention_ref(dequantize_fp8(q8, q_descale), dequantize_fp8(k8, k_descale),
                             dequantize_fp8(v8, v_descale), upcast=True, **kwargs)
    b, h, _, d = _check_inputs(q8, k8, v8, alibi_slopes, learnable_sink)
    sq, sk = q8.shape[1], k8.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = fp8_scores(q8, k8, q_descale, k_descale) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    rows, cols = torch.arange(sq, device=q8.device), torch.arange(sk, device=q8.device)
    offset = _offsets(b, sq, sk, None, None, q8.device)
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, rows, cols, offset, b, h, torch.float32)
    vis = _visible(rows, cols, offset, causal=causal, window_size=window_size, query_padding_mask=None,
                   key_padding_mask=None)
    scores = scores.masked_fill(~vis, -math.inf)
    m = scores.amax(-1, keepdim=True) if sk else scores.new_full((b, h, sq, 1), -math.inf)
    sink = _sink_view(learnable_sink, h, torch.float32)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    numer = torch.exp(scores - m)  # in [0, 1]: what the kernel rounds to e4m3
    denom = numer.sum(-1, keepdim=True) + (torch.exp(sink - m) if sink is not None else 0.0)
    lse = torch.where(denom == 0, math.inf, m + torch.log(denom)).squeeze(-1)
    out = torch.einsum("bhts,bshd->bthd", numer.to(torch.float8_e4m3fn).float(), _repeat_kv(v8.float(), h))
    out = out / torch.where(denom == 0, 1.0, denom).transpose(1, 2)
    # v's descale per kv head, spread over each group of out's query heads
    return (out * _descale_view(v_descale, h, torch.float32)).to(out_dtype), lse
