"""KV-cache attention (flash_attn_with_kvcache, DecodePlan) in plain torch: append, rotate, then the chunked
attention per sequence. Same signature as flashattn.backends.triton.decode.kvcache_forward (num_splits and
the route are irrelevant here), and the same clamping of device indices as the Triton kernel: a bad value
gives a wrong result, never an index error.

An FP8 cache (e4m3, with float32 descales (1,) or (b, h_k)): the appended keys/values are quantised as the
kernel does (x / descale in fp32, clamped to ±448, rounded to nearest e4m3), the gathered ones dequantised to
fp32 (x_fp8 · descale), and the attention runs in fp32.
"""

import math

import torch

from flashattn.backends.torch.attention import attention_forward
from flashattn.backends.torch.tiles import exp_
from flashattn.fp8 import FP8, FP8_MAX

_QUERY_CHUNK = 64  # query rows per dense score block of a masked call: (rows, heads, keys) fp32 scores


def rotary_torch(x, cos, sin, positions, interleaved: bool):
    """x (b, s, heads, d) rotated on its first 2·cos.shape[1] dims at positions (b, s) (long, clamped into
    the table), in fp32."""
    rd = 2 * cos.shape[1]
    positions = positions.clamp(0, cos.shape[0] - 1)
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


def _per_head(descale, b: int, hk: int):
    """A descale (1,) or (b, h_k) as (b, h_k) float32."""
    return descale.float().reshape(1, 1).expand(b, hk) if descale.dim() == 1 else descale.float()


