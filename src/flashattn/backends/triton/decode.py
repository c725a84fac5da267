"""Launcher of KV-cache attention (flash_attn_with_kvcache, DecodePlan): one launch of
kernels/triton/decode.py per call, which appends (rotated) new keys, attends and merges its splits.

Pure functions, no autograd, no argument checking beyond what the kernel needs (flashattn.kvcache validates).
Shapes: q (b, sq, h, d); caches (b_cache, s_cache, h_k, d) or paged (num_pages, page_size, h_k, d) with
block_table (b, max_pages) int32; new k/v (b, s_new, h_k, d); key_mask (b, capacity) bool. `cache_seqlens`
is an int32 (b,) tensor or None, in which case every sequence holds `cache_len` keys. Launches mutate the
caches in place when k/v are given and return (out (b, sq, h, d) in q's dtype, lse (b, h, sq) float32, +inf
for rows that see no key).

Host time: everything a call derives from its signature (shapes, strides, dtypes, device, which optional
tensors are given, the options) is kept in a `DecodeLaunch`: the route, the kernel's constexprs and scalar
arguments, and after its first launch the compiled kernel (launch.Bound). A repeated signature allocates its
outputs and launches. `prepare` makes one; `kvcache_forward` keeps one per signature (the op's path);
flashattn.kvcache and flashattn.decode_plan keep their own.

Splits merge inside the kernel through a workspace: fp32 partials and one counter per row of programs, which
must be 0 when a launch starts. The kernel leaves its counters at 0, so a workspace serves launch after launch
in order on one stream: a DecodePlan brings its own; flash_attn_with_kvcache's eager calls take their
stream's (workspace=STREAM_WORKSPACE, `stream_workspace`: no allocation and no zeroing kernel per call), as
do the split-KV forwards of few-row attention calls (backends/triton/attention.py) outside graph capture; the
other calls (the registered kvcache op's, which torch.compile's CUDA graphs run, and any under CUDA graph
capture) allocate their partials and zeroed counters, so that they hold no state between calls: graphs may
replay on several streams at once, and nothing allocated in a graph's pool may outlive its bookkeeping.

An FP8 cache (e4m3 k_cache/v_cache with float32 descales k_descale/v_descale, (1,) or (b, h_k)) is the
kernel's FP8_CACHE variant; its tiles are routed for the cache's element size.

The tiles and split count are the route's (decode_routes.decode_route); backends/torch/decode.py is the same
computation in plain torch.
"""

import dataclasses

import torch

from flashattn import _internals, config
from flashattn.backends import STREAM_WORKSPACE
from flashattn.backends.triton import decode_routes, host, tma
from flashattn.backends.triton import launch as launch_mod
from flashattn.backends.triton.merge import sm_count
from flashattn.errors import FlashAttnError
from flashattn.fp8 import FP8
from flashattn.kernels.triton.decode import decode_kernel

LOG2E = 1.4426950408889634
# signatures whose DecodeLaunch kvcache_forward keeps (a model has a few per layer shape); past this many the
# cache is emptied rather than grown
_CACHED_SIGNATURES = 256
_launches: dict = {}


class Workspace:
    """fp32 split partials and int32 per-row counters for launches that merge their splits in the kernel.

    The counters start at 0 and every launch leaves them at 0 (the program that merges a row resets its
    counter), so one workspace serves launch after launch, CUDA graph replays included, as long as the
    launches that share it are ordered (one stream)."""

    __slots__ = ("partials", "counters")

    def __init__(self, device: torch.device, floats: int, counters: int):
        self.partials = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(counters, 1), dtype=torch.int32, device=device)

    def fits(self, floats: int, counters: int) -> bool:
        return self.partials.numel() >= floats and self.counters.numel() >= counters


_stream_workspaces: dict = {}


def stream_workspace(device: torch.device, floats: int, counters: int) -> Workspace | None:
    """The workspace of launches that bring none: one per CUDA device and stream (launches on a stream run
    one after another, and each leaves the counters at 0), grown to the largest launch it has served; None
    while the stream is capturing a CUDA graph (the caller allocates its own). The interpreter runs each
    launch to its end before the next, so a CPU device keeps one."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        index = device.index if device.index is not None else _internals.current_device()
        key = (index, _internals.raw_stream(index))
    else:
        key = (device.type,)
    workspace = _stream_workspaces.get(key)
    if workspace is None or not workspace.fits(floats, counters):
        if workspace is not None:
            floats = max(floats, workspace.partials.numel())
            counters = max(counters, workspace.counters.numel())
        elif len(_stream_workspaces) >= _CACHED_SIGNATURES:
            # streams come and go; a dropped workspace's memory is reused by its own stream only, after its
            # launches (the caching allocator's blocks are per stream)
            _stream_workspaces.clear()
        workspace = _stream_workspaces[key] = Workspace(device, floats, counters)
    return workspace


def _window(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) with causal folded in: causal is the window (left, 0), as in flash_attn."""
    left, right = int(window_size[0]), int(window_size[1])
    return (max(left, -1), 0) if causal else (max(left, -1), max(right, -1))


