"""The KV-cache attention ops: `flashattn::kvcache_fwd` (appends new keys/values to the caches in place, then
attends) and `flashattn::kvcache_attn` (attends only; the caches are read, not written). Inference only.
An FP8 (e4m3) cache comes with its float32 descales k_descale / v_descale (None for a 16-bit cache).

Two ops rather than one with optional k/v: torch.compile functionalises an op that declares a mutation, and
where it cannot write in place it copies the mutated tensor, here a whole KV cache per call. A call that
appends nothing (Hugging Face's decode step, which writes its cache itself) declares no mutation.

Registered with registry.Op, so torch.compile(fullgraph=True) traces through them. Eager calls skip the ops
altogether: flashattn.kvcache and flashattn.decode_plan keep a prepared launch per call signature
(`prepare`, the backend's DecodeLaunch) and call it with the tensors.
"""

import torch
from torch import Tensor

from flashattn import _validate_cache
from flashattn.backends import entry
from flashattn.ops.registry import Op


def _impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
    rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor | None, cache_len: int,
    cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, block_table: Tensor | None,
    key_mask: Tensor | None, k_descale: Tensor | None, v_descale: Tensor | None, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None,
    rotary_interleaved: bool, num_splits: int, check_inputs: bool,
) -> tuple[Tensor, Tensor]:
    # the opt-in range checks read device values: here, inside the op, they stay out of torch.compile's graph
    if check_inputs and _validate_cache.checks_enabled(q, True):
        _validate_cache.check_indices(q, k_cache, k, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad,
                                      block_table)
    return entry(q).kvcache_forward(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        rotary_interleaved=rotary_interleaved, num_splits=num_splits, key_mask=key_mask, k_descale=k_descale,
        v_descale=v_descale,
    )


def _fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
          cache_leftpad, block_table, key_mask, k_descale, v_descale, softmax_scale, causal, window_left,
          window_right, softcap, alibi_slopes, rotary_interleaved, num_splits, check_inputs):
    b, sq, h, d = q.shape
    # contiguous, as the real op allocates them
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


def _attn_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None, cache_len: int,
    cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, block_table: Tensor | None,
    key_mask: Tensor | None, k_descale: Tensor | None, v_descale: Tensor | None, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None,
    num_splits: int, check_inputs: bool,
) -> tuple[Tensor, Tensor]:
    return _impl(q, k_cache, v_cache, None, None, None, None, cache_seqlens, cache_len, cache_batch_idx,
                 cache_leftpad, block_table, key_mask, k_descale, v_descale, softmax_scale, causal,
                 window_left, window_right, softcap, alibi_slopes, True, num_splits, check_inputs)


def _attn_fake(q, k_cache, v_cache, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad, block_table,
               key_mask, k_descale, v_descale, softmax_scale, causal, window_left, window_right, softcap,
               alibi_slopes, num_splits, check_inputs):
    return _fake(q, k_cache, v_cache, None, None, None, None, cache_seqlens, cache_len, cache_batch_idx,
                 cache_leftpad, block_table, key_mask, k_descale, v_descale, softmax_scale, causal,
                 window_left, window_right, softcap, alibi_slopes, True, num_splits, check_inputs)


kvcache_fwd = Op("kvcache_fwd", _impl, fake=_fake, mutates_args=("k_cache", "v_cache"))
kvcache_attn = Op("kvcache_attn", _attn_impl, fake=_attn_fake)


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
            cache_leftpad, block_table, key_mask, k_descale, v_descale, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, rotary_interleaved, num_splits,
            check_inputs) -> tuple[Tensor, Tensor]:
    """The call through the ops (what torch.compile traces): kvcache_fwd when k/v are given, else
    kvcache_attn."""
    with torch.no_grad():
        if k is None:
            return kvcache_attn(q, k_cache, v_cache, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad,
                                block_table, key_mask, k_descale, v_descale, softmax_scale, causal,
                                window_left, window_right, softcap, alibi_slopes, num_splits, check_inputs)
        return kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len,
                           cache_batch_idx, cache_leftpad, block_table, key_mask, k_descale, v_descale,
                           softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                           rotary_interleaved, num_splits, check_inputs)


def prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, key_mask, k_descale, v_descale, *, softmax_scale, causal, window_size,
            softcap, rotary_interleaved, num_splits, route=None):
    """The eager fast path's prepared launch for calls with this signature (the backend's DecodeLaunch):
    call it with (q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_len, cache_batch_idx,
    cache_leftpad, block_table, alibi_slopes, key_mask, k_descale, v_descale[, workspace]) -> (out, lse)."""
    return entry(q).kvcache_prepare(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, alibi_slopes, key_mask, k_descale, v_descale, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
        num_splits=num_splits, route=route)


def plan(batch, nheads, nheads_k, seqlen_q, headdim, dtype, cache_dtype, paged, max_seqlen_k, window,
         num_splits, device: torch.device, workspace=None):
    """(route, workspace) of a DecodePlan on `device`'s backend (None, None where nothing is planned) for q
    in `dtype` and caches in `cache_dtype`; the given workspace (a previous plan's) is kept where it is large
    enough."""
    return entry(torch.empty(0, device=device)).kvcache_plan(
        batch, nheads, nheads_k, seqlen_q, headdim, dtype, cache_dtype, paged, max_seqlen_k, window,
        num_splits, device, workspace)
