"""Argument checks of the KV-cache functions (flash_attn_with_kvcache, DecodePlan.run, and varlen with a paged
KV): the shape, dtype and device checks, which read no device value, and the opt-in range checks of the
device-side indices (one device-to-host copy).

Without the range checks a bad index value never reaches memory: the kernels clamp every index they read
(kernels/triton/decode.py, backends/torch/decode.py), so the call gives a wrong result instead of an error.

An FP8 cache holds keys and values in torch.float8_e4m3fn, with float32 descales (the real value is x_fp8 ·
descale): per tensor, shape (1,), or per sequence and KV head, shape (batch, nheads_k), indexed by q's batch
entry (FlashAttention-3's convention, cache_batch_idx or not).
"""

import numbers

import torch
from torch import Tensor

from flashattn import _validate, config
from flashattn.errors import FlashAttnError
from flashattn.fp8 import FP8


def check_index_tensor(name: str, t, b: int, q: Tensor, shape_text: str = "(batch,)") -> None:
    if not isinstance(t, Tensor):
        raise FlashAttnError(
            f"{name} must be a torch.Tensor {shape_text} of dtype torch.int32, got {type(t).__name__}"
        )
    if t.dtype != torch.int32:
        raise FlashAttnError(f"{name} has dtype {t.dtype}; expected torch.int32 (convert with "
                             ".to(torch.int32))")
    if t.device != q.device:
        raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
    if shape_text == "(batch,)":
        if tuple(t.shape) != (b,):
            raise FlashAttnError(f"{name} has shape {tuple(t.shape)}; expected ({b},) = (batch,)")
        if b > 1 and t.stride(0) != 1:
            raise FlashAttnError(f"{name} has stride {t.stride(0)}; expected a contiguous (batch,) tensor "
                                 f"(call .contiguous() on it)")


def capacity_text(k_cache: Tensor, block_table) -> str:
    """The cache capacity and where it comes from, for messages."""
    if block_table is None:
        return f"{k_cache.shape[1]} (the cache capacity: k_cache's seqlen_cache)"
    pages, page_size = block_table.shape[1], k_cache.shape[1]
    return (f"{pages * page_size} (the cache capacity: block_table's max_pages {pages} x page_size "
            f"{page_size})")


def check_block_table(block_table, b: int, q: Tensor) -> None:
    """(batch, max_pages) int32 on q's device (flash_attn_with_kvcache, and varlen with paged KV)."""
    check_index_tensor("block_table", block_table, b, q, "(batch, max_pages)")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise FlashAttnError(f"block_table has shape {tuple(block_table.shape)}; expected ({b}, max_pages) = "
                             f"(batch, max_pages)")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise FlashAttnError(f"block_table has strides {tuple(block_table.stride())}; expected a contiguous "
                             f"last dimension (call .contiguous() on it)")


def check_cache_tensor(name: str, t, layout: str) -> None:
    """_validate.check_tensor for a cache, which may also be e4m3 (an FP8 cache)."""
    if not isinstance(t, Tensor) or t.dtype != FP8:
        if isinstance(t, Tensor) and t.is_floating_point() and t.element_size() == 1:
            raise FlashAttnError(f"{name} has dtype {t.dtype}; an FP8 cache is {FP8} (e4m3), with "
                                 f"k_descale and v_descale")
        _validate.check_tensor(name, t, 4, layout)
        return
    # the checks check_tensor makes of a 16-bit cache, but the dtype's
    if t.dim() != 4:
        raise FlashAttnError(f"{name} must have 4 dimensions {layout}, got {t.dim()} (shape "
                             f"{tuple(t.shape)})")
    if 0 in t.shape:
        raise FlashAttnError(f"{name} is empty (shape {tuple(t.shape)}); expected {layout} with every "
                             f"dimension >= 1")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise FlashAttnError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                             f"{tuple(t.stride())}; call .contiguous() on it")


def check_descale(name: str, descale, b: int, hk: int, q: Tensor) -> None:
    """A descale of an FP8 cache: float32 (1,) or (batch, nheads_k), on q's device (any strides)."""
    if not isinstance(descale, Tensor) or descale.dtype != torch.float32:
        got = f"dtype {descale.dtype}" if isinstance(descale, Tensor) else type(descale).__name__
        raise FlashAttnError(f"{name} must be a float32 tensor of shape (1,) or ({b}, {hk}) = (batch, "
                             f"nheads_k), got {got}")
    if tuple(descale.shape) not in ((1,), (b, hk)):
        raise FlashAttnError(f"{name} has shape {tuple(descale.shape)}; expected (1,) (per tensor) or "
                             f"({b}, {hk}) = (batch, nheads_k) (per sequence and KV head)")
    if descale.device != q.device:
        raise FlashAttnError(f"{name} is on {descale.device} but q is on {q.device}; they must share a "
                             f"device")