def capacity_of(k_cache, block_table) -> int:
    """Cache positions a sequence can hold: seqlen_cache, or max_pages · page_size."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def kv_element_size(dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """The element size the route sizes the tiles for: the cache's (the K/V tiles hold its bytes), but an
    fp32 q's, whose fp32 tiles in registers set the warps."""
    q_size, cache_size = (torch.empty(0, dtype=t).element_size() for t in (dtype, cache_dtype))
    return q_size if q_size > 2 else cache_size


def _descale_strides(descale) -> tuple[int, int]:
    """(batch, kv head) strides of a descale: 0, 0 for one per tensor ((1,), or none)."""
    if descale is None or descale.dim() == 1:
        return 0, 0
    return descale.stride(0), descale.stride(1)


def decode_spec(batch: int, nheads: int, nheads_k: int, seqlen_q: int, headdim: int, element_size: int,
                paged: bool, capacity: int, window: tuple[int, int], num_splits: int,
                device: torch.device) -> decode_routes.DecodeSpec:
    return decode_routes.DecodeSpec(batch, nheads, nheads_k, seqlen_q, headdim, element_size, paged, capacity,
                             window, num_splits, tma.device_facts(device)[0], sm_count(device))


def workspace_size(route: decode_routes.DecodeRoute, batch: int, nheads_k: int, rows: int,
                   headdim: int) -> tuple[int, int]:
    """(fp32 partials, counters) a launch of this route needs: per split and row of programs, a
    (BLOCK_M, BLOCK_D) output and BLOCK_M LSEs; a counter per row of programs (batch, kv head, query
    block)."""
    if route.num_splits == 1:
        return 0, 0
    program_rows = batch * nheads_k * host.cdiv(rows, route.block_m)
    floats = route.num_splits * program_rows * route.block_m * (host.block_d(headdim) + 1)
    return floats, program_rows


# positions in DecodeLaunch.consts of the arguments a contiguous cache's length moves: k_cache's and
# v_cache's (batch, seq, head) strides, key_mask's batch stride and the capacity (prepare's order)
_K_STRIDES, _V_STRIDES, _MASK_STRIDE, _CAPACITY = slice(3, 6), slice(6, 9), 25, 33
_MOVED = (*range(_K_STRIDES.start, _V_STRIDES.stop), _MASK_STRIDE, _CAPACITY)


