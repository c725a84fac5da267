"""Launchers for KV-cache attention (flash_attn_with_kvcache): append + rotary, split-KV decode, combine.

Pure functions, no autograd, no argument checking beyond what the kernels need (flashattn.kvcache validates).
Shapes: q (b, sq, h, d); caches (b_cache, s_cache, h_k, d) or paged (num_pages, page_size, h_k, d) with
block_table (b, max_pages) int32; new k/v (b, s_new, h_k, d). `cache_seqlens` is an int32 (b,) tensor or
None, in which case every sequence holds `cache_len` keys. Both launchers mutate the caches in place when k/v
are given and return (out (b, sq, h, d) in q's dtype, lse (b, h, sq) float32, +inf for rows that see no key).

`kvcache_forward` runs the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1); `kvcache_forward_torch`
is the same computation in plain torch (gather, append, rotate, then the chunked torch backend per sequence).
"""

import functools
import math

import torch

from flashattn import _env, torch_backend
from flashattn.kernels.decode import decode_split_kernel
from flashattn.kernels.rotary import rotary_append_kernel
from flashattn.ops import host
from flashattn.ops.configs import TileConfig, _overrides
from flashattn.ops.merge import merge_partials, sm_count

LOG2E = 1.4426950408889634
_UNBOUNDED = 1 << 30  # a window side of -1 becomes this: no branch in the kernel, no int32 overflow
_MAX_SPLITS = 128


_SMEM_BUDGET = 200 * 1024  # bytes of K/V stage buffers; the H200 gives a block up to 227 KiB


def decode_config(block_d: int, elem_size: int, paged: bool, device: torch.device, rows: int = 1,
                  kv_programs: int = 1, sms: int = 132) -> TileConfig:
    """Tiles of the split kernel for `rows` packed query rows (GQA group x seqlen_q) in each of `kv_programs`
    (batch, kv head) pairs, on a GPU of `sms` multiprocessors: a paged cache read by more programs (before
    splitting) than one_wave allows takes narrower key tiles."""
    env = _env.get("FLASHATTN_CONFIG", "")
    cfg = _decode_config(block_d, elem_size, paged, device.type, env)
    # the block_m cap does not depend on the program count: it sets the query blocks that are counted
    programs = kv_programs * host.cdiv(rows, query_block(rows, cfg.block_m))
    if paged and not one_wave(programs, sms):
        cfg = _decode_config(block_d, elem_size, paged, device.type, env, True)
    return cfg


@functools.cache
def _decode_config(block_d: int, elem_size: int, paged: bool, device_type: str, env: str,
                   many_programs: bool = False) -> TileConfig:
    """Tiles of the split kernel. block_m caps the packed query rows per program (the real BLOCK_M is the
    next power of two of group·seqlen_q, at least 16, at most this); block_n is the key tile.

    A paged cache gets two more pipeline stages: the block-table read feeding each K/V load is pipelined
    too, and with the contiguous stage count the K/V tiles end up single-buffered (sm_90 TTGIR of Triton 3.6:
    3 and 4 stages give one K/V buffer, 5 give two). With many programs (more than one_wave allows: batch 16
    x 8 KV heads) a paged cache reads faster through 64-key tiles: +3% to +10% at batch 16 in two H200
    sweeps (benchmarks/NOTES.md v16), where at batch 1 (16 splits) they lost up to 16%; contiguous caches
    showed no such pattern. Only where it was measured: 16-bit caches at head dim 128 (others keep their
    tiles). FLASHATTN_CONFIG="decode=64,128,4,3;decode_paged=64,128,4,5" overrides them.
    """
    del env  # a cache key: _overrides() reads the same variable
    override = _overrides().get("decode_paged" if paged else "decode")
    if override is not None:
        return override
    if device_type != "cuda":
        # key tiles of 32 against pages of 16: the CPU tests gather tiles across page boundaries
        return TileConfig(32, 32, 4, 1)
    block_n = 128 if block_d <= 128 else 64
    if many_programs and block_d == 128 and elem_size == 2:
        block_n = 64
    if elem_size > 2:
        block_n //= 2
    extra = 2 if paged else 0
    stages = (3 if block_d <= 128 else 2) + extra
    # stages - 1 - extra buffers of a K and a V tile are in flight
    while stages > 2 + extra and (stages - 1 - extra) * 2 * block_n * block_d * elem_size > _SMEM_BUDGET:
        stages -= 1
    # fp32 tiles spill at 4 warps (ptxas, sm_90a); 8 warps halve the registers each thread holds
    return TileConfig(64, block_n, 8 if elem_size > 2 else 4, stages)


def query_block(rows: int, cap: int) -> int:
    """BLOCK_M of the split kernel for `rows` packed query rows (GQA group x seqlen_q): their next power of
    two, at least 16 (the smallest tl.dot), at most the config's cap."""
    return min(max(16, host.pow2(rows)), max(16, cap))


def one_wave(programs: int, sms: int) -> bool:
    """Few enough programs that splitting the keys fills one wave of the GPU with 2 or more splits each."""
    return sms // max(programs, 1) >= 2


def num_splits_heuristic(programs: int, n_tiles: int, sms: int) -> int:
    """Splits of the key range, from the programs there are without splitting.

    programs: (batch, kv head, query block) programs without splitting; n_tiles: key tiles of the longest
    sequence (a split gets at least one). When one_wave: floor(SMs / programs) splits (the H200 sweep,
    benchmarks/NOTES.md v15, found one wave of longer splits 5-21% faster than two waves at batch 1: fewer
    partial results to combine, no second-wave tail). Otherwise about two waves, ceil(2·SMs / programs), and
    none from 2·SMs programs on. Always within [1, min(n_tiles, 128)].
    """
    if programs >= 2 * sms:
        return 1
    splits = sms // programs if one_wave(programs, sms) else math.ceil(2 * sms / programs)
    return max(1, min(splits, n_tiles, _MAX_SPLITS))


