"""KV-cache attention (flash_attn_with_kvcache) in plain torch: gather, append, rotate, then the chunked
attention per sequence. Same signature as flashattn.backends.triton.decode.kvcache_forward (num_splits is
irrelevant here)."""

import math

import torch

from flashattn.backends.torch.attention import attention_forward


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


def kvcache_forward(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                          cache_seqlens=None, cache_len=0, cache_batch_idx=None, cache_leftpad=None,
                          block_table=None, *, softmax_scale: float, causal: bool = False,
                          window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                          rotary_interleaved: bool = True, num_splits: int = 0):
    """(out, lse) as the Triton launcher returns them."""
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
        o_i, l_i = attention_forward(
            q[i : i + 1], ki, vi, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=slopes,
        )
        out[i] = o_i[0]
        lse[i] = l_i[0].float()
    return out, lse
