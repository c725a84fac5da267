"""The one adapter between flashattn.distributed and the single-device attention.

Every call into the single-device kernels goes through this module, so that when the package's internals
move, only this file changes. Three entry points:

* :func:`forward` / :func:`backward`: the launcher-level pure functions (tensors in, tensors out, no
  autograd) of whichever backend serves the tensors (Triton kernels on CUDA or under TRITON_INTERPRET=1, the
  chunked PyTorch backend otherwise, ``flashattn.config``'s backend forcing one). The ring's autograd.Function
  calls them once per (query block, key block).
* :func:`attention`: the public, differentiable ``flash_attn_func`` (with its torch.compile-traceable
  custom op), for Ulysses, which runs whole sequences locally and needs no custom backward.

Conventions here differ from the public API in one place: :func:`forward` returns LSE ``−inf`` for a row
that sees no key (a partial result that weighs nothing in a merge), where the public functions return
``+inf``. :func:`backward` takes the *final* LSE (over all keys, ``+inf`` for rows that see none).
"""

from __future__ import annotations

import math

import torch

from flashattn.backends import entry


def _varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    if cu_seqlens_q is None:
        return {}
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                max_seqlen_k=int(max_seqlen_k))


def forward(q, k, v, *, softmax_scale: float, causal: bool, window_size: tuple[int, int], softcap: float,
            alibi_slopes, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Attention of one block, no sink, no dropout, no autograd.

    Args:
        q: ``(b, m, h, d)``, or varlen ``(total_q, h, d)`` with ``cu_seqlens_q``; any strides with a
            contiguous last dimension; fp16 / bf16 / fp32.
        k, v: ``(b, n, h_k, d)`` / ``(b, n, h_k, d_v)``, varlen ``(total_k, h_k, ·)``; ``h % h_k == 0``.
        softmax_scale: float, the scale of ``q·k``.
        causal: bool, bottom-right aligned on this block.
        window_size: ``(left, right)`` ints ``>= −1`` (−1 unbounded), bottom-right aligned on this block.
        softcap: float ``>= 0`` (0 = off).
        alibi_slopes: None, or float32 ``(h,)`` / ``(b, h)``; distance ``|i + n − m − j|`` on this block.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` for the varlen layout, else None.
        max_seqlen_q, max_seqlen_k: ints, the longest sequence of each (varlen only).

    Returns:
        out: like q with v's head dim, q's dtype.
        lse: float32 ``(b, h, m)`` (varlen ``(h, total_q)``), natural log; ``−inf`` where the row sees no key.
    """
    out, lse = entry(q).attention_forward(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=0.0, rng_seed=0, rng_offset=0, learnable_sink=None,
        **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )
    lse = lse.float()
    # the backends mark an empty row +inf (flash_attn's public convention); a partial uses -inf
    return out, lse.masked_fill_(torch.isposinf(lse), -math.inf)


def backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, window_size: tuple[int, int],
             softcap: float, alibi_slopes, deterministic: bool, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None):
    """Gradients of one block by recomputation against the final statistics.

    Args:
        dout: like out, the gradient of the final output rows of this block.
        q, k, v, and the options: as :func:`forward` got them for this block.
        out: the *final* output rows (q's dtype): the kernels take ``D = rowsum(dout ∘ out)`` from it, which
            is the full softmax's D only when out is the merged result over every key.
        lse: float32, the *final* LSE of these rows (``+inf`` where the row sees no key at all); any strides.
        deterministic: bool, the kernels' atomic-free backward.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v in their dtypes; dk/dv summed over each GQA group. Rows that see
        no key of this block contribute nothing.
    """
    # the Triton launcher sizes a scratch buffer like lse but indexes it with lse's strides: give it a
    # contiguous one
    lse = lse.contiguous()
    dq, dk, dv, _ = entry(q).attention_backward(
        dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=0.0, rng_seed=0, rng_offset=0,
        learnable_sink=None, deterministic=deterministic,
        **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )
    return dq, dk, dv


def attention(q, k, v, *, softmax_scale: float, causal: bool, window_size: tuple[int, int], softcap: float,
              alibi_slopes, learnable_sink, deterministic: bool):
    """``(out, lse)`` of the public, differentiable ``flashattn.flash_attn_func`` (its custom op under
    torch.compile): full local sequences, ``(b, s, h, d)``; lse ``(b, h, s)`` float32, ``+inf`` for rows that
    see no key, not differentiable."""
    from flashattn import flash_attn_func  # the package imports this module's package lazily

    out, lse, _ = flash_attn_func(
        q, k, v, 0.0, softmax_scale, causal, tuple(window_size), softcap, alibi_slopes, deterministic,
        True, learnable_sink=learnable_sink,
    )
    return out, lse