def _window(causal: bool, window_size) -> tuple[bool, int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0  # causal is the window (left, 0), as in flash_attn
    on = left >= 0 or right >= 0
    return on, (left if left >= 0 else _UNBOUNDED), (right if right >= 0 else _UNBOUNDED)


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
    """Triton path. See the module docstring for shapes; returns (out, lse)."""
    b, sq, h, d = q.shape
    hk = k_cache.shape[2]
    group = h // hk
    window_on, left, right = _window(causal, window_size)
    q = _rotary_append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len,
                       cache_batch_idx, block_table, per_row=window_on, interleaved=rotary_interleaved)

    block_d = host.block_d(d)
    rows = sq * group
    sms = sm_count(q.device)
    cfg = decode_config(block_d, q.element_size(), block_table is not None, q.device, rows, b * hk, sms)
    block_m = query_block(rows, cfg.block_m)
    m_blocks = host.cdiv(rows, block_m)
    span = _capacity(k_cache, block_table)
    if window_on:
        # a query block spans at most this many query positions, each seeing left + right + 1 keys
        span = min(span, left + right + min(sq, host.cdiv(block_m, group) + 1))
    n_tiles = max(1, host.cdiv(span, cfg.block_n) + 1)  # + 1: the span need not start on a tile
    if num_splits <= 0:
        num_splits = num_splits_heuristic(b * hk * m_blocks, n_tiles, sms)
    num_splits = max(1, min(num_splits, n_tiles))

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
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
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


# ----------------------------------------------------------------------------------------------------------
# plain torch


def rotary_torch(x, cos, sin, positions, interleaved: bool):
    """x (b, s, heads, d) rotated on its first 2·cos.shape[1] dims at positions (b, s) (long), in fp32."""
    rd = 2 * cos.shape[1]
    c = cos.float()[positions].unsqueeze(2)  # (b, s, 1, rd/2)
    s = sin.float()[positions].unsqueeze(2)
    xf = x.float()
    xr, rest = xf[..., :rd], xf[..., rd:]
    if interleaved:
        a, bb = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - bb * s, bb * c + a * s), dim=-1).flatten(-2)
    else:
        a, bb = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((a * c - bb * s, bb * c + a * s), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def _slots(k_cache, block_table, rows, positions):
    """(first index, second index) of cache positions (b, s) for advanced indexing of the cache."""
    if block_table is None:
        return rows.view(-1, 1).expand_as(positions), positions
    page_size = k_cache.shape[1]
    pages = torch.gather(block_table.long(), 1, positions // page_size)
    return pages, positions % page_size


def _gather(cache, block_table, row: int, lo: int, end: int):
    """(end - lo, h_k, d) keys of one sequence."""
    if block_table is None:
        return cache[row, lo:end]
    page_size = cache.shape[1]
    pages = block_table[row, : -(-end // page_size)].long()
    return cache[pages].flatten(0, 1)[lo:end]


def kvcache_forward_torch(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                          cache_seqlens=None, cache_len=0, cache_batch_idx=None, cache_leftpad=None,
                          block_table=None, *, softmax_scale: float, causal: bool = False,
                          window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                          rotary_interleaved: bool = True, num_splits: int = 0):
    """Plain-torch path (same arguments as kvcache_forward; num_splits is irrelevant here)."""
    del num_splits
    b, sq, h, d = q.shape
    dev = q.device
    starts = (cache_seqlens.long() if cache_seqlens is not None
              else torch.full((b,), cache_len, dtype=torch.long, device=dev))
    rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=dev)
    window_on = causal or tuple(window_size) != (-1, -1)
    s_new = k.shape[1] if k is not None else 0
    if rotary_cos is not None:
        q_pos = starts.view(-1, 1) + torch.arange(sq, device=dev) * int(window_on)
        q = rotary_torch(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved).to(q.dtype)
    if k is not None:
        pos = starts.view(-1, 1) + torch.arange(s_new, device=dev)  # (b, s_new)
        if rotary_cos is not None:
            k = rotary_torch(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
        first, second = _slots(k_cache, block_table, rows, pos)
        k_cache[first, second] = k.to(k_cache.dtype)
        v_cache[first, second] = v.to(v_cache.dtype)

    out = torch.zeros((b, sq, h, d), dtype=q.dtype, device=dev)
    lse = torch.full((b, h, sq), math.inf, dtype=torch.float32, device=dev)
    ends = (starts + s_new).tolist()
    los = cache_leftpad.tolist() if cache_leftpad is not None else [0] * b
    row_list = rows.tolist()
    for i in range(b):
        lo, end = los[i], ends[i]
        if end <= lo:
            continue  # no key: out 0, lse +inf
        bt_row = i if block_table is not None else row_list[i]
        ki = _gather(k_cache, block_table, bt_row, lo, end).unsqueeze(0)
        vi = _gather(v_cache, block_table, bt_row, lo, end).unsqueeze(0)
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[i]
        # relative positions inside [lo, end) keep the bottom-right alignment of absolute ones
        o_i, l_i = torch_backend.attention_forward(
            q[i : i + 1], ki, vi, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=slopes,
        )
        out[i] = o_i[0]
        lse[i] = l_i[0].float()
    return out, lse
