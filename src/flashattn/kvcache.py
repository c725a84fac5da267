"""flash_attn_with_kvcache: attention of a few new query tokens against a (paged) KV cache, for inference.

Same name, arguments, defaults and semantics as flash_attn 2.x, so `from flashattn import
flash_attn_with_kvcache` replaces `from flash_attn import flash_attn_with_kvcache`.
"""

import numbers

import torch
from torch import Tensor

from flashattn import _env, _validate
from flashattn.backend import backend_name
from flashattn.ops.attention import default_scale

__all__ = ["flash_attn_with_kvcache"]


def _kvcache_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
    rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor | None, cache_len: int,
    cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, block_table: Tensor | None,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None, rotary_interleaved: bool, num_splits: int,
) -> tuple[Tensor, Tensor]:
    # the index checks read device values: here, inside the op, they stay out of torch.compile's graph
    _check_indices(q, k_cache, k, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad, block_table)
    if backend_name(q) == "triton":
        from flashattn.ops.decode import kvcache_forward as forward
    else:
        from flashattn.ops.decode import kvcache_forward_torch as forward
    return forward(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        rotary_interleaved=rotary_interleaved, num_splits=num_splits,
    )


# Registered as a custom op (it mutates the caches) so that torch.compile(fullgraph=True) traces through it.
# Eager calls skip the op: for an op that mutates its inputs, torch's dispatch re-binds the 20-argument schema
# on every call, O(args²) in Python (~0.1-0.3 ms measured, more than a whole decode step at 4K keys).
kvcache_fwd = torch.library.custom_op(
    "flashattn::kvcache_fwd", _kvcache_impl, mutates_args=("k_cache", "v_cache")
)


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
      cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
      rotary_interleaved, num_splits):
    b, sq, h, d = q.shape
    # contiguous, as the real op allocates them
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


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
    copy per call (skipped while a CUDA graph is being captured). FLASHATTN_CHECK_INDICES=0 turns the check
    off, like flash_attn, which has none.
    """
    b, sq, h, d, paged = _check_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                     cache_batch_idx, cache_leftpad, block_table, alibi_slopes)
    _validate.check_scale(softmax_scale)
    left, right = _validate.check_window(window_size)
    _validate.check_softcap(softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic), got {num_splits!r}")
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)

    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    s_new = 0 if k is None else k.shape[1]
    seqlens_t, cache_len = None, capacity
    if isinstance(cache_seqlens, Tensor):
        seqlens_t = cache_seqlens
    elif cache_seqlens is not None:
        cache_len = int(cache_seqlens)
        if cache_len < 0 or cache_len + s_new > capacity:
            raise ValueError(
                f"cache_seqlens={cache_len} with {s_new} new keys needs {cache_len + s_new} cache "
                f"positions; expected 0 <= cache_seqlens and cache_seqlens + seqlen_new <= {capacity} "
                f"(the cache capacity)"
            )
    elif k is not None:
        raise ValueError(
            "k/v are given but cache_seqlens is None (a full cache): pass cache_seqlens, the number of keys "
            "already in each cache, so that the new keys have somewhere to go"
        )
    op = kvcache_fwd if torch.compiler.is_compiling() else _kvcache_impl
    with torch.no_grad():
        out, lse = op(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_t, cache_len, cache_batch_idx,
            cache_leftpad, block_table, scale, bool(causal), left, right, float(softcap), alibi_slopes,
            bool(rotary_interleaved), int(num_splits),
        )
    return (out, lse) if return_softmax_lse else out


def _check_index_tensor(name: str, t, b: int, q: Tensor, shape_text: str = "(batch,)") -> None:
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor {shape_text} of dtype torch.int32, got {type(t).__name__}"
        )
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.int32 (convert with .to(torch.int32))")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
    if shape_text == "(batch,)" and tuple(t.shape) != (b,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({b},) = (batch,)")


def check_block_table(block_table, b: int, q: Tensor) -> None:
    """(batch, max_pages) int32 on q's device (flash_attn_with_kvcache, and varlen with paged KV)."""
    _check_index_tensor("block_table", block_table, b, q, "(batch, max_pages)")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected ({b}, max_pages) = "
                         f"(batch, max_pages)")


