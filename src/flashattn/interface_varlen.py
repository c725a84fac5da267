"""Varlen (packed sequences) attention, drop-in compatible with flash_attn 2.x's *_varlen_* functions.

Sequences of different lengths are concatenated along the token axis; int32 cu_seqlens (batch + 1,) hold the
cumulative lengths, so sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]). Every mask (causal, window,
ALiBi distance) is applied per sequence with its own lengths; zero-length sequences are legal. See
flashattn.interface for the causal alignment and the extra keyword arguments.
"""

import torch

from flashattn import _validate, interface_fp8, paged
from flashattn.errors import FlashAttnError
from flashattn.interface import _run, check_options
from flashattn.ops.attention import attn_fwd_paged, default_scale


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None,
                 fp8: bool = False):
    """The varlen layout's checks (flash_attn_varlen_func's docstring says what is checked when); with a
    block_table, k and v are page pools, checked as one page of packed rows. Returns (max_seqlen_q,
    max_seqlen_k). fp8: e4m3 q, k, v (an FP8 call)."""
    if fp8:
        _validate.check_tensor("q", q, 3, "(total_q, nheads, headdim)", (0,), _validate.FP8_DTYPES)
    else:
        _validate.check_tensor("q", q, 3, "(total_q, nheads, headdim)", (0,))
    if block_table is None:
        _validate.check_qkv(q, k, v, varlen=True, fp8=fp8)
    # with a block_table the keys' bound is the pages' (check_paged)
    max_seqlen_q, max_seqlen_k = _validate.check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, None if block_table is not None else k)
    if block_table is not None:
        paged.check_paged(q, k, v, block_table, cu_seqlens_q.shape[0] - 1, max_seqlen_k, fp8)
        # the pools' rows as packed keys: page 0 (the heads, head dims and strides), or none
        _validate.check_qkv(q, *(t[0] if t.shape[0] else t.flatten(0, 1) for t in (k, v)), varlen=True,
                            fp8=fp8)
        paged.check_page_entries(k, block_table, cu_seqlens_k)
    return max_seqlen_q, max_seqlen_k


def paged_forward(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                  causal, window, softcap, alibi_slopes, learnable_sink):
    """(out, lse) of checked paged arguments without autograd (attn_fwd_paged: the pools read in the kernel
    where the route can, flashattn.paged); softmax_scale None: 1 / sqrt(headdim)."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    return attn_fwd_paged(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                          int(max_seqlen_k), float(scale), bool(causal), int(window[0]), int(window[1]),
                          float(softcap), alibi_slopes, learnable_sink)


def _reads_pools(q, k, v, dropout_p, return_attn_probs, learnable_sink) -> bool:
    """A paged call that runs on its pools (attn_fwd_paged, no autograd), rather than on its keys gathered
    into the packed layout (flashattn.paged): one that needs no gradient, no dropout and no probabilities."""
    if dropout_p > 0 or return_attn_probs:
        return False
    if torch.is_grad_enabled():
        for t in (q, k, v, learnable_sink):
            if t is not None and t.requires_grad:
                return False
    return True


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Attention over packed sequences.

    Arguments:
        q: (total_q, nheads, headdim), float16 / bfloat16 (float32 accepted), contiguous last dimension.
        k: (total_k, nheads_k, headdim); v: (total_k, nheads_k, headdim_v). With a block_table: page pools
            (num_pages, page_size, nheads_k, headdim[_v]), any page_size.
        cu_seqlens_q: (batch + 1,) int32, contiguous, on q's device: cumulative query lengths, starting at 0,
            non-decreasing, the last <= total_q (tokens past it are no sequence's; their rows of out are
            left unspecified). batch may be 0.
        cu_seqlens_k: (batch + 1,) int32, the same for the keys (last <= total_k).
        max_seqlen_q: int, at least the longest query sequence (sizes the grid and the dropout counters).
        max_seqlen_k: int, at least the longest key sequence.
            What is checked: the shapes, dtypes and devices always; the values above when cu_seqlens are
            CPU tensors, and CUDA ones only with flashattn.config.check_varlen on (a device-to-host copy).
            Unchecked bad values give wrong rows, never an access out of bounds: the kernels clamp every
            sequence into the packed tensors (docs/compat.md).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, learnable_sink:
            as flash_attn_func; alibi_slopes may be (batch, nheads).
        return_attn_probs: bool, default False. Also return softmax_lse and S_dmask.
        block_table: (batch, max_pages) int32, default None. Paged KV for varlen prefill: key p of sequence b
            (p < cu_seqlens_k[b + 1] - cu_seqlens_k[b]) is k[block_table[b, p // page_size], p % page_size].
            A call that needs no gradient, dropout or probabilities reads the pages in the kernel where its
            route can (16-bit, the Gluon forward, page_size a multiple of its key tile: 128 at d <= 192);
            the others first gather the keys into the packed layout (flashattn.paged), and gradients
            reach the pools through the gather.
        q_descale, k_descale, v_descale, out_dtype: as flash_attn_func's (an FP8 call), batch being the
            number of sequences; v may have its token dim (0) contiguous. With a block_table, e4m3 page
            pools (k's and v's descales per tensor or per (sequence, kv head)).

    Returns:
        out: (total_q, nheads, headdim_v), q's dtype (out_dtype for an FP8 call).
        softmax_lse (if return_attn_probs): (nheads, total_q) float32 natural log, +inf for rows that see no
            key (flash_attn's varlen layout).
        S_dmask (if return_attn_probs): as flash_attn_func's, shaped (batch, nheads, max_seqlen_q rounded up
            to 128, max_seqlen_k rounded up to 128); sequence b's entries in [b, :, :len_q, :len_k].
    """
    fp8 = interface_fp8.wanted(q, q_descale, k_descale, v_descale)
    if fp8:
        interface_fp8.check_dtypes(q, k, v)
    max_seqlen_q, max_seqlen_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              block_table, fp8)
    batch = cu_seqlens_q.shape[0] - 1
    window = check_options(q, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, learnable_sink,
                            batch)
    if block_table is not None:
        if not fp8 and _reads_pools(q, k, v, dropout_p, return_attn_probs, learnable_sink):
            if out_dtype is not None and out_dtype != q.dtype:
                raise FlashAttnError(f"out_dtype is {out_dtype}; a 16-bit call returns q's dtype ({q.dtype})")
            return paged_forward(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale, causal, window, softcap, alibi_slopes, learnable_sink)[0]
        k, v = paged.gather_pages(k, v, block_table, cu_seqlens_k)
    if fp8:
        return interface_fp8.attention(
            q, k, v, q_descale, k_descale, v_descale, out_dtype, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, return_attn_probs=return_attn_probs,
            batch=batch, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k)
    if out_dtype is not None and out_dtype != q.dtype:
        raise FlashAttnError(f"out_dtype is {out_dtype}; a 16-bit call returns q's dtype ({q.dtype})")
    return _run(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                return_attn_probs, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """flash_attn_varlen_func on a packed projection.

    Arguments:
        qkv: (total, 3, nheads, headdim), read in place.
        cu_seqlens: (batch + 1,) int32; max_seqlen: int. Other arguments as flash_attn_varlen_func.
    Returns: as flash_attn_varlen_func.
    """
    _validate.check_packed("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """flash_attn_varlen_func with k and v packed together.

    Arguments:
        q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim), read in place.
        Other arguments as flash_attn_varlen_func.
    Returns: as flash_attn_varlen_func.
    """
    _validate.check_packed("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)
