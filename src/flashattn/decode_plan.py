"""DecodePlan: plan a batch's decode step once, run it every step and layer (serving loops, CUDA graphs).

A plan fixes what depends only on the batch's composition: the split count and tiles (the route), the
workspace in which the splits merge, and, after a signature's first run, the checked arguments and the
compiled launch. `run` then checks nothing it has seen and launches one kernel: append + rotary + split
attention + merge, as flash_attn_with_kvcache does (the same machinery, bitwise the same result for the same
split count). It never synchronises with the device and allocates only its outputs, so it can be captured
in a CUDA graph and replayed with new cache lengths, and torch.compile traces it (through the registered
op). One plan serves every layer of a model: its launches run one after the other on one stream.

    plan = flashattn.DecodePlan(batch, nheads, nheads_k, headdim, page_size=64, max_seqlen_k=8192,
                                dtype=torch.bfloat16, causal=True)
    for step in range(new_tokens):
        for layer in range(n_layers):
            out = plan.run(q[layer], k_pages[layer], v_pages[layer], cache_seqlens, block_table,
                           k=k_new[layer], v=v_new[layer], rotary_cos=cos, rotary_sin=sin)
        cache_seqlens += 1
    plan = plan.replan(batch=new_batch)  # when the batch changes: microseconds, the workspace reused

docs/decode.md has the serving loop in full, CUDA graph capture included.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from flashattn import _validate, _validate_cache
from flashattn.errors import FlashAttnError
from flashattn.fp8 import FP8
from flashattn.kvcache import Launch, check_call, inputs_key, through_op
from flashattn.ops import kvcache as kvcache_ops
from flashattn.ops import registry

__all__ = ["DecodePlan"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHED_SIGNATURES = 64  # signatures a plan keeps launches for: a model's layers share one or a few


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise FlashAttnError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class DecodePlan:
    """A planned decode step for a batch of `batch` sequences (FlashInfer's BatchDecodeWithPagedKVCacheWrapper
    plan/run, on flash_attn_with_kvcache's arguments).

    Arguments (shape-first; the plan's fixed facts):
        batch: int >= 1. Sequences per run (q's dim 0).
        nheads: int. Query heads; nheads_k: int, KV heads (nheads a multiple of nheads_k: GQA/MQA).
        headdim: int, 1..256.
        page_size: int or None, keyword, default None = contiguous caches (batch_cache, seqlen_cache,
            nheads_k, headdim); else paged caches (num_pages, page_size, nheads_k, headdim) with a
            block_table, page_size a multiple of 16.
        max_seqlen_k: int, keyword, required. The longest sequence (keys before the step plus new ones) the
            plan will see; it sets the split count. Longer sequences are still attended exactly.
        dtype: torch.float16 / bfloat16 / float32, keyword, default bfloat16. q's dtype (and that of the new
            k/v and the output).
        cache_dtype: torch.dtype or None, keyword, default None = dtype. The caches' dtype: dtype, or
            torch.float8_e4m3fn for an FP8 cache (each run then takes k_descale / v_descale). The route's
            tiles are sized for it.
        device: torch.device or str, keyword, default the current CUDA device (the CPU without CUDA).
        seqlen_q: int, keyword, default 1. Query tokens per sequence and run (speculative verification: more).
        softmax_scale, causal, window_size, softcap, rotary_interleaved: keyword, flash_attn_with_kvcache's
            options with its defaults (1 / sqrt(headdim), False, (-1, -1), 0.0, True).
        num_splits: int, keyword, default 0 = the heuristic for max_seqlen_k; else that many key splits.
        check_inputs: bool or None, keyword, default None = flashattn.config's check_indices (off). True
            range-checks the device indices of every run, with one device-to-host copy (never during a CUDA
            graph capture); off, the kernel clamps them (see flash_attn_with_kvcache).

    Attributes: `route` (the kernel's tiles and split count, None on the CPU's torch backend) and
    `num_splits`.
    """

    def __init__(self, batch: int, nheads: int, nheads_k: int, headdim: int, *, page_size: int | None = None,
                 max_seqlen_k: int, dtype: torch.dtype = torch.bfloat16,
                 cache_dtype: torch.dtype | None = None, device=None, seqlen_q: int = 1,
                 softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                 softcap: float = 0.0, rotary_interleaved: bool = True, num_splits: int = 0,
                 check_inputs: bool | None = None, _workspace=None):
        self.batch = _positive("batch", batch)
        self.nheads, self.nheads_k = _positive("nheads", nheads), _positive("nheads_k", nheads_k)
        if self.nheads % self.nheads_k:
            raise FlashAttnError(f"nheads={nheads} is not a multiple of nheads_k={nheads_k} (GQA/MQA)")
        self.headdim = _positive("headdim", headdim)
        if self.headdim > _validate.MAX_HEADDIM:
            raise FlashAttnError(f"headdim={headdim}; expected at most {_validate.MAX_HEADDIM}")
        if page_size is not None and (_positive("page_size", page_size) % 16):
            raise FlashAttnError(f"page_size={page_size}; expected a multiple of 16, or None (contiguous)")
        self.page_size = page_size
        self.max_seqlen_k = _positive("max_seqlen_k", max_seqlen_k)
        self.seqlen_q = _positive("seqlen_q", seqlen_q)
        if dtype not in _DTYPES:
            raise FlashAttnError(f"dtype={dtype}; expected one of {', '.join(map(str, _DTYPES))}")
        self.dtype = dtype
        if cache_dtype not in (None, dtype, FP8):
            raise FlashAttnError(f"cache_dtype={cache_dtype}; expected None or {dtype} (q's dtype), or {FP8} "
                                 f"(an FP8 cache)")
        self.cache_dtype = dtype if cache_dtype is None else cache_dtype
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        _validate.check_scale(softmax_scale)
        self.window_size = _validate.check_window(window_size)
        _validate.check_softcap(softcap)
        self.num_splits_request = _positive("num_splits", num_splits, 0)
        self.softmax_scale, self.causal, self.softcap = softmax_scale, bool(causal), float(softcap)
        self.rotary_interleaved, self.check_inputs = bool(rotary_interleaved), check_inputs
        left, right = self.window_size
        window = (max(left, -1), 0) if self.causal else (max(left, -1), max(right, -1))
        self.route, self._workspace = kvcache_ops.plan(
            self.batch, self.nheads, self.nheads_k, self.seqlen_q, self.headdim, dtype, self.cache_dtype,
            page_size is not None, self.max_seqlen_k, window, self.num_splits_request, self.device,
            _workspace)
        self._launches: dict = {}
        self._options = dict(page_size=page_size, max_seqlen_k=max_seqlen_k, dtype=dtype,
                             cache_dtype=cache_dtype, device=self.device,
                             seqlen_q=seqlen_q, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
                             num_splits=num_splits, check_inputs=check_inputs)

    @property
    def num_splits(self) -> int:
        """Key splits per (sequence, KV head): the route's, or the request on the torch backend."""
        return self.route.num_splits if self.route is not None else max(1, self.num_splits_request)

    def replan(self, **changes) -> DecodePlan:
        """A plan for a new batch composition (batch=, max_seqlen_k=, seqlen_q=, or any other argument),
        reusing this plan's workspace where it is large enough. Costs microseconds (routing, no kernel)."""
        args = dict(batch=self.batch, nheads=self.nheads, nheads_k=self.nheads_k, headdim=self.headdim,
                    **self._options)
        args.update(changes)
        return DecodePlan(**args, _workspace=self._workspace)

    def __repr__(self) -> str:
        paged = f"page_size={self.page_size}" if self.page_size is not None else "contiguous"
        cache = f"cache_dtype={self.cache_dtype}, " if self.cache_dtype != self.dtype else ""
        return (f"DecodePlan(batch={self.batch}, nheads={self.nheads}, nheads_k={self.nheads_k}, "
                f"headdim={self.headdim}, {paged}, max_seqlen_k={self.max_seqlen_k}, dtype={self.dtype}, "
                f"{cache}seqlen_q={self.seqlen_q}, num_splits={self.num_splits})")

    def _check_plan(self, q, k_cache, block_table) -> None:
        """What a run's tensors must share with the plan (then flash_attn_with_kvcache's own checks)."""
        want = (self.batch, self.seqlen_q, self.nheads, self.headdim)
        if tuple(q.shape) != want:
            raise FlashAttnError(f"q has shape {tuple(q.shape)}; the plan expects {want} = (batch, seqlen_q, "
                                 f"nheads, headdim)")
        if q.dtype != self.dtype or q.device != self.device:
            raise FlashAttnError(f"q is {q.dtype} on {q.device}; the plan expects {self.dtype} on "
                                 f"{self.device}")
        if k_cache.dtype != self.cache_dtype:
            raise FlashAttnError(f"k_cache has dtype {k_cache.dtype}; the plan expects cache_dtype "
                                 f"{self.cache_dtype}")
        if k_cache.shape[2] != self.nheads_k:
            raise FlashAttnError(f"k_cache has {k_cache.shape[2]} heads; the plan expects nheads_k = "
                                 f"{self.nheads_k}")
        if (block_table is None) != (self.page_size is None):
            kind = f"paged caches (page_size {self.page_size})" if self.page_size else "contiguous caches"
            given = "None" if block_table is None else "given"
            raise FlashAttnError(f"the plan is for {kind}; block_table is {given}")
        if self.page_size is not None and k_cache.shape[1] != self.page_size:
            raise FlashAttnError(f"k_cache has page_size {k_cache.shape[1]} (dim 1); the plan expects "
                                 f"{self.page_size}")

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens=None, block_table=None, *,
            k=None, v=None, rotary_cos=None, rotary_sin=None, cache_leftpad=None, cache_batch_idx=None,
            alibi_slopes=None, key_padding_mask=None, return_softmax_lse: bool = False, k_descale=None,
            v_descale=None):
        """One step: append k/v (rotated) to the caches, attend, merge the splits; one kernel launch.

        Arguments are flash_attn_with_kvcache's, with the shapes the plan fixes:
            q: (batch, seqlen_q, nheads, headdim) in the plan's dtype, on its device.
            k_cache, v_cache: (num_pages, page_size, nheads_k, headdim) with a block_table (paged plans), or
                (batch_cache, seqlen_cache, nheads_k, headdim), in the plan's cache_dtype. Updated in place
                when k/v are given (quantised with the descales into an FP8 cache).
            cache_seqlens: (batch,) int32 tensor or int, default None = full caches. Keys before the step.
            block_table: (batch, max_pages) int32, paged plans only.
            k, v: (batch, seqlen_new, nheads_k, headdim), default None: the keys/values to append.
            rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), default None (with k/v only).
            cache_leftpad, cache_batch_idx: (batch,) int32, default None.
            alibi_slopes: (nheads,) or (batch, nheads) float32, default None.
            key_padding_mask: (batch, capacity) bool, default None: False = never attended.
            return_softmax_lse: bool, default False.
            k_descale, v_descale: float32 (1,) or (batch, nheads_k), default None: an FP8 cache's descales
                (required with one, refused otherwise; see flash_attn_with_kvcache).
        Returns out (batch, seqlen_q, nheads, headdim), and lse (batch, nheads, seqlen_q) float32 when asked.
        The device indices are checked only with the plan's check_inputs (see flash_attn_with_kvcache).
        """
        seqlens_is_int = cache_seqlens is not None and not isinstance(cache_seqlens, Tensor)
        key = launch = None
        if registry.eager(q):
            try:
                key = inputs_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask,
                                 k_descale, v_descale)
                launch = self._launches.get(key)
            except (AttributeError, TypeError):
                key = None
        if launch is None:
            _validate.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
            _validate_cache.check_cache_tensor("k_cache", k_cache, "(num_pages, page_size, nheads_k, headdim)"
                                               if self.page_size else "(batch_cache, seqlen_cache, nheads_k, "
                                               "headdim)")
            self._check_plan(q, k_cache, block_table)
            checked = check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask,
                                 k_descale, v_descale, self.softmax_scale, self.causal, self.window_size,
                                 self.softcap, self.num_splits_request)
            if key is None:
                return through_op(checked, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask,
                                  k_descale, v_descale, self.causal, self.rotary_interleaved, self.num_splits,
                                  self.check_inputs, return_softmax_lse)
            prepared = kvcache_ops.prepare(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, None if seqlens_is_int else cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask, k_descale,
                v_descale,
                softmax_scale=checked[0], causal=self.causal, window_size=checked[1:3], softcap=checked[3],
                rotary_interleaved=self.rotary_interleaved, num_splits=self.num_splits, route=self.route)
            if len(self._launches) >= _CACHED_SIGNATURES:
                self._launches.clear()
            launch = self._launches[key] = Launch(checked, prepared, self._workspace)
        out, lse = launch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table, alibi_slopes, key_padding_mask, k_descale, v_descale,
                          self.check_inputs)
        return (out, lse) if return_softmax_lse else out
