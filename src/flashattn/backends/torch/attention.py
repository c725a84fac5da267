"""``attention_forward`` / ``attention_backward``: argument checks, and the padded and varlen layouts cut
into groups of equal-length sequences for :mod:`.forward` and :mod:`.backward` (the chunked route) or
:mod:`.fused` (ATen's fused CPU kernel, where :func:`.fused.mask_kind` says it computes the group exactly).

Padded: the whole batch is one group.  Varlen: every sequence is its own group of one (a Python loop over
the batch), sliced out of the packed tensors as views.
"""

from __future__ import annotations

import math

import torch

from flashattn.backends.torch import fused
from flashattn.backends.torch.backward import backward_group
from flashattn.backends.torch.forward import forward_group
from flashattn.backends.torch.tiles import Spec, Tiles, compute_dtype
from flashattn.errors import FlashAttnError
from flashattn.paged import gather_pages

__all__ = ["attention_forward", "attention_forward_fp8", "attention_backward"]


def _check_common(q, k, v, alibi_slopes, learnable_sink, dropout_p, nbatch):
    h, d = q.shape[-2], q.shape[-1]
    hk = k.shape[-2]
    if k.shape[-1] != d:
        raise FlashAttnError(f"k has headdim {k.shape[-1]} but q has {d}; q and k must share the head "
                             "dimension")
    if k.shape[:-1] != v.shape[:-1]:
        raise FlashAttnError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in all but the head dim")
    if hk == 0 or h % hk != 0:
        raise FlashAttnError(f"k has {hk} heads but q has {h}; nheads must be a multiple of nheads_k (GQA)")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((h,), (nbatch, h)):
        raise FlashAttnError(
            f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({h},) or ({nbatch}, {h})"
        )
    if learnable_sink is not None and tuple(learnable_sink.shape) != (h,):
        raise FlashAttnError(f"learnable_sink has shape {tuple(learnable_sink.shape)}; expected ({h},)")
    if not 0.0 <= dropout_p < 1.0:
        raise FlashAttnError(f"dropout_p={dropout_p}; expected 0 <= dropout_p < 1")


