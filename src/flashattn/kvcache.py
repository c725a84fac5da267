"""flash_attn_with_kvcache: attention of a few new query tokens against a (paged) KV cache, for inference.

Same name, arguments, defaults and semantics as flash_attn 2.x, so `from flashattn import
flash_attn_with_kvcache` replaces `from flash_attn import flash_attn_with_kvcache`; keyword-only extensions:
key_padding_mask, check_inputs, and an FP8 (e4m3) cache with FlashAttention-3's k_descale / v_descale. A
call is one kernel launch and never synchronises with the
device (docs/decode.md); flashattn.DecodePlan is the same machinery with the split count and buffers fixed
once for a serving loop.
"""

import numbers

from torch import Tensor

from flashattn import _validate, _validate_cache, config
from flashattn.backends import STREAM_WORKSPACE
from flashattn.errors import FlashAttnError
from flashattn.ops import kvcache as kvcache_ops
from flashattn.ops import registry
from flashattn.ops.attention import default_scale

__all__ = ["flash_attn_with_kvcache"]

# signatures whose checks passed, with their prepared launch (a model has a few per layer shape; lengths
# that vary from call to call, in chunked prefill, add one each): past this many the cache is emptied
_CACHED_SIGNATURES = 256
_calls: dict = {}


def tensor_key(t):
    """What the checks and the prepared launch of a call depend on in a tensor argument (None stays None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def inputs_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
               cache_leftpad, block_table, alibi_slopes, key_padding_mask, k_descale, v_descale) -> tuple:
    """The part of a decode call's signature its tensor arguments make (cache_seqlens may be an int), which
    flash_attn_with_kvcache and DecodePlan.run key their prepared launches on; the backend and the tile
    overrides too. Raises AttributeError / TypeError for an argument that is not a tensor."""
    seqlens = type(cache_seqlens) if cache_seqlens is not None and not isinstance(cache_seqlens, Tensor) \
        else tensor_key(cache_seqlens)
    return (tensor_key(q), tensor_key(k_cache), tensor_key(v_cache), tensor_key(k), tensor_key(v),
            tensor_key(rotary_cos), tensor_key(rotary_sin), seqlens, tensor_key(cache_batch_idx),
            tensor_key(cache_leftpad), tensor_key(block_table), tensor_key(alibi_slopes),
            tensor_key(key_padding_mask), tensor_key(k_descale), tensor_key(v_descale), config.backend,
            config.generation)


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
    *,
    key_padding_mask=None,
    check_inputs=None,
    k_descale=None,
    v_descale=None,
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
            (num_pages, page_size, nheads_k, headdim) with one; page_size a multiple of 16. q's dtype, or
            torch.float8_e4m3fn (an FP8 cache, with k_descale / v_descale). nheads must be a multiple of
            nheads_k (GQA/MQA). Updated in place when k is given.
        v_cache: same shape and dtype as k_cache. Updated in place when v is given.
        k, v: (batch, seqlen_new, nheads_k, headdim), q's dtype, default None: new keys/values to append
            first. Both or neither; seqlen_new at most the cache capacity. Into an FP8 cache they go
            quantised: (rotated) k / k_descale in fp32, clamped to ±448, rounded to the nearest e4m3 value;
            the attention of the same call reads them as the cache now holds them.
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
            (flash-decoding) in the same launch. 0 fills the GPU (about 2 · SMs programs); 1 disables
            splitting.
        return_softmax_lse: bool, default False. Also return the log-sum-exp.
        key_padding_mask: (batch, capacity) bool, keyword only, default None (a flashattn extension). False
            marks cache positions that are never attended (padding, holes), on top of the ranges above.
        check_inputs: bool or None, keyword only, default None = flashattn.config's check_indices (off
            unless FLASHATTN_CHECK_INDICES=1). True range-checks the device-side indices (below) with one
            device-to-host copy per call, and raises an error naming the bad entry.
        k_descale, v_descale: float32 (1,) (per tensor) or (batch, nheads_k) (per sequence and KV head, the
            row of q's batch entry b, cache_batch_idx or not), on q's device, keyword only, default None.
            Required with an FP8 cache, refused otherwise: the cache holds x_fp8 with real value
            x_fp8 · descale, so scores are q · (k_fp8 · k_descale) · softmax_scale and the output
            P · (v_fp8 · v_descale). flashattn.fp8.quantize(k, "head") gives a (batch, nheads_k) descale.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype. 0 for rows that see no key.
        softmax_lse (if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural log; +inf for rows
            that see no key. With the output, it is what merge_attention_states takes.

    What is checked, and when. Shapes, dtypes and devices: on every call, on the host (a signature seen
    before is looked up, not checked again). An int cache_seqlens: on the host. The values of the device
    tensors cache_seqlens, cache_leftpad, cache_batch_idx and block_table: only with check_inputs (skipped
    while a CUDA graph is captured), because reading them would synchronise the host with the device.
    Unchecked, the kernel clamps every index it reads, so no value can make it read or write outside the
    tensors; a bad value gives a wrong result instead:
        cache_seqlens[i]   clamped into [0, capacity - seqlen_new];
        cache_leftpad[i]   clamped into [0, cache_seqlens[i]];
        cache_batch_idx[i] clamped into [0, batch_cache);
        block_table[i, j]  clamped into [0, num_pages), for the entries the sequence uses.
    """
    seqlens_is_int = cache_seqlens is not None and not isinstance(cache_seqlens, Tensor)
    key = launch = None
    if registry.eager(q):
        try:
            key = (inputs_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                              cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask,
                              k_descale, v_descale),
                   softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits)
            launch = _calls.get(key)
        except (AttributeError, TypeError):  # an argument that is not a tensor, a window given as a list
            key = None
    if launch is None:
        checked = check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                             cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask,
                             k_descale, v_descale, softmax_scale, causal, window_size, softcap, num_splits)
        if key is None:
            return through_op(checked, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                              cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask,
                              k_descale, v_descale, causal, rotary_interleaved, num_splits, check_inputs,
                              return_softmax_lse)
        launch = prepare_launch(checked, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                None if seqlens_is_int else cache_seqlens, cache_batch_idx, cache_leftpad,
                                block_table, alibi_slopes, key_padding_mask, k_descale, v_descale, causal,
                                rotary_interleaved, num_splits)
        if len(_calls) >= _CACHED_SIGNATURES:
            _calls.clear()
        _calls[key] = launch
    out, lse = launch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, block_table, alibi_slopes, key_padding_mask, k_descale, v_descale,
                      check_inputs)
    return (out, lse) if return_softmax_lse else out