def _check_args(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes):
    paged = block_table is not None
    cache_layout = ("(num_pages, page_size, nheads_k, headdim)" if paged
                    else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _validate.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _validate.check_tensor("k_cache", k_cache, 4, cache_layout)
    _validate.check_tensor("v_cache", v_cache, 4, cache_layout)
    b, sq, h, d = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must share a dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache {tuple(k_cache.shape)}; "
                         f"they must match")
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache has headdim {k_cache.shape[3]} but q has {d}; they must match")
    if d > _validate.MAX_HEADDIM:
        raise ValueError(f"q has headdim {d}; headdim must be at most {_validate.MAX_HEADDIM}")
    if h % hk != 0:
        raise ValueError(
            f"k_cache has {hk} heads but q has {h}; nheads must be a multiple of nheads_k (GQA/MQA)"
        )

    if paged:
        check_block_table(block_table, b, q)
        page_size = k_cache.shape[1]
        if page_size % 16 != 0:
            raise ValueError(
                f"k_cache has page_size {page_size} (dim 1 of a paged cache); expected a multiple of 16"
            )
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is not supported with a paged cache (block_table): map batch "
                             "entries to pages through block_table instead")
    elif cache_batch_idx is None and k_cache.shape[0] < b:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {b}; expected "
                         f"batch_cache >= batch, or a cache_batch_idx")

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (both new keys and values, or neither)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _validate.check_tensor(name, t, 4, "(batch, seqlen_new, nheads_k, headdim)")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must share a dtype")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
            if (t.shape[0], t.shape[2], t.shape[3]) != (b, hk, d):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected ({b}, seqlen_new, {hk}, {d}) = "
                    f"(batch, seqlen_new, nheads_k, headdim)"
                )
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"v has seqlen_new {v.shape[1]} but k has {k.shape[1]}; they must match")

    if isinstance(cache_seqlens, Tensor):
        _check_index_tensor("cache_seqlens", cache_seqlens, b, q)
    elif cache_seqlens is not None and (isinstance(cache_seqlens, bool)
                                        or not isinstance(cache_seqlens, numbers.Integral)):
        raise TypeError(f"cache_seqlens must be an int or a (batch,) int32 tensor, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_batch_idx is not None:
        _check_index_tensor("cache_batch_idx", cache_batch_idx, b, q)
    if cache_leftpad is not None:
        _check_index_tensor("cache_leftpad", cache_leftpad, b, q)

    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if cos is not None:
        if k is None:
            raise ValueError(
                "rotary_cos/rotary_sin are given without k/v: rotary is applied to q and the new keys "
                "together; pass the new k and v, or rotate q yourself"
            )
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            _validate.check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
        if sin.shape != cos.shape:
            raise ValueError(f"rotary_sin has shape {tuple(sin.shape)} but rotary_cos {tuple(cos.shape)}; "
                             f"they must match")
        if 2 * cos.shape[1] > d:
            raise ValueError(f"rotary_cos has {cos.shape[1]} columns, i.e. rotary_dim {2 * cos.shape[1]}; "
                             f"expected rotary_dim <= headdim = {d}")
        capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
        if cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos has {cos.shape[0]} rows (seqlen_ro); expected at least the cache "
                             f"capacity {capacity}, the last position a key can take")

    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or alibi_slopes.dtype != torch.float32:
            got = alibi_slopes.dtype if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
            raise TypeError(f"alibi_slopes must be a float32 tensor of shape ({h},) or ({b}, {h}), got {got}")
        if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
            raise ValueError(
                f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({h},) or ({b}, {h})"
            )
        if alibi_slopes.device != q.device or alibi_slopes.stride(-1) != 1:
            raise ValueError(f"alibi_slopes must be on {q.device} with a contiguous last dim, got "
                             f"{alibi_slopes.device}, strides {tuple(alibi_slopes.stride())}")
    return b, sq, h, d, paged


def _checks_enabled(t: Tensor) -> bool:
    if _env.get("FLASHATTN_CHECK_INDICES", "1").strip() == "0":
        return False
    # a device-to-host copy is illegal while a CUDA graph is being captured
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_indices(q, k_cache, k, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad, block_table):
    """Range checks of the device-side indices, with one device-to-host copy for all of them."""
    if not _checks_enabled(q):
        return
    if cache_seqlens is None and cache_batch_idx is None and cache_leftpad is None and block_table is None:
        return
    b = q.shape[0]
    s_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    if cache_seqlens is not None:
        starts = cache_seqlens.long()
    else:
        starts = torch.full((b,), cache_len, device=q.device)
    lo = cache_leftpad.long() if cache_leftpad is not None else torch.zeros_like(starts)
    ends = starts + s_new
    flags = [(starts < 0) | (ends > capacity), (lo < 0) | (lo > starts)]
    if cache_batch_idx is not None:
        flags.append((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0]))
    if paged:
        page_size = k_cache.shape[1]
        cols = torch.arange(block_table.shape[1], device=q.device).view(1, -1)
        first, last = lo // page_size, (ends + page_size - 1) // page_size
        used = (cols >= first.view(-1, 1)) & (cols < last.view(-1, 1))
        bad_pages = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        flags.append(bad_pages.any(dim=1))
    bad = torch.stack([f.any() for f in flags]).tolist()
    if not any(bad):
        return
    # the error path: precise messages, more copies are fine here
    if bad[0]:
        i = int(((starts < 0) | (ends > capacity)).nonzero()[0, 0])
        raise ValueError(
            f"cache_seqlens[{i}] = {int(starts[i])} with {s_new} new keys needs {int(ends[i])} cache "
            f"positions; expected 0 <= cache_seqlens and cache_seqlens + seqlen_new <= {capacity} "
            f"(the cache capacity)"
        )
    if bad[1]:
        i = int(((lo < 0) | (lo > starts)).nonzero()[0, 0])
        raise ValueError(f"cache_leftpad[{i}] = {int(lo[i])}; expected 0 <= cache_leftpad <= cache_seqlens "
                         f"= {int(starts[i])}")
    if cache_batch_idx is not None and bad[2]:
        i = int(flags[2].nonzero()[0, 0])
        raise ValueError(f"cache_batch_idx[{i}] = {int(cache_batch_idx[i])}; expected a cache row in "
                         f"[0, {k_cache.shape[0]})")
    if paged and bad[-1]:
        i, j = (int(x) for x in bad_pages.nonzero()[0])
        raise ValueError(
            f"block_table[{i}, {j}] = {int(block_table[i, j])} but the cache has {k_cache.shape[0]} pages; "
            f"expected entries in [0, {k_cache.shape[0]}) for every page sequence {i} uses "
            f"(positions [{int(lo[i])}, {int(ends[i])}), page_size {k_cache.shape[1]})"
        )