def _seq_bounds(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """Per-sequence (q start, q end, k start, k end) and the dropout strides (max_seqlen_q, max_seqlen_k)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise FlashAttnError("varlen needs both cu_seqlens_q and cu_seqlens_k (int32, shape (batch + 1,))")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cu_seqlens_q.dim() != 1 or len(cq) < 1 or len(cq) != len(ck):
        raise FlashAttnError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must "
            f"both have shape (batch + 1,)"
        )
    for name, cu, total in (("cu_seqlens_q", cq, total_q), ("cu_seqlens_k", ck, total_k)):
        if cu[0] < 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)) or cu[-1] > total:
            raise FlashAttnError(f"{name}={cu} must be non-decreasing within [0, {total}] (the packed "
                                 "length)")
    lens_q = [b - a for a, b in zip(cq, cq[1:], strict=False)]
    lens_k = [b - a for a, b in zip(ck, ck[1:], strict=False)]
    mq = max(lens_q, default=0) if max_seqlen_q is None else int(max_seqlen_q)
    mk = max(lens_k, default=0) if max_seqlen_k is None else int(max_seqlen_k)
    if lens_q and (max(lens_q) > mq or max(lens_k) > mk):
        raise FlashAttnError(
            f"max_seqlen_q={mq}, max_seqlen_k={mk} are below the longest sequences ({max(lens_q)}, "
            f"{max(lens_k)}); the dropout counters of neighbouring sequences would overlap"
        )
    return list(zip(cq, cq[1:], ck, ck[1:], strict=False)), mq, mk


def _groups(q, k, v, *, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Yields (batch index tensor, slice of q's tokens, slice of k's tokens, alibi slopes for the group,
    max_seqlen_q, max_seqlen_k); the slices select tokens along dim 0 of the varlen tensors, or are None
    for the padded layout (one group: the whole batch)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        b = q.shape[0]
        idx = torch.arange(b, dtype=torch.int64, device=q.device)
        yield idx, None, None, alibi_slopes, q.shape[1], k.shape[1]
        return
    bounds, mq, mk = _seq_bounds(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k
    )
    for bi, (q0, q1, k0, k1) in enumerate(bounds):
        per_seq = alibi_slopes is not None and alibi_slopes.dim() == 2
        slopes = alibi_slopes[bi : bi + 1] if per_seq else alibi_slopes
        idx = torch.tensor([bi], dtype=torch.int64, device=q.device)
        yield idx, slice(q0, q1), slice(k0, k1), slopes, mq, mk


def _prepare(q, k, v, kw):
    """Checks the layout and builds the Spec; returns (spec, varlen)."""
    varlen = kw["cu_seqlens_q"] is not None or kw["cu_seqlens_k"] is not None
    want = 3 if varlen else 4
    if q.dim() != want or k.dim() != want or v.dim() != want:
        layout = "(total, nheads, headdim) with cu_seqlens" if varlen else "(batch, seqlen, nheads, headdim)"
        raise FlashAttnError(
            f"q, k, v must be {want}-D {layout}; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if varlen:
        cu = kw["cu_seqlens_q"] if kw["cu_seqlens_q"] is not None else kw["cu_seqlens_k"]
        nbatch = cu.shape[0] - 1
    else:
        nbatch = q.shape[0]
        if k.shape[0] != nbatch or v.shape[0] != nbatch:
            raise FlashAttnError(f"batch mismatch: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    _check_common(q, k, v, kw["alibi_slopes"], kw["learnable_sink"], kw["dropout_p"], nbatch)
    left, right = kw["window_size"]
    spec = Spec(
        softmax_scale=float(kw["softmax_scale"]), causal=bool(kw["causal"]),
        window_size=(int(left), int(right)),
        softcap=float(kw["softcap"]), dropout_p=float(kw["dropout_p"]), rng_seed=int(kw["rng_seed"]),
        rng_offset=int(kw["rng_offset"]), cdtype=compute_dtype(q, k, v),
    )
    return spec, varlen


def _tokens(x, sl):
    """The group's view of ``x`` with a batch dim: the padded tensor itself, or ``x[sl]`` as a batch of 1."""
    return x if sl is None else x[sl].unsqueeze(0)


def _lse_view(lse, sl):
    # padded lse is (b, h, sq); varlen lse is (h, total_q)
    return lse if sl is None else lse[:, sl].unsqueeze(0)


def _fused_kind(spec, qg, kg, vg, slopes, kw):
    if not qg.dtype == kg.dtype == vg.dtype:  # (internal callers only: the public functions refuse it)
        return None
    return fused.mask_kind(spec, qg.shape[1], kg.shape[1], qg.shape[3], vg.shape[3], dtype=qg.dtype,
                           device=qg.device, alibi=slopes is not None, sink=kw["learnable_sink"] is not None)


def _tiles(spec, q, k, slopes, idx, mq, mk, kw):
    return Tiles(spec, q, k, alibi_slopes=slopes, sink=kw["learnable_sink"], batch_idx=idx,
                 max_seqlen_q=mq, max_seqlen_k=mk)


def attention_forward(
    q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    dropout_p=0.0, rng_seed=0, rng_offset=0, learnable_sink=None,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None,
):
    """Exact attention (no autograd): chunked torch operations, or ATen's fused CPU kernel for the calls it
    computes exactly (:func:`flashattn.backends.torch.fused.mask_kind`).

    Args:
        q: ``(b, sq, h, d)``, or ``(total_q, h, d)`` with cu_seqlens (varlen).
        k: ``(b, sk, hk, d)`` / ``(total_k, hk, d)``; ``h % hk == 0`` (GQA: query head i reads kv head
            ``i // (h // hk)``).
        v: like k with its own head dim ``dv``.  Any strides for q, k, v.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in
            :func:`flashattn.reference.attention_ref`; in varlen the causal/window/ALiBi alignment uses each
            sequence's own lengths, and ``(batch, h)`` slopes are indexed by sequence.
        dropout_p: probability of dropping an attention probability; the mask is
            :func:`flashattn.dropout.dropout_keep_mask` of ``(rng_seed, rng_offset)``.
        learnable_sink: ``(h,)`` float32, an extra logit per head in every row's softmax denominator.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` token offsets of each sequence; both or neither.
            Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: varlen only (ignored for the padded layout), at least every length;
            they set the dropout counter strides.  Default: the longest sequence.
        block_table: ``(batch, max_pages)`` int32, varlen only: k and v are page pools ``(num_pages,
            page_size, hk, ·)`` (:mod:`flashattn.paged`), whose keys are gathered into the packed layout.

    Returns ``(out, lse)``: out like q with head dim ``dv``, in q's dtype; lse natural log, float32 (float64
    for float64 inputs), ``(b, h, sq)`` or ``(h, total_q)`` in varlen, un-dropped.  A row that sees no key
    has out 0 and lse ``+inf``, or lse = sink with a learnable sink.
    """
    if block_table is not None:
        k, v = gather_pages(k, v, block_table, cu_seqlens_k, max_seqlen_k)
    kw = dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset,
        learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    spec, varlen = _prepare(q, k, v, kw)
    h, dv = q.shape[-2], v.shape[-1]
    out = torch.zeros(q.shape[:-1] + (dv,), dtype=q.dtype, device=q.device)
    lse_shape = (h, q.shape[0]) if varlen else (q.shape[0], h, q.shape[1])
    lse = torch.full(lse_shape, math.inf, dtype=spec.cdtype, device=q.device)
    for idx, qsl, ksl, slopes, mq, mk in _groups(q, k, v, **_group_kw(kw)):
        qg, kg, vg = _tokens(q, qsl), _tokens(k, ksl), _tokens(v, ksl)
        if qg.shape[1] == 0:
            continue
        kind = _fused_kind(spec, qg, kg, vg, slopes, kw)
        if kind is not None:
            fused.forward_fused(spec, kind, qg, kg, vg, _tokens(out, qsl), _lse_view(lse, qsl))
            continue
        tiles = _tiles(spec, qg, kg, slopes, idx, mq, mk, kw)
        forward_group(tiles, qg, kg, vg, _tokens(out, qsl), _lse_view(lse, qsl))
    return out, lse


def _dequantize(x8, descale, cu_seqlens):
    """x8 · descale in float32: descale (1,) or (batch, heads), heads dividing x8's (a group of x8's heads
    shares one); batch indexes sequences (cu_seqlens, varlen) or dim 0."""
    x = x8.float()
    if descale.numel() == 1:
        return x * descale.float().reshape(())
    d = descale.float().repeat_interleave(x8.shape[-2] // descale.shape[1], dim=1)  # (batch, x8's heads)
    if cu_seqlens is None:
        return x * d[:, None, :, None]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    per_token = d.repeat_interleave(lengths, dim=0)  # (tokens in sequences, heads)
    rows = per_token.shape[0]
    # rows past the last sequence are never attended; they keep their raw values
    return torch.cat((x[:rows] * per_token[:, :, None], x[rows:]))


def attention_forward_fp8(q, k, v, q_descale, k_descale, v_descale, *, out_dtype, softmax_scale: float,
                          causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                          max_seqlen_k=None, route=None):
    """The FP8 semantics exactly: dequantise e4m3 q, k, v with their descales, attend in float32, out in
    out_dtype (the kernels also round P to e4m3). Same signature as the Triton launcher's."""
    del route
    out, lse = attention_forward(
        _dequantize(q, q_descale, cu_seqlens_q), _dequantize(k, k_descale, cu_seqlens_k),
        _dequantize(v, v_descale, cu_seqlens_k), softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)
    return out.to(out_dtype), lse


def attention_backward(
    dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0, learnable_sink=None,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
):
    """Gradients of :func:`attention_forward` by recomputation from its ``out`` and ``lse`` (the dropout
    mask is regenerated from the same seed and offset, never stored).

    Returns ``(dq, dk, dv, dsink)``: dq, dk, dv shaped like q, k, v in their dtypes, dk/dv summed over each
    GQA group; dsink ``(h,)`` float32 (float64 for float64 inputs), or None without a learnable sink.  Rows
    that saw no key contribute nothing.  Always deterministic (sequential accumulation on either route), so
    ``deterministic`` changes nothing.
    """
    del deterministic
    kw = dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset,
        learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    spec, _ = _prepare(q, k, v, kw)
    dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    sink = kw["learnable_sink"]
    dsink = None
    if sink is not None:
        hk = k.shape[-2]
        dsink = torch.zeros(hk, q.shape[-2] // hk, dtype=spec.cdtype, device=q.device)
    for idx, qsl, ksl, slopes, mq, mk in _groups(q, k, v, **_group_kw(kw)):
        qg, kg, vg = _tokens(q, qsl), _tokens(k, ksl), _tokens(v, ksl)
        if qg.shape[1] == 0 or kg.shape[1] == 0:
            continue  # nothing to differentiate: the gradients stay 0
        kind = _fused_kind(spec, qg, kg, vg, slopes, kw)
        if kind is not None:
            fused.backward_fused(spec, kind, _tokens(dout, qsl), qg, kg, vg, _tokens(out, qsl),
                                 _lse_view(lse, qsl), _tokens(dq, qsl), _tokens(dk, ksl), _tokens(dv, ksl))
            continue
        tiles = _tiles(spec, qg, kg, slopes, idx, mq, mk, kw)
        backward_group(
            tiles, _tokens(dout, qsl), qg, kg, vg, _tokens(out, qsl), _lse_view(lse, qsl),
            _tokens(dq, qsl), _tokens(dk, ksl), _tokens(dv, ksl), dsink,
        )
    if dsink is not None:
        dsink = dsink.flatten().to(torch.float64 if spec.cdtype == torch.float64 else torch.float32)
    return dq, dk, dv, dsink


_GROUP_KEYS = ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _group_kw(kw):
    return {n: kw[n] for n in _GROUP_KEYS}
