"""flash_attn_with_kvcache: attention of a few new query tokens against a (paged) KV cache, for inference.

Same name, arguments, defaults and semantics as flash_attn 2.x, so `from flashattn import
flash_attn_with_kvcache` replaces `from flash_attn import flash_attn_with_kvcache`.
"""

import numbers

import torch
from torch import Tensor

from flashattn import _validate, _validate_cache
from flashattn.errors import FlashAttnError
from flashattn.ops.attention import default_scale
from flashattn.ops.kvcache import kvcache_fwd

__all__ = ["flash_attn_with_kvcache"]


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q against a KV cache, after appending new keys/values to it in place.

    For decoding (seqlen_q = 1), chunked prefill and speculative verification (a few new tokens). If k and v
    are given they are written into the cache at positions cache_seqlens[i], cache_seqlens[i] + 1, ...
    (rotated first when rotary_cos/sin are given) and attended to in the same call: sequence i then attends
    to cache positions [cache_leftpad[i], cache_seqlens[i] + seqlen_new). Inference only: no gradients.

    Causal masking is aligned to the bottom-right: query j of the new chunk sees cache positions up to
    cache_seqlens[i] + seqlen_new - seqlen_q + j. For seqlen_q = 2 and 5 attended keys:

        1 1 1 1 0
        1 1 1 1 1

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 (float32 accepted). headdim <= 256.
        k_cache: (batch_cache, seqlen_cache, nheads_k, headdim) without block_table, or the page pool
            (num_pages, page_size, nheads_k, headdim) with one; page_size a multiple of 16. Same dtype as q.
            nheads must be a multiple of nheads_k (GQA/MQA). Updated in place when k is given.
        v_cache: same shape as k_cache. Updated in place when v is given.
        k, v: (batch, seqlen_new, nheads_k, headdim), default None: new keys/values to append first.
            Both or neither.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), default None. Rotary embedding applied to q and
            to the new k (only together with k/v). rotary_dim <= headdim, even; seqlen_ro at least the cache
            capacity (seqlen_cache, or max_pages · page_size). The new k[i, j] is rotated at position
            cache_seqlens[i] + j; q[i, j] at cache_seqlens[i] + j when causal or windowed, else every query
            row at cache_seqlens[i] (as flash_attn).
        cache_seqlens: int, or (batch,) int32 tensor, default None = every sequence fills the cache
            (seqlen_cache, or max_pages · page_size keys). Keys already in each cache before the append.
        cache_batch_idx: (batch,) int32, default None = [0, 1, ..., batch - 1]. The cache row of each batch
            entry (contiguous caches only). Duplicates with k/v given leave which append wins unspecified.
        cache_leftpad: (batch,) int32, default None = 0. Index of each sequence's first real key: positions
            below it are padding, never attended. Rotary positions and the causal alignment stay absolute.
        block_table: (batch, max_pages) int32, default None. Page i of sequence b is
            k_cache[block_table[b, i]]; only the entries covering attended/appended positions are read.
        softmax_scale: float, default 1 / sqrt(headdim).
        causal: bool, default False. Bottom-right aligned (above).
        window_size: (left, right), default (-1, -1); -1 means unbounded on that side. Query j sees keys
            [j + diag - left, j + diag + right], diag = cache_seqlens + seqlen_new - seqlen_q (right = 0
            when causal).
        softcap: float, default 0.0 = off. Scores become softcap · tanh(scores / softcap).
        rotary_interleaved: bool, default True. True rotates pairs (0, 1), (2, 3), ... (GPT-J); False
            rotates (i, i + rotary_dim / 2) (GPT-NeoX).
        alibi_slopes: (nheads,) or (batch, nheads) float32, default None. Adds -slope · |j + diag - key|.
        num_splits: int, default 0 = heuristic. Number of key chunks attended in parallel and merged
            (flash-decoding). 0 fills the GPU (about 2 · SMs programs); 1 disables splitting.
        return_softmax_lse: bool, default False. Also return the log-sum-exp.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype. 0 for rows that see no key.
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log; +inf for rows
            that see no key. With the output, it is what merge_attention_states takes.

    Out-of-range indices would read or write outside the caches, so by default cache_seqlens, cache_leftpad,
    cache_batch_idx and the used block_table entries are checked against the cache shapes: one device-to-host
    copy per call (skipped while a CUDA graph is being captured). FLASHATTN_CHECK_INDICES=0 or
    flashattn.config.set_check_indices(False) turns the check off, like flash_attn, which has none.
    """
    b, sq, h, d, paged = _validate_cache.check_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                                    cache_seqlens, cache_batch_idx, cache_leftpad,
                                                    block_table, alibi_slopes)
    _validate.check_scale(softmax_scale)
    left, right = _validate.check_window(window_size)
    _validate.check_softcap(softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise FlashAttnError(f"num_splits must be an int >= 0 (0 = heuristic), got {num_splits!r}")
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)

    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    s_new = 0 if k is None else k.shape[1]
    seqlens_t, cache_len = None, capacity
    if isinstance(cache_seqlens, Tensor):
        seqlens_t = cache_seqlens
    elif cache_seqlens is not None:
        cache_len = int(cache_seqlens)
        if cache_len < 0 or cache_len + s_new > capacity:
            raise FlashAttnError(
                f"cache_seqlens={cache_len} with {s_new} new keys needs {cache_len + s_new} cache "
                f"positions; expected 0 <= cache_seqlens and cache_seqlens + seqlen_new <= {capacity} "
                f"(the cache capacity)"
            )
    elif k is not None:
        raise FlashAttnError(
            "k/v are given but cache_seqlens is None (a full cache): pass cache_seqlens, the number of keys "
            "already in each cache, so that the new keys have somewhere to go"
        )
    with torch.no_grad():
        out, lse = kvcache_fwd(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_t, cache_len, cache_batch_idx,
            cache_leftpad, block_table, scale, bool(causal), left, right, float(softcap), alibi_slopes,
            bool(rotary_interleaved), int(num_splits),
        )
    return (out, lse) if return_softmax_lse else out
