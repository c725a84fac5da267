"""The KV-cache attention op: `flashattn::kvcache_fwd` (inference only; it appends to the caches in place).

Registered as a custom op that mutates the caches, so torch.compile(fullgraph=True) traces through it. Eager
calls skip the op (registry.Op): for an op that mutates its inputs, torch's dispatch re-binds the 20-argument
schema on every call, O(args²) in Python (~0.1-0.3 ms, more than a whole decode step at 4K keys).
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
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None, rotary_interleaved: bool, num_splits: int,
) -> tuple[Tensor, Tensor]:
    # the index checks read device values: here, inside the op, they stay out of torch.compile's graph
    _validate_cache.check_indices(q, k_cache, k, cache_seqlens, cache_len, cache_batch_idx, cache_leftpad,
                                  block_table)
    return entry(q).kvcache_forward(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        rotary_interleaved=rotary_interleaved, num_splits=num_splits,
    )


def _fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len, cache_batch_idx,
          cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
          rotary_interleaved, num_splits):
    b, sq, h, d = q.shape
    # contiguous, as the real op allocates them
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


kvcache_fwd = Op("kvcache_fwd", _impl, fake=_fake, mutates_args=("k_cache", "v_cache"))