class DecodeLaunch:
    """One signature's launch, prepared: call it with the call's tensors (and the int cache_len).

    addresses_only: whether a call reads nothing of its tensors but their addresses (and q's device), so
    that any tensors over the same memory serve, whatever their shapes and strides (the signature's are
    fixed at preparation): true where the launch goes straight through its plan (launch.Bound)."""

    __slots__ = ("route", "grid", "kwargs", "consts", "out_shape", "lse_shape", "floats", "counters",
                 "bound", "spec")

    def __init__(self, route, grid, kwargs, consts, out_shape, lse_shape, floats, counters, direct,
                 spec=None):
        self.route, self.grid, self.kwargs, self.consts = route, grid, kwargs, consts
        self.out_shape, self.lse_shape = out_shape, lse_shape
        self.floats, self.counters = floats, counters
        self.bound = launch_mod.Bound(decode_kernel, grid, kwargs) if direct else None
        self.spec = spec

    @property
    def addresses_only(self) -> bool:
        return self.bound is not None

    def resized(self, capacity: int, k_strides: tuple, v_strides: tuple,
                mask_stride: int) -> "DecodeLaunch | None":
        """The launch of this signature with contiguous caches of another length: `capacity` keys, k_cache's
        and v_cache's (batch, seq, head) strides, key_mask's batch stride (0 without one); or None where
        that length takes another route (split count, tiles) than this one's: then `prepare` it. Valid only
        for a launch `prepare` routed itself (no plan's route) on caches without a block_table, for tensors
        that passed the same checks but for their length; the compiled kernel is kept where no scalar
        argument changes its specialisation."""
        spec = self.spec
        if spec is None or spec.paged:
            return None
        route = self.route
        block_n, block_m = route.tiles.block_n, route.block_m
        if (decode_routes.key_tiles(spec, capacity, block_n, block_m)
                != decode_routes.key_tiles(spec, spec.capacity, block_n, block_m)):
            spec = dataclasses.replace(spec, capacity=capacity)
            if decode_routes.decode_route(spec) != route:
                return None
        old = self.consts
        consts = list(old)
        consts[_K_STRIDES], consts[_V_STRIDES] = k_strides, v_strides
        if self.kwargs["HAS_KEY_MASK"]:
            consts[_MASK_STRIDE] = mask_stride
        consts[_CAPACITY] = capacity
        resized = DecodeLaunch(route, self.grid, self.kwargs, tuple(consts), self.out_shape, self.lse_shape,
                               self.floats, self.counters, self.bound is not None, spec)
        if self.bound is not None and launch_mod.same_specialisation(tuple(old[i] for i in _MOVED),
                                                                     tuple(consts[i] for i in _MOVED)):
            resized.bound.plan = self.bound.plan
        return resized

    def __call__(self, q, k_cache, v_cache, k, v, cos, sin, seqlens, cache_len, batch_idx, leftpad,
                 block_table, alibi, key_mask, k_descale=None, v_descale=None, workspace=None):
        device = q.device
        # sizes unpacked: torch.empty parses separate ints faster than a tuple
        out = torch.empty(*self.out_shape, dtype=q.dtype, device=device)
        lse = torch.empty(*self.lse_shape, dtype=torch.float32, device=device)
        if workspace is STREAM_WORKSPACE:
            workspace = stream_workspace(device, self.floats, self.counters) if self.counters else None
        if not self.counters:
            work = counters = q
        elif workspace is None:
            work = torch.empty(self.floats, dtype=torch.float32, device=device)
            counters = torch.zeros(self.counters, dtype=torch.int32, device=device)
        else:
            work, counters = workspace.partials, workspace.counters
        # pointer arguments a flag switches off are never dereferenced: q stands in for them
        args = (q, k_cache, v_cache, q if k is None else k, q if v is None else v, q if cos is None else cos,
                q if sin is None else sin, out, lse, work, counters, q if seqlens is None else seqlens,
                q if batch_idx is None else batch_idx, q if leftpad is None else leftpad,
                q if block_table is None else block_table, q if alibi is None else alibi,
                q if key_mask is None else key_mask, q if k_descale is None else k_descale,
                q if v_descale is None else v_descale, cache_len, *self.consts)
        if self.bound is not None:
            self.bound(args)
        else:
            decode_kernel[self.grid](*args, **self.kwargs)
        return out, lse


def prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, key_mask, k_descale, v_descale, *, softmax_scale: float,
            causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
            num_splits: int = 0, route: decode_routes.DecodeRoute | None = None) -> DecodeLaunch:
    """The DecodeLaunch of calls like this one (the tensors give shapes, strides and dtypes; their values are
    not read). route: a plan's route instead of the default one for the cache's capacity."""
    b, sq, h, d = q.shape
    hk = k_cache.shape[2]
    paged = block_table is not None
    capacity = capacity_of(k_cache, block_table)
    window = _window(causal, window_size)
    window_on = window != (-1, -1)
    fp8 = k_cache.dtype == FP8
    if fp8 and q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(q.device)
        raise FlashAttnError(f"an FP8 (e4m3) cache needs a GPU of compute capability 8.9 or later (Ada, "
                             f"Hopper); {q.device} is {major}.{minor}: use a 16-bit cache")
    spec = None
    if route is None:
        spec = decode_spec(b, h, hk, sq, d, kv_element_size(q.dtype, k_cache.dtype), paged, capacity, window,
                           num_splits, q.device)
        route = decode_routes.decode_route(spec)
    cfg, block_m, splits = route.tiles, route.block_m, route.num_splits
    group = h // hk
    rows = sq * group
    if route.merge_rows < min(rows, block_m):
        # the merge takes a block's first merge_rows rows only
        raise FlashAttnError(f"route.merge_rows={route.merge_rows}; expected at least "
                             f"min(rows, block_m) = {min(rows, block_m)} for {rows} packed query rows")
    grid = (b * hk, splits, host.cdiv(rows, block_m))
    floats, counters = workspace_size(route, b, hk, rows, d)
    s_new = 0 if k is None else k.shape[1]
    rotate = rotary_cos is not None
    left, right = (decode_routes.UNBOUNDED if w < 0 else w for w in window)
    zeros3 = (0, 0, 0)
    consts = (
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k.stride()[:3] if k is not None else zeros3), *(v.stride()[:3] if v is not None else zeros3),
        sq * h * d, h * d, d,  # out (b, sq, h, d) and lse (b, h, sq): allocated contiguous
        h * sq, sq, 1,
        rotary_cos.stride(0) if rotate else 0, rotary_sin.stride(0) if rotate else 0,
        block_table.stride(0) if paged else 0,
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        key_mask.stride(0) if key_mask is not None else 0,
        *_descale_strides(k_descale), *_descale_strides(v_descale),
        hk, sq, s_new, capacity, k_cache.shape[0], rotary_cos.shape[0] if rotate else 1, splits,
        softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E, left, right,
    )
    kwargs = dict(
        GROUP=group, HEAD_DIM=d, BLOCK_D=host.block_d(d), BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, PAGED=paged, HAS_SEQLENS=cache_seqlens is not None,
        HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None,
        HAS_KEY_MASK=key_mask is not None, APPEND=k is not None,
        ROT_DIM=2 * rotary_cos.shape[1] if rotate else 0, INTERLEAVED=bool(rotary_interleaved),
        Q_PER_ROW=window_on, WINDOW=window_on, SOFTCAP=softcap > 0, ALIBI_ON=alibi_slopes is not None,
        SPLIT=splits > 1, MERGE_ROWS=route.merge_rows,
        MERGE_CHUNK=merge_chunk(route.merge_rows, host.block_d(d), splits), FP8_CACHE=fp8,
        DOT_FP16=fp8 and q.dtype != torch.float32,
        DOT_PREC=host.dot_precision(q.dtype),
        # 64-row blocks (long GQA groups, chunked prefill) hold 4x the accumulator of a decode step
        num_warps=max(cfg.num_warps, 8) if block_m >= 64 else cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return DecodeLaunch(route, grid, kwargs, consts, (b, sq, h, d), (b, h, sq), floats, counters,
                        launch_mod.direct(q), spec)


def merge_chunk(merge_rows: int, block_d: int, splits: int) -> int:
    """Splits whose (merge_rows, block_d) float32 partials the in-kernel merge loads at once: 8K floats (64
    registers a thread at 4 warps), at most 16 (an unrolled body each) and at most the splits' power of two
    (a body past the last split is masked work; powers of two keep the compiled variants to five)."""
    return max(1, min(16, 8192 // (merge_rows * block_d), 1 << max(splits - 1, 0).bit_length()))


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype)


def kvcache_forward(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                    cache_len=0, cache_batch_idx=None, cache_leftpad=None, block_table=None, *,
                    softmax_scale: float, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, rotary_interleaved: bool = True, num_splits: int = 0, key_mask=None,
                    k_descale=None, v_descale=None, workspace=None):
    """See the module docstring for shapes; returns (out, lse). workspace: None (a launch that splits
    allocates its own) or STREAM_WORKSPACE (the stream's, `stream_workspace`)."""
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
           v_cache.shape, v_cache.stride(), v_cache.dtype,
           _sig(k), _sig(v), _sig(rotary_cos), _sig(rotary_sin), cache_seqlens is None,
           cache_batch_idx is None, cache_leftpad is None, _sig(block_table), _sig(alibi_slopes),
           _sig(key_mask), _sig(k_descale), _sig(v_descale), softmax_scale, causal, tuple(window_size),
           softcap, rotary_interleaved, num_splits, config.generation)
    launch = _launches.get(key)
    if launch is None:
        launch = prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes, key_mask, k_descale, v_descale,
                         softmax_scale=softmax_scale,
                         causal=causal, window_size=window_size, softcap=softcap,
                         rotary_interleaved=rotary_interleaved, num_splits=num_splits)
        if len(_launches) >= _CACHED_SIGNATURES:
            _launches.clear()
        _launches[key] = launch
    return launch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len,
                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, key_mask, k_descale, v_descale,
                  workspace)


def plan_route(batch: int, nheads: int, nheads_k: int, seqlen_q: int, headdim: int, dtype: torch.dtype,
               cache_dtype: torch.dtype, paged: bool, max_seqlen_k: int, window: tuple[int, int],
               num_splits: int, device: torch.device,
               workspace: Workspace | None = None) -> tuple[decode_routes.DecodeRoute, Workspace | None]:
    """A plan's route for sequences of at most max_seqlen_k keys (q in dtype, caches in cache_dtype), and a
    workspace of its own: `workspace` where it is large enough (a replan), else a new one (None when the
    route does not split)."""
    spec = decode_spec(batch, nheads, nheads_k, seqlen_q, headdim, kv_element_size(dtype, cache_dtype), paged,
                       max_seqlen_k, window, num_splits, device)
    route = decode_routes.decode_route(spec)
    floats, counters = workspace_size(route, batch, nheads_k, spec.rows, headdim)
    if not counters:
        return route, None
    if workspace is not None and workspace.fits(floats, counters):
        return route, workspace
    return route, Workspace(device, floats, counters)