def _check_cache_dtypes(q, k_cache, v_cache, k_descale, v_descale, b: int) -> None:
    """Both caches in q's dtype without descales, or both e4m3 with both descales."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (q.dtype, FP8):
            raise FlashAttnError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must share a dtype "
                                 f"(or the cache be {FP8}, with k_descale and v_descale)")
    if k_cache.dtype != v_cache.dtype:
        raise FlashAttnError(f"v_cache has dtype {v_cache.dtype} but k_cache {k_cache.dtype}; an FP8 cache "
                             f"holds both keys and values in {FP8}")
    if k_cache.dtype == FP8:
        for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
            if descale is None:
                raise FlashAttnError(f"{name} is None but the cache is {FP8}: an FP8 cache needs k_descale "
                                     f"and v_descale, float32 (1,) or ({b}, {k_cache.shape[2]}) (real value "
                                     f"= x_fp8 · descale; flashattn.fp8.quantize makes them)")
            check_descale(name, descale, b, k_cache.shape[2], q)
        return
    for name, descale in (("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is not None:
            raise FlashAttnError(f"{name} is given but the cache has dtype {k_cache.dtype}; descales go with "
                                 f"an FP8 cache ({FP8}) only")


def check_args(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, alibi_slopes, key_mask=None, k_descale=None, v_descale=None):
    """The checks that read shapes, dtypes and devices only; returns (batch, seqlen_q, nheads, headdim,
    paged)."""
    paged = block_table is not None
    cache_layout = ("(num_pages, page_size, nheads_k, headdim)" if paged
                    else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _validate.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    check_cache_tensor("k_cache", k_cache, cache_layout)
    check_cache_tensor("v_cache", v_cache, cache_layout)
    b, sq, h, d = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
    if v_cache.shape != k_cache.shape:
        raise FlashAttnError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache {tuple(k_cache.shape)}; "
                             f"they must match")
    hk = k_cache.shape[2]
    _check_cache_dtypes(q, k_cache, v_cache, k_descale, v_descale, b)
    if k_cache.shape[3] != d:
        raise FlashAttnError(f"k_cache has headdim {k_cache.shape[3]} but q has {d}; they must match")
    if d > _validate.MAX_HEADDIM:
        raise FlashAttnError(f"q has headdim {d}; headdim must be at most {_validate.MAX_HEADDIM}")
    if h % hk != 0:
        raise FlashAttnError(
            f"k_cache has {hk} heads but q has {h}; nheads must be a multiple of nheads_k (GQA/MQA)"
        )

    if paged:
        check_block_table(block_table, b, q)
        page_size = k_cache.shape[1]
        if page_size % 16 != 0:
            raise FlashAttnError(
                f"k_cache has page_size {page_size} (dim 1 of a paged cache); expected a multiple of 16"
            )
        if cache_batch_idx is not None:
            raise FlashAttnError("cache_batch_idx is not supported with a paged cache (block_table): map "
                                 "batch entries to pages through block_table instead")
    elif cache_batch_idx is None and k_cache.shape[0] < b:
        raise FlashAttnError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {b}; expected "
                             f"batch_cache >= batch, or a cache_batch_idx")

    if (k is None) != (v is None):
        raise FlashAttnError("k and v must be given together (both new keys and values, or neither)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _validate.check_tensor(name, t, 4, "(batch, seqlen_new, nheads_k, headdim)")
            if t.dtype != q.dtype:
                raise FlashAttnError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must share a "
                                     "dtype")
            if t.device != q.device:
                raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; they must share a "
                                     "device")
            if (t.shape[0], t.shape[2], t.shape[3]) != (b, hk, d):
                raise FlashAttnError(
                    f"{name} has shape {tuple(t.shape)}; expected ({b}, seqlen_new, {hk}, {d}) = "
                    f"(batch, seqlen_new, nheads_k, headdim)"
                )
        if v.shape[1] != k.shape[1]:
            raise FlashAttnError(f"v has seqlen_new {v.shape[1]} but k has {k.shape[1]}; they must match")
        capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
        if k.shape[1] > capacity:
            raise FlashAttnError(f"k has seqlen_new {k.shape[1]}; expected at most "
                                 f"{capacity_text(k_cache, block_table)}")

    if isinstance(cache_seqlens, Tensor):
        check_index_tensor("cache_seqlens", cache_seqlens, b, q)
    elif cache_seqlens is not None and (isinstance(cache_seqlens, bool)
                                        or not isinstance(cache_seqlens, numbers.Integral)):
        raise FlashAttnError(f"cache_seqlens must be an int or a (batch,) int32 tensor, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_batch_idx is not None:
        check_index_tensor("cache_batch_idx", cache_batch_idx, b, q)
    if cache_leftpad is not None:
        check_index_tensor("cache_leftpad", cache_leftpad, b, q)

    if (cos is None) != (sin is None):
        raise FlashAttnError("rotary_cos and rotary_sin must be given together")
    if cos is not None:
        if k is None:
            raise FlashAttnError(
                "rotary_cos/rotary_sin are given without k/v: rotary is applied to q and the new keys "
                "together; pass the new k and v, or rotate q yourself"
            )
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            _validate.check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
            if t.device != q.device:
                raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; they must share a "
                                     "device")
        if sin.shape != cos.shape:
            raise FlashAttnError(f"rotary_sin has shape {tuple(sin.shape)} but rotary_cos "
                                 f"{tuple(cos.shape)}; they must match")
        if 2 * cos.shape[1] > d:
            raise FlashAttnError(f"rotary_cos has {cos.shape[1]} columns, i.e. rotary_dim "
                                 f"{2 * cos.shape[1]}; expected rotary_dim <= headdim = {d}")
        capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
        if cos.shape[0] < capacity:
            raise FlashAttnError(f"rotary_cos has {cos.shape[0]} rows (seqlen_ro); expected at least the "
                                 f"cache capacity {capacity}, the last position a key can take")

    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or alibi_slopes.dtype != torch.float32:
            got = alibi_slopes.dtype if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
            raise FlashAttnError(f"alibi_slopes must be a float32 tensor of shape ({h},) or ({b}, {h}), "
                                 f"got {got}")
        if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
            raise FlashAttnError(
                f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({h},) or ({b}, {h})"
            )
        if alibi_slopes.device != q.device or alibi_slopes.stride(-1) != 1:
            raise FlashAttnError(f"alibi_slopes must be on {q.device} with a contiguous last dim, got "
                                 f"{alibi_slopes.device}, strides {tuple(alibi_slopes.stride())}")
    if key_mask is not None:
        capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
            raise FlashAttnError(f"key_padding_mask must be a torch.bool tensor of shape ({b}, {capacity}) = "
                                 f"(batch, cache capacity), got {got}")
        if tuple(key_mask.shape) != (b, capacity):
            raise FlashAttnError(f"key_padding_mask has shape {tuple(key_mask.shape)}; expected ({b}, "
                                 f"{capacity}) = (batch, {capacity_text(k_cache, block_table)})")
        if key_mask.device != q.device or (capacity > 1 and key_mask.stride(1) != 1):
            raise FlashAttnError(f"key_padding_mask must be on {q.device} with a contiguous last dim, got "
                                 f"{key_mask.device}, strides {tuple(key_mask.stride())}")
    return b, sq, h, d, paged


def checks_enabled(t: Tensor, requested: bool | None = None) -> bool:
    """Whether the device-side index checks run for tensors like t: `requested` (a call's check_inputs), or
    when None flashattn.config's check_indices."""
    if not (config.check_indices if requested is None else requested):
        return False
    # a device-to-host copy is illegal while a CUDA graph is being captured
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_indices(q, k_cache, k, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad, block_table):
    """Range checks of the device-side indices, with one device-to-host copy for all of them (the caller
    asks checks_enabled first)."""
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
        raise FlashAttnError(
            f"cache_seqlens[{i}] = {int(starts[i])} with {s_new} new keys needs {int(ends[i])} cache "
            f"positions; expected 0 <= cache_seqlens and cache_seqlens + seqlen_new <= "
            f"{capacity_text(k_cache, block_table)}"
        )
    if bad[1]:
        i = int(((lo < 0) | (lo > starts)).nonzero()[0, 0])
        raise FlashAttnError(f"cache_leftpad[{i}] = {int(lo[i])}; expected 0 <= cache_leftpad <= "
                             f"cache_seqlens = {int(starts[i])}")
    if cache_batch_idx is not None and bad[2]:
        i = int(flags[2].nonzero()[0, 0])
        raise FlashAttnError(f"cache_batch_idx[{i}] = {int(cache_batch_idx[i])}; expected a cache row in "
                             f"[0, {k_cache.shape[0]})")
    if paged and bad[-1]:
        i, j = (int(x) for x in bad_pages.nonzero()[0])
        raise FlashAttnError(
            f"block_table[{i}, {j}] = {int(block_table[i, j])} but the cache has {k_cache.shape[0]} pages; "
            f"expected entries in [0, {k_cache.shape[0]}) for every page sequence {i} uses "
            f"(positions [{int(lo[i])}, {int(ends[i])}), page_size {k_cache.shape[1]})"
        )