def quantize_new(x, descale):
    """New keys/values x (b, s, h_k, d) as an FP8 cache stores them: x / descale in fp32 (descale (b, h_k)),
    clamped to ±FP8_MAX, then rounded to the nearest e4m3 value (the clamp first: the cast itself does not
    saturate)."""
    return (x.float() / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _slots(k_cache, block_table, rows, positions):
    """(first index, second index) of cache positions (b, s) for advanced indexing of the cache."""
    if block_table is None:
        return rows.view(-1, 1).expand_as(positions), positions
    page_size = k_cache.shape[1]
    pages = torch.gather(block_table.long(), 1, positions // page_size)
    return pages.clamp(0, k_cache.shape[0] - 1), positions % page_size


def _gather(cache, block_table, row: int, lo: int, end: int):
    """(end - lo, h_k, d) keys of one sequence."""
    if block_table is None:
        return cache[row, lo:end]
    page_size = cache.shape[1]
    pages = block_table[row, : -(-end // page_size)].long().clamp(0, cache.shape[0] - 1)
    return cache[pages].flatten(0, 1)[lo:end]


def _masked_attention(q, k, v, keep, lo, diag, *, softmax_scale, window, softcap, slopes):
    """Dense attention of q (sq, h, d) over keys k/v (n, hk, d) at positions lo..lo+n-1, of which `keep` (n,)
    bool are visible, query i aligned with key i + diag; query rows in chunks. Returns out (sq, h, d) in
    fp32 and lse (h, sq), +inf for rows that see no key."""
    sq, h, d = q.shape
    group = h // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # (n, h, d)
    vf = v.float().repeat_interleave(group, dim=1)
    pos = torch.arange(lo, lo + k.shape[0], device=q.device)
    out = torch.zeros(sq, h, d, device=q.device)
    lse = torch.full((h, sq), math.inf, device=q.device)
    for i0 in range(0, sq, _QUERY_CHUNK):
        qi = q[i0 : i0 + _QUERY_CHUNK].float()
        s = torch.einsum("ihd,nhd->hin", qi, kf) * softmax_scale  # (h, rows, n)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        rel = pos.view(1, -1) - (torch.arange(i0, i0 + qi.shape[0], device=q.device) + diag).view(-1, 1)
        if slopes is not None:
            s = s - slopes.float().view(-1, 1, 1) * rel.abs()
        visible = keep.view(1, -1).expand_as(rel)
        if window[0] >= 0:
            visible = visible & (rel >= -window[0])
        if window[1] >= 0:
            visible = visible & (rel <= window[1])
        s = s.masked_fill(~visible, -math.inf)
        m = s.amax(-1, keepdim=True)
        p = exp_(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        denom = p.sum(-1)  # (h, rows)
        seen = denom > 0
        o = torch.einsum("hin,nhd->ihd", p, vf) / torch.where(seen, denom, 1.0).t().unsqueeze(-1)
        out[i0 : i0 + qi.shape[0]] = o
        lse[:, i0 : i0 + qi.shape[0]] = torch.where(seen, m.squeeze(-1) + torch.log(denom), math.inf)
    return out, lse


def kvcache_forward(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                    cache_seqlens=None, cache_len=0, cache_batch_idx=None, cache_leftpad=None,
                    block_table=None, *, softmax_scale: float, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    rotary_interleaved: bool = True, num_splits: int = 0, key_mask=None, k_descale=None,
                    v_descale=None):
    """(out, lse) as the Triton launcher returns them."""
    del num_splits
    b, sq, h, d = q.shape
    dev = q.device
    fp8 = k_cache.dtype == FP8
    if fp8:
        hk = k_cache.shape[2]
        k_descale, v_descale = _per_head(k_descale, b, hk), _per_head(v_descale, b, hk)
    s_new = k.shape[1] if k is not None else 0
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    # the kernel's clamps: start into [0, capacity - s_new], leftpad into [0, start], rows into the cache
    starts = (cache_seqlens.long() if cache_seqlens is not None
              else torch.full((b,), cache_len, dtype=torch.long, device=dev)).clamp(0, capacity - s_new)
    rows = (cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1) if cache_batch_idx is not None
            else torch.arange(b, device=dev))
    window_on = causal or tuple(window_size) != (-1, -1)
    if rotary_cos is not None:
        q_pos = starts.view(-1, 1) + torch.arange(sq, device=dev) * int(window_on)
        q = rotary_torch(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved).to(q.dtype)
    if k is not None:
        pos = starts.view(-1, 1) + torch.arange(s_new, device=dev)  # (b, s_new)
        if rotary_cos is not None:
            k = rotary_torch(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
        first, second = _slots(k_cache, block_table, rows, pos)
        if fp8:
            k_cache[first, second] = quantize_new(k, k_descale)
            v_cache[first, second] = quantize_new(v, v_descale)
        else:
            k_cache[first, second] = k.to(k_cache.dtype)
            v_cache[first, second] = v.to(v_cache.dtype)

    out = torch.zeros((b, sq, h, d), dtype=q.dtype, device=dev)
    lse = torch.full((b, h, sq), math.inf, dtype=torch.float32, device=dev)
    ends = (starts + s_new).tolist()
    los = cache_leftpad.long().clamp(min=0).tolist() if cache_leftpad is not None else [0] * b
    row_list = rows.tolist()
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    for i in range(b):
        end = ends[i]
        lo = min(los[i], end - s_new)
        if end <= lo:
            continue  # no key: out 0, lse +inf
        bt_row = i if block_table is not None else row_list[i]
        ki = _gather(k_cache, block_table, bt_row, lo, end)
        vi = _gather(v_cache, block_table, bt_row, lo, end)
        qi = q[i]
        if fp8:
            # the cache's real values, and q in fp32 to meet them (exact: q is 16-bit or fp32)
            ki = ki.float() * k_descale[i].view(1, -1, 1)  # (n, h_k, d)
            vi = vi.float() * v_descale[i].view(1, -1, 1)
            qi = qi.float()
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[i]
        if key_mask is not None:
            o_i, l_i = _masked_attention(qi, ki, vi, key_mask[i, lo:end], lo, end - sq,
                                         softmax_scale=softmax_scale, window=(left, right), softcap=softcap,
                                         slopes=slopes)
            out[i], lse[i] = o_i.to(q.dtype), l_i
            continue
        # relative positions inside [lo, end) keep the bottom-right alignment of absolute ones
        o_i, l_i = attention_forward(
            qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes,
        )
        out[i] = o_i[0].to(q.dtype)
        lse[i] = l_i[0].float()
    return out, lse


class DecodeLaunch:
    """backends/triton/decode.py's DecodeLaunch for this backend: the options, kept for calls of one
    signature (there is nothing else to prepare)."""

    __slots__ = ("options",)
    addresses_only = False  # computes on its tensors as they are shaped

    def __init__(self, options: dict):
        self.options = options

    def resized(self, capacity: int, k_strides: tuple, v_strides: tuple, mask_stride: int) -> "DecodeLaunch":
        """This launch: nothing it keeps depends on the caches' length or strides."""
        del capacity, k_strides, v_strides, mask_stride
        return self

    def __call__(self, q, k_cache, v_cache, k, v, cos, sin, seqlens, cache_len, batch_idx, leftpad,
                 block_table, alibi, key_mask, k_descale=None, v_descale=None, workspace=None):
        del workspace
        return kvcache_forward(q, k_cache, v_cache, k, v, cos, sin, seqlens, cache_len, batch_idx, leftpad,
                               block_table, alibi_slopes=alibi, key_mask=key_mask, k_descale=k_descale,
                               v_descale=v_descale, **self.options)


def prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, key_mask, k_descale, v_descale, *, softmax_scale: float,
            causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
            num_splits: int = 0, route=None) -> DecodeLaunch:
    """The DecodeLaunch of calls like this one (the Triton launcher's signature)."""
    del route, k_descale, v_descale
    return DecodeLaunch(dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, rotary_interleaved=rotary_interleaved, num_splits=num_splits))


def plan_route(*args, **kwargs):
    """A plan's route and workspace (the Triton launcher's signature): none here."""
    del args, kwargs
    return None, None
