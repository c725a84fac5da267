"""Launchers for KV-cache attention (flash_attn_with_kvcache): append + rotary, split-KV decode, combine.

Pure functions, no autograd, no argument checking beyond what the kernels need (flashattn.kvcache validates).
Shapes: q (b, sq, h, d); caches (b_cache, s_cache, h_k, d) or paged (num_pages, page_size, h_k, d) with
block_table (b, max_pages) int32; new k/v (b, s_new, h_k, d). `cache_seqlens` is an int32 (b,) tensor or
None, in which case every sequence holds `cache_len` keys. Both launchers mutate the caches in place when k/v
are given and return (out (b, sq, h, d) in q's dtype, lse (b, h, sq) float32, +inf for rows that see no key).

The kernels' tiles and split count are the route's (routes.decode_route); backends/torch/decode.py is the
same computation in plain torch.
"""

import torch

from flashattn.backends.triton import host, routes, tma
from flashattn.backends.triton.merge import merge_partials, sm_count
from flashattn.kernels.triton.decode import decode_split_kernel
from flashattn.kernels.triton.rotary import rotary_append_kernel

LOG2E = 1.4426950408889634


def _window(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) with causal folded in: causal is the window (left, 0), as in flash_attn."""
    left, right = int(window_size[0]), int(window_size[1])
    return (left, 0) if causal else (left, right)


def _capacity(k_cache, block_table) -> int:
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def _rotary_append(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_len, cache_batch_idx,
                   block_table, *, per_row: bool, interleaved: bool):
    """Rotated q (a new tensor; q itself when there is no rotary), after appending k, v to the caches."""
    b, sq, h, d = q.shape
    hk = k_cache.shape[2]
    rotate = cos is not None
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format) if rotate else q
    s_new = k.shape[1] if k is not None else 0
    rows = max(sq if rotate else 0, s_new)
    if rows == 0:
        return q_rot
    dummy = q  # pointer arguments a flag switches off are never dereferenced
    kk, vv = (k, v) if k is not None else (dummy, dummy)
    paged = block_table is not None
    rotary_append_kernel[(rows, b)](
        q, q_rot, kk, vv, k_cache, v_cache,
        cos if rotate else dummy, sin if rotate else dummy,
        cache_seqlens if cache_seqlens is not None else dummy,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        block_table if paged else dummy,
        *q.stride()[:3], *q_rot.stride()[:3], *kk.stride()[:3], *vv.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        cos.stride(0) if rotate else 0, block_table.stride(0) if paged else 0,
        h, hk, sq, s_new, cache_len,
        HEAD_DIM=d, BLOCK_D=host.block_d(d),
        BLOCK_H=host.pow2(h), BLOCK_HK=host.pow2(hk),
        ROT_DIM=2 * cos.shape[1] if rotate else 0, INTERLEAVED=bool(interleaved), Q_PER_ROW=per_row,
        ROTATE_Q=rotate, APPEND=k is not None, PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        # a (heads, d) tile and its rotated partner: keep it near 32 fp32 registers a thread each
        num_warps=min(16, max(4, host.pow2(h) * host.block_d(d) // 1024)),
    )
    return q_rot


def kvcache_forward(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                    cache_len=0, cache_batch_idx=None, cache_leftpad=None, block_table=None, *,
                    softmax_scale: float, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, rotary_interleaved: bool = True, num_splits: int = 0):
    """See the module docstring for shapes; returns (out, lse)."""
    b, sq, h, d = q.shape
    hk = k_cache.shape[2]
    window = _window(causal, window_size)
    window_on = window != (-1, -1)
    q = _rotary_append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len,
                       cache_batch_idx, block_table, per_row=window_on, interleaved=rotary_interleaved)
    spec = routes.DecodeSpec(b, h, hk, sq, d, q.element_size(), block_table is not None,
                             _capacity(k_cache, block_table), window, num_splits,
                             tma.device_facts(q.device)[0], sm_count(q.device))
    route = routes.decode_route(spec)
    cfg, block_m, num_splits = route.tiles, route.block_m, route.num_splits
    m_blocks = host.cdiv(spec.rows, block_m)
    left, right = (routes.UNBOUNDED if w < 0 else w for w in window)

    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if num_splits == 1:
        o_buf, l_buf = out, lse
        so, sl = 0, 0
    else:
        o_buf = torch.empty((num_splits, b, sq, h, d), dtype=torch.float32, device=q.device)
        l_buf = torch.empty((num_splits, b, h, sq), dtype=torch.float32, device=q.device)
        so, sl = o_buf.stride(0), l_buf.stride(0)
    o_strides = o_buf.stride()[-4:-1]
    l_strides = l_buf.stride()[-3:]

    dummy = q
    paged = block_table is not None
    alibi_stride = 0
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_stride = alibi_slopes.stride(0)
    grid = (b * hk, num_splits, m_blocks)
    decode_split_kernel[grid](
        q, k_cache, v_cache, o_buf, l_buf,
        cache_seqlens if cache_seqlens is not None else dummy,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        cache_leftpad if cache_leftpad is not None else dummy,
        block_table if paged else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        so, *o_strides, sl, *l_strides,
        block_table.stride(0) if paged else 0, alibi_stride,
        hk, sq, k.shape[1] if k is not None else 0, cache_len, num_splits,
        softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E, left, right,
        GROUP=h // hk, HEAD_DIM=d, BLOCK_D=host.block_d(d), BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged,
        HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None, WINDOW=window_on, SOFTCAP=softcap > 0,
        ALIBI_ON=alibi_slopes is not None, SPLIT=num_splits > 1, DOT_PREC=host.dot_precision(q.dtype),
        # 64-row blocks (long GQA groups, chunked prefill) hold 4x the accumulator of a decode step
        num_warps=max(cfg.num_warps, 8) if block_m >= 64 else cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        merge_partials(o_buf, l_buf, out=out, lse=lse)
    return out, lse