def check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
               cache_leftpad, block_table, alibi_slopes, key_padding_mask, k_descale, v_descale,
               softmax_scale, causal, window_size, softcap, num_splits) -> tuple:
    """Every check that reads no device value; returns (scale, window left, window right, softcap, capacity,
    seqlen_new)."""
    b, sq, h, d, paged = _validate_cache.check_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                                    cache_seqlens, cache_batch_idx, cache_leftpad,
                                                    block_table, alibi_slopes, key_padding_mask, k_descale,
                                                    v_descale)
    _validate.check_scale(softmax_scale)
    left, right = _validate.check_window(window_size)
    _validate.check_softcap(softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise FlashAttnError(f"num_splits must be an int >= 0 (0 = heuristic), got {num_splits!r}")
    if isinstance(cache_seqlens, bool) or not (cache_seqlens is None or isinstance(cache_seqlens, Tensor)
                                               or isinstance(cache_seqlens, numbers.Integral)):
        raise FlashAttnError(f"cache_seqlens must be an int or a (batch,) int32 tensor, got "
                             f"{type(cache_seqlens).__name__}")
    if k is not None and cache_seqlens is None:
        raise FlashAttnError(
            "k/v are given but cache_seqlens is None (a full cache): pass cache_seqlens, the number of keys "
            "already in each cache, so that the new keys have somewhere to go"
        )
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    return scale, left, right, float(softcap), capacity, 0 if k is None else k.shape[1]


def _cache_len(cache_seqlens, capacity: int, s_new: int, k_cache, block_table) -> int:
    """The int cache_seqlens checked against the capacity (the whole cache when None)."""
    if cache_seqlens is None:
        return capacity
    cache_len = int(cache_seqlens)
    if cache_len < 0 or cache_len + s_new > capacity:
        raise FlashAttnError(
            f"cache_seqlens={cache_len} with {s_new} new keys needs {cache_len + s_new} cache positions; "
            f"expected 0 <= cache_seqlens and cache_seqlens + seqlen_new <= "
            f"{_validate_cache.capacity_text(k_cache, block_table)}"
        )
    return cache_len


def prepare_launch(checked: tuple, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_padding_mask, k_descale,
                   v_descale, causal, rotary_interleaved, num_splits) -> "Launch":
    """The Launch of calls with this signature, whose check_call returned `checked` (cache_seqlens: the
    tensor, or None for an int or no value), on the stream's workspace."""
    return Launch(checked, kvcache_ops.prepare(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, alibi_slopes, key_padding_mask, k_descale, v_descale, softmax_scale=checked[0],
        causal=bool(causal), window_size=checked[1:3], softcap=checked[3],
        rotary_interleaved=bool(rotary_interleaved), num_splits=int(num_splits)), STREAM_WORKSPACE)


class Launch:
    """A checked call signature and its prepared launch (kvcache_ops.prepare): called with a call's tensors,
    it checks what varies from call to call (an int cache_seqlens; the device indices if asked) and launches
    once. workspace: a DecodePlan's own, or flash_attn_with_kvcache's STREAM_WORKSPACE (the stream's)."""

    __slots__ = ("capacity", "s_new", "prepared", "workspace")

    def __init__(self, checked: tuple, prepared, workspace=None):
        self.capacity, self.s_new = checked[4], checked[5]
        self.prepared, self.workspace = prepared, workspace

    def resized(self, capacity: int, k_strides: tuple, v_strides: tuple, mask_stride: int) -> "Launch | None":
        """The Launch of this signature over contiguous caches of another length (no block_table, no new
        keys, no cache_seqlens; tensors that pass the same checks but for that length): `capacity` keys,
        the caches' (batch, seq, head) strides, key_padding_mask's batch stride (0 without one). None where
        that length must be prepared afresh (it takes another route)."""
        prepared = self.prepared.resized(capacity, k_strides, v_strides, mask_stride)
        if prepared is None:
            return None
        launch = Launch.__new__(Launch)
        launch.capacity, launch.s_new = capacity, self.s_new
        launch.prepared, launch.workspace = prepared, self.workspace
        return launch

    def __call__(self, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, alibi_slopes, key_mask, k_descale, v_descale, check_inputs):
        if cache_seqlens is None or isinstance(cache_seqlens, Tensor):
            seqlens_t, cache_len = cache_seqlens, self.capacity
        else:
            seqlens_t = None
            cache_len = _cache_len(cache_seqlens, self.capacity, self.s_new, k_cache, block_table)
        check = config.check_indices if check_inputs is None else check_inputs
        if check and _validate_cache.checks_enabled(q, True):
            _validate_cache.check_indices(q, k_cache, k, seqlens_t, cache_len, cache_batch_idx, cache_leftpad,
                                          block_table)
        return self.prepared(q, k_cache, v_cache, k, v, cos, sin, seqlens_t, cache_len, cache_batch_idx,
                             cache_leftpad, block_table, alibi_slopes, key_mask, k_descale, v_descale,
                             self.workspace)


def through_op(checked: tuple, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
               cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_mask, k_descale, v_descale,
               causal, rotary_interleaved, num_splits, check_inputs, return_softmax_lse):
    """The call through the registered ops (under torch.compile, or with arguments that key no cache)."""
    scale, left, right, softcap, capacity, s_new = checked
    seqlens_t = cache_seqlens if isinstance(cache_seqlens, Tensor) else None
    cache_len = capacity if seqlens_t is not None else _cache_len(cache_seqlens, capacity, s_new, k_cache,
                                                                  block_table)
    check = config.check_indices if check_inputs is None else bool(check_inputs)
    out, lse = kvcache_ops.kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_t, cache_len, cache_batch_idx,
        cache_leftpad, block_table, key_mask, k_descale, v_descale, scale, bool(causal), left, right, softcap,
        alibi_slopes, bool(rotary_interleaved), int(num_splits), check)
    return (out, lse) if return_softmax_lse else out
