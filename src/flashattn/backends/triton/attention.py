"""Launchers of the dense and varlen attention kernels: allocate outputs, take the route, launch.

Pure functions (tensors in, tensors out, no autograd): the ops, tests, benchmarks and the CLI call them.
Padded layout: q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv), lse (b, h, sq).
Varlen layout (cu_seqlens_q/k given): q (total_q, h, d), k/v (total_k, h_k, ·), lse (h, total_q).
Any strides with a contiguous last dim.

Which kernel runs is the route's choice (routes.forward_route / routes.backward_route of the call's Spec):
the warp-specialised Gluon kernels (gluon.py) or the Triton ones (kernels/triton/). A caller may pass a
route of its own (`route=`): the benchmarks time alternatives that way.

Launch order: grids are 1D, and under a window (causal included), where tiles differ in work, heads run in
groups heaviest tile first (kernels/triton/common.py, grouped_program; the route's lpt_group).

Host time: at short lengths a call's Python outlasts its kernels. Calls that take the Gluon kernels keep
what they derive (the problem, the route, the launch's arguments but its tensors, the plans) per signature:
shapes, strides, dtypes, device and the options, with 16-byte aligned tensors. A repeated signature only
allocates its outputs, builds its descriptors and launches; other calls take the full path.
"""

from dataclasses import dataclass

import torch

from flashattn import config, paged
from flashattn.backends import STREAM_WORKSPACE
from flashattn.backends.triton import decode, decode_routes, gluon, head_groups, host, routes, tma
from flashattn.backends.triton import launch as launch_mod
from flashattn.backends.triton.launch import Bound, launch
from flashattn.errors import FlashAttnError
from flashattn.kernels.triton.attn_bwd import attn_bwd_kernel, attn_bwd_preprocess_kernel
from flashattn.kernels.triton.attn_fwd import attn_fwd_kernel

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels take exp2, so the softmax scale absorbs it
_INT32_MAX = 2**31 - 1
# call signatures whose derivations the Gluon launchers keep (gluon.Prepared, 5-8 KB each with its key): a
# model has a few per layer shape, and a cache past this many is emptied rather than grown (lengths that
# vary from batch to batch would otherwise add an entry each)
_CACHED_SIGNATURES = 256
_forward_cache: dict = {}
_backward_cache: dict = {}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn"}


@dataclass(frozen=True)
class _Problem:
    """What the kernels of one call share, derived once from the arguments: the spec and the kernels'
    runtime scalars and constexpr flags."""

    spec: routes.Spec
    scalars: tuple  # qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset
    flags: dict

    # the spec's numbers under the names the launchers use
    varlen = property(lambda self: self.spec.varlen)
    batch = property(lambda self: self.spec.batch)
    nheads = property(lambda self: self.spec.nheads)
    nheads_k = property(lambda self: self.spec.nheads_k)
    seqlen_q = property(lambda self: self.spec.seqlen_q)  # padded length, or max_seqlen_q for varlen
    seqlen_k = property(lambda self: self.spec.seqlen_k)
    d = property(lambda self: self.spec.headdim)
    dv = property(lambda self: self.spec.headdim_v)
    causal = property(lambda self: self.spec.causal)

    def rows(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, row, head) strides of a q/k/v/o-like tensor in this layout."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def bounds(self, q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
        """The kernels' seqlen_q / seqlen_k arguments: the padded lengths, or the rows of the packed q and k
        (varlen), into which the kernels clamp each sequence cu_seqlens describes."""
        return (q.shape[0], k.shape[0]) if self.varlen else (self.seqlen_q, self.seqlen_k)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))


def _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
             rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k, learnable_sink, deterministic=False,
             streamed=(), out_dtype=None, page_size=0) -> _Problem:
    """streamed: the tensors besides q, k, v that the kernels stream (dout in the backward): with them, the
    spec's `aligned` says whether all of them suit TMA descriptors (an FP8 call's v aside: the launchers lay
    it out K-major, gluon.kmajor_v). out_dtype: an FP8 call's (None: bfloat16). page_size: a paged call's,
    whose k and v are page pools (num_pages, page_size, heads_k, ·)."""
    varlen = cu_seqlens_q is not None
    if page_size:
        # one page as the packed rows (their heads and strides), the pools among the streamed tensors
        streamed = (k, v, *streamed)
        k, v = k[0], v[0]
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        h, d = q.shape[1], q.shape[2]
        hk = k.shape[1]
        sq, sk = int(max_seqlen_q), int(max_seqlen_k)
    else:
        batch, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
    for name, t, n in (("q", q, sq), ("k", k, sk), ("v", v, sk)):
        # in-sequence offsets (row · row stride, and column · column stride: an FP8 V may have its seqlen
        # dim contiguous) are 32-bit in the kernels; batch/head/start ones 64-bit
        row_stride = t.stride(0) if varlen else t.stride(1)
        if n * row_stride > _INT32_MAX or t.shape[-1] * t.stride(-1) > _INT32_MAX:
            raise FlashAttnError(
                f"{name} has seqlen {n} with strides {tuple(t.stride())}: in-sequence offsets exceed 2^31 "
                f"elements; split the sequence or use a layout with a smaller row stride"
            )
    left, right = window_size
    if causal:
        right = 0
    dv = v.shape[-1]
    cuda, capability = tma.device_facts(q.device)
    fp8 = q.dtype == torch.float8_e4m3fn
    tensors = (q, k, *streamed) if fp8 else (q, k, v, *streamed)
    spec = routes.Spec(
        batch, h, hk, sq, sk, d, dv, _DTYPE_NAMES[q.dtype], varlen, (max(left, -1), max(right, -1)),
        softcap > 0, alibi_slopes is not None, dropout_p > 0, learnable_sink is not None, deterministic,
        cuda, capability, tma.aligned(*tensors) if cuda else False, q.shape[0] if varlen else 0,
        _DTYPE_NAMES[out_dtype or torch.bfloat16] if fp8 else "", page_size,
    )
    scalars = (
        softmax_scale * LOG2E,
        softmax_scale / softcap if softcap > 0 else 0.0,
        softcap * LOG2E,
        left, right, float(dropout_p), int(rng_seed), int(rng_offset),
    )
    flags = dict(
        GROUP=h // hk, HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=host.block_d(d, q.dtype.itemsize),
        BLOCK_DV=host.block_dv(d, dv, q.dtype.itemsize), IS_VARLEN=varlen, WINDOW_LEFT=left >= 0,
        WINDOW_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_DROPOUT=dropout_p > 0, DOT_PREC=host.dot_precision(q.dtype),
    )
    return _Problem(spec, scalars, flags)


def spec_of(q, k, v, *, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
            dropout_p: float = 0.0, learnable_sink=None, cu_seqlens_q=None, max_seqlen_q=None,
            max_seqlen_k=None, deterministic: bool = False, dout=None, out_dtype=None) -> routes.Spec:
    """The routing spec of a call on these tensors (dout: the backward's, whose alignment counts too;
    out_dtype: an FP8 call's, None for bfloat16): what attention_forward / attention_backward route by, for
    callers that build a route of their own."""
    return _problem(q, k, v, 1.0, causal, window_size, softcap, alibi_slopes, dropout_p, 0, 0, cu_seqlens_q,
                    max_seqlen_q, max_seqlen_k, learnable_sink, deterministic,
                    () if dout is None else (dout,), out_dtype).spec


def problem_of(q, k, v, softmax_scale: float, softcap: float = 0.0) -> _Problem:
    """The derived problem of a padded-layout call without a mask or options but the softcap: what a
    block-sparse call launches the Gluon forward with (backends/triton/block_sparse.py)."""
    return _problem(q, k, v, softmax_scale, False, (-1, -1), softcap, None, 0.0, 0, 0, None, None, None, None)


def _alibi_args(alibi_slopes, dummy):
    if alibi_slopes is None:
        return dummy, 0
    return alibi_slopes, (alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)


def _cacheable(q, streamed: tuple, softmax_scale, window_size) -> bool:
    """Whether a call's derivations are cached: it may take a Gluon kernel (a head dim it takes, 16-byte
    aligned streamed tensors), it launches through plans, and its options key a dict (a float scale: an int
    one would specialise otherwise; a tuple window)."""
    if not (launch_mod.direct(q) and type(softmax_scale) is float and type(window_size) is tuple
            and q.shape[-1] in routes.GLUON_HEADDIMS):
        return False
    pointers = 0
    for t in streamed:
        pointers |= t.data_ptr()
    return pointers % 16 == 0


def _varlen_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """What a varlen call adds to a signature: the batch and the maxima, which size the grids and the
    buffers (the packed tensors' shapes are in the key already); cu_seqlens' values are per call (the
    kernels read them, and the tile offsets a call launches derive from them). None: the padded layout."""
    if cu_seqlens_q is None:
        return None
    return cu_seqlens_q.shape, cu_seqlens_k.shape, int(max_seqlen_q), int(max_seqlen_k)


def _forward_signature(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                       rng_seed, rng_offset, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k):
    """Everything a forward's derivations depend on down to the launch's arguments but the tensors."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, softmax_scale, causal, window_size, softcap, dropout_p, rng_seed, rng_offset,
            _tensor_options(alibi_slopes, learnable_sink), config.generation,
            _varlen_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _backward_signature(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        dropout_p, rng_seed, rng_offset, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, route, block_mask):
    """Everything a backward's derivations depend on down to the launch's arguments but the tensors; a
    block-sparse call's route and the mask's list shapes among them (they fix the mask's scalar arguments)."""
    return (dout.shape, q.shape, k.shape, v.shape, out.shape, lse.shape, dout.stride(), q.stride(),
            k.stride(), v.stride(), out.stride(), lse.stride(), dout.dtype, q.dtype, k.dtype, v.dtype,
            out.dtype, lse.dtype, q.device, softmax_scale, causal, window_size, softcap, dropout_p, rng_seed,
            rng_offset, _tensor_options(alibi_slopes, learnable_sink), config.generation, route,
            None if block_mask is None else block_mask.shapes(),
            _varlen_key(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _tensor_options(alibi_slopes, learnable_sink) -> tuple:
    """What the tensor options add to a signature: which are given, and the slopes' layout (its batch
    stride is a kernel argument), the tensors themselves being per call."""
    return (None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride()),
            learnable_sink is None)


def _split_forward(q, k, v, pb, route, softmax_scale, causal, window_size, softcap, alibi_slopes):
    # the decode kernel over k and v as full caches of seqlen_k keys (its lse: (b, h, sq), +inf where a row
    # sees no key, as here); its split partials in the stream's workspace (none while a graph is captured)
    return decode.kvcache_forward(q, k, v, cache_len=pb.seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  num_splits=route.num_splits, workspace=STREAM_WORKSPACE)


def _remember(cache: dict, key: tuple, entry: tuple) -> None:
    if len(cache) >= _CACHED_SIGNATURES:
        cache.clear()
    cache[key] = entry


def attention_forward(q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0, learnable_sink=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      route=None, descales=None, out_dtype=None, block_table=None):
    """out (like q, with v's head dim, q's dtype) and lse float32 natural log (+inf: the row saw no key).
    route: routes.GluonForward / routes.TritonForward / decode_routes.SplitForward to run instead of the
    default one.
    descales, out_dtype: FP8 calls only (attention_forward_fp8).
    block_table: (batch, max_pages) int32, varlen only: k and v are page pools (num_pages, page_size,
    heads_k, ·) (flashattn.paged), read in place where the route reads pages (routes.reads_pages), else
    gathered into the packed layout first."""
    if block_table is not None:
        return _paged_forward(q, k, v, block_table, route, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                              dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset,
                              learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              descales=descales, out_dtype=out_dtype)
    key = None
    if descales is None and route is None and _cacheable(q, (q, k, v), softmax_scale, window_size):
        key = _forward_signature(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                 dropout_p, rng_seed, rng_offset, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k)
        hit = _forward_cache.get(key)
        if hit is not None:
            pb, route, out_shape, lse_shape, prepared = hit
            if prepared is None:  # a split-KV forward: the decode launcher keeps its own launch
                return _split_forward(q, k, v, pb, route, softmax_scale, causal, window_size, softcap,
                                      alibi_slopes)
            # sizes unpacked: torch.empty parses separate ints faster than a tuple (~0.6 us), or a Size (~1.3)
            out = torch.empty(*out_shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(*lse_shape, dtype=torch.float32, device=q.device)
            gluon.forward(pb, route, q, k, v, out, lse, prepared, alibi_slopes, learnable_sink, cu_seqlens_q,
                          cu_seqlens_k)
            return out, lse
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k, learnable_sink,
                  out_dtype=out_dtype if descales is not None else None)
    if route is None:
        route = routes.forward_route(pb.spec)
    if isinstance(route, decode_routes.SplitForward):
        decode_routes.split_forward_route(pb.spec)  # refuses a call it does not take
        if key is not None:
            _remember(_forward_cache, key, (pb, route, None, None, None))
        return _split_forward(q, k, v, pb, route, softmax_scale, causal, window_size, softcap, alibi_slopes)
    out_shape = (*q.shape[:-1], pb.dv)
    out = torch.empty(out_shape, dtype=q.dtype if out_dtype is None else out_dtype, device=q.device)
    lse_shape = (pb.nheads, q.shape[0]) if pb.varlen else (pb.batch, pb.nheads, pb.seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if isinstance(route, routes.GluonForward):
        if descales is not None and pb.varlen:
            # its varlen launch stopped on an illegal instruction on the H200 (the padded one is correct);
            # likely cause: a sequence's first key starts its K-major V tiles in their innermost dim, which
            # a TMA copy needs 16-byte aligned (the fault the varlen backward's stats copy had)
            raise FlashAttnError("the Gluon FP8 forward takes the padded layout only; varlen FP8 calls take "
                                 "the default (Triton) route")
        if descales is not None and out.dtype not in (torch.float16, torch.bfloat16):
            raise FlashAttnError(f"out_dtype is {out.dtype}; the Gluon FP8 forward writes float16 or "
                                 f"bfloat16")
        prepared = gluon.forward(pb, route, q, k, v, out, lse, alibi_slopes=alibi_slopes,
                                 learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, descales=descales)
        if key is not None:
            _remember(_forward_cache, key, (pb, route, out_shape, lse_shape, prepared))
        return out, lse
    cfg = route.tiles
    n_bh = pb.batch * pb.nheads
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    descs = [tma.descriptor(t, cfg.block_n) for t in (k, v)] if route.tma else [None, None]
    scales, scale_strides = _descale_args(descales, pb, q)
    launch(
        attn_fwd_kernel, (host.cdiv(pb.seqlen_q, cfg.block_m) * n_bh,),
        q, k, v, out, lse,
        cu_seqlens_q if pb.varlen else q, cu_seqlens_k if pb.varlen else q, alibi,
        learnable_sink if learnable_sink is not None else q, *descs, *scales,
        *pb.rows(q), *pb.rows(k), *pb.rows(v), v.stride(-1), *pb.rows(out), *pb.lse_strides(lse),
        stride_alibi, *scale_strides, pb.nheads, *pb.bounds(q, k), pb.seqlen_q, pb.seqlen_k, *pb.scalars,
        n_bh, route.lpt_group,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SINK=learnable_sink is not None, USE_TMA=route.tma,
        FP8=descales is not None, **pb.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg,
    )
    return out, lse


def _paged_forward(q, k, v, block_table, route, **kw):
    """attention_forward of a paged call: on the pools where the route reads pages, else on the keys
    gathered into the packed layout (with the given route, or the packed call's default). A call on the
    pools keeps its derivations as attention_forward's do, the block table's shape and strides in its
    signature (the page size and pool size in the pools' shapes)."""
    descales = kw["descales"]
    key = None
    scale, window = kw["softmax_scale"], kw["window_size"]
    if descales is None and route is None and _cacheable(q, (q, k, v), scale, window):
        key = ("paged", block_table.shape, block_table.stride(), _forward_signature(
            q, k, v, scale, kw["causal"], window, kw["softcap"], kw["alibi_slopes"],
            kw["dropout_p"], kw["rng_seed"], kw["rng_offset"], kw["learnable_sink"], kw["cu_seqlens_q"],
            kw["cu_seqlens_k"], kw["max_seqlen_q"], kw["max_seqlen_k"]))
        hit = _forward_cache.get(key)
        if hit is not None:
            pb, chosen, prepared = hit
            return _on_pools(pb, chosen, q, k, v, block_table, prepared, kw)[:2]
    pb = _problem(q, k, v, scale, kw["causal"], window, kw["softcap"], kw["alibi_slopes"], kw["dropout_p"],
                  kw["rng_seed"], kw["rng_offset"], kw["cu_seqlens_q"], kw["max_seqlen_q"],
                  kw["max_seqlen_k"], kw["learnable_sink"],
                  out_dtype=kw["out_dtype"] if descales is not None else None, page_size=k.shape[1])
    chosen = route if route is not None else routes.forward_route(pb.spec)
    # a table without columns holds no key: the kernel's page lookup needs one column at least
    if not routes.reads_pages(pb.spec, chosen) or block_table.shape[1] == 0:
        k, v = paged.gather_pages(k, v, block_table, kw["cu_seqlens_k"], kw["max_seqlen_k"])
        return attention_forward(q, k, v, route=route, **kw)
    out, lse, prepared = _on_pools(pb, chosen, q, k, v, block_table, None, kw)
    if key is not None:
        _remember(_forward_cache, key, (pb, chosen, prepared))
    return out, lse


def _on_pools(pb, route, q, k, v, block_table, prepared, kw) -> tuple:
    """(out, lse, the launch prepared) of a paged call on its pools (prepared: a kept one, or None)."""
    out = torch.empty((*q.shape[:-1], pb.dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((pb.nheads, q.shape[0]), dtype=torch.float32, device=q.device)
    prepared = gluon.forward(pb, route, q, k, v, out, lse, prepared, alibi_slopes=kw["alibi_slopes"],
                             learnable_sink=kw["learnable_sink"], cu_seqlens_q=kw["cu_seqlens_q"],
                             cu_seqlens_k=kw["cu_seqlens_k"], block_table=block_table)
    return out, lse, prepared


def _descale_args(descales, pb: _Problem, dummy) -> tuple[tuple, tuple]:
    """The kernel's (Q_SCALE, K_SCALE, V_SCALE) and their (batch, head) strides with q_scale_group: a (1,)
    descale has strides 0; q's (batch, nheads_k) one is shared by each group of query heads."""
    if descales is None:
        return (dummy,) * 3, (0,) * 6 + (1,)
    strides = []
    for t in descales:
        strides += (0, 0) if t.numel() == 1 else (t.stride(0), t.stride(1))
    q_group = pb.nheads // pb.nheads_k if descales[0].numel() > 1 and descales[0].shape[1] != pb.nheads else 1
    return tuple(descales), (*strides, q_group)


def attention_forward_fp8(q, k, v, q_descale, k_descale, v_descale, *, out_dtype, softmax_scale: float,
                          causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                          max_seqlen_k=None, route=None):
    """(out in out_dtype, lse float32) of e4m3 q, k, v with float32 descales, each (1,) or (batch, heads):
    q's per query head or per kv head, k's and v's per kv head. On a GPU, a v whose seqlen dim is not
    contiguous (with 16-byte aligned strides) is first copied into that layout, the K-major operand of FP8
    P·V: read in place, the Triton kernel ran 1.3-3.9x slower on the H200 (the fp8 suite's rowv rows)."""
    if q.is_cuda:
        varlen = cu_seqlens_q is not None
        vt = gluon.kmajor_v(v, varlen)  # (batch | 1, heads_k, dv, seqlen): v itself where laid out so
        v = vt[0].permute(2, 0, 1) if varlen else vt.permute(0, 3, 1, 2)
    return attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, route=route,
                             descales=(q_descale, k_descale, v_descale), out_dtype=out_dtype)


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0,
                       learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, deterministic=False, route=None, grads=None, block_mask=None):
    """dq, dk, dv shaped like q, k, v (dk/dv summed over each GQA group), and dsink ((h,) float32 or None).
    grads: (dq, dk, dv) to write them into instead of new tensors (head_groups.py's views of the whole
    call's gradients), each 16-byte aligned with a contiguous last dim and 16-byte aligned strides.
    block_mask: a block-sparse call's BlockMaskKernelTensors, on an explicit Gluon route that takes it
    (sparse_routes.gluon_sparse_backward; no band: the mask is the call's).

    The Gluon backward adds dQ in a varying order unless `deterministic`, which takes its fixed-order
    variant (routes.GluonBackward.deterministic; with a learnable sink the Triton programs, where every
    gradient element is written by one program). route: as attention_forward's. Without one, a call whose
    float32 dQ buffer would pass routes.DQ_BUFFER_CAP runs by groups of heads (head_groups.py).
    """
    if block_mask is not None and not isinstance(route, routes.GluonBackward):
        raise FlashAttnError(f"a block mask takes the Gluon backward's block-sparse route "
                             f"(sparse_routes.gluon_sparse_backward), not {type(route).__name__}")
    if route is None:
        groups = routes.backward_head_groups(q.numel() * 4, q.shape[-2], k.shape[-2], dropout_p > 0)
        if groups > 1:
            return head_groups.backward_by_head_groups(
                attention_backward, groups, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset, learnable_sink=learnable_sink,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, deterministic=deterministic)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if not lse.is_contiguous():
        # the kernels read the LSE and D (allocated like it, contiguous) with one pair of strides
        lse = lse.contiguous()
    key = None
    # gradients written into given views: not cached (the prepared launch keeps the gradients' strides); a
    # block-sparse call's launch is kept with its route and the mask's list shapes, which fix the mask's
    # scalar arguments (and so what the compiled kernel is specialised on)
    if ((route is None or block_mask is not None) and grads is None and not deterministic
            and _cacheable(q, (q, k, v, dout), softmax_scale, window_size)):
        key = _backward_signature(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, dropout_p, rng_seed, rng_offset, learnable_sink, cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, route, block_mask)
        hit = _backward_cache.get(key)
        if hit is not None:
            pb, route, preprocess, pre_args, prepared = hit
            dk = torch.empty(*k.shape, dtype=k.dtype, device=k.device)  # unpacked: as attention_forward's
            dv = torch.empty(*v.shape, dtype=v.dtype, device=v.device)
            stats, dq_acc = gluon.backward_buffers(pb, q)
            cu_q, offsets = q, (None, None)
            if pb.varlen:
                cu_q = cu_seqlens_q
                offsets = gluon.varlen_backward_offsets(pb, route, cu_seqlens_q, cu_seqlens_k, q, k,
                                                        prepared.schedule)
            preprocess((out, dout, stats[1], cu_q, dq_acc, lse, stats[0], offsets[0], *pre_args))
            return gluon.backward(pb, route, q, k, v, dout, stats, dq_acc, dk, dv, softmax_scale, prepared,
                                  alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k, offsets,
                                  block_mask=block_mask)[:4]
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k, learnable_sink, deterministic,
                  (dout,))
    if route is None:
        route = routes.backward_route(pb.spec)
    if grads is not None:
        dq_out, dk, dv = grads
    else:
        dq_out = None
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu_q = cu_seqlens_q if pb.varlen else q
    cu_k = cu_seqlens_k if pb.varlen else q
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    lse_strides = pb.lse_strides(lse)
    flags = pb.flags

    # the Gluon backward adds dQ into a float32 buffer and reads D with the LSE in base 2 from padded planes
    # (gluon.backward_buffers): the preprocess zeroes the one and fills the other (no launch of its own)
    on_gluon = isinstance(route, routes.GluonBackward)
    offsets = (None, None)
    if on_gluon:
        stats, dq_acc = gluon.backward_buffers(pb, q)
        if pb.varlen:
            # each sequence's rows in the stats planes from a 16-byte aligned offset (gluon.backward_buffers),
            # with the kernel's key tiles
            offsets = gluon.varlen_backward_offsets(pb, route, cu_seqlens_q, cu_seqlens_k, q, k)
        delta, lse2 = stats[1], stats[0]
        delta_rows = stats.shape[-1]
        # the planes' rows: (b·h, sq padded), or (h, total_q) under varlen
        delta_strides = (0, stats.stride(1)) if pb.varlen else (pb.nheads * stats.stride(1), stats.stride(1))
    else:
        delta = lse2 = dq_acc = torch.empty_like(lse)
        delta_rows, delta_strides = pb.seqlen_q, lse_strides
    pre_m = 64 if q.device.type == "cuda" else 32
    preprocess = Bound(
        attn_bwd_preprocess_kernel, (host.cdiv(pb.seqlen_q, pre_m), pb.batch * pb.nheads),
        dict(HEAD_DIM_V=pb.dv, BLOCK_DV=flags["BLOCK_DV"], BLOCK_M=pre_m, IS_VARLEN=pb.varlen,
             GLUON=on_gluon, HEAD_DIM=pb.d, BLOCK_D=flags["BLOCK_D"]),
    )
    pre_args = (*pb.rows(out), *pb.rows(dout), *lse_strides, *delta_strides, pb.nheads, pb.bounds(q, k)[0],
                delta_rows)
    preprocess((out, dout, delta, cu_q, dq_acc, lse, lse2, offsets[0], *pre_args))
    if on_gluon:
        dq, dk, dv, dsink, prepared = gluon.backward(
            pb, route, q, k, v, dout, stats, dq_acc, dk, dv, softmax_scale, alibi_slopes=alibi_slopes,
            learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            varlen_offsets=offsets, dq_out=dq_out, block_mask=block_mask)
        if key is not None:
            _remember(_backward_cache, key, (pb, route, preprocess, pre_args, prepared))
        return dq, dk, dv, dsink
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq_out is None else dq_out
    has_sink = learnable_sink is not None
    # per-row shares of the sink gradient, written by the dQ role (which has P and dP in fp32)
    dsink_rows = torch.zeros_like(lse) if has_sink else lse
    kv_cfg, q_cfg = route.dkdv_tiles, route.dq_tiles
    # the dK/dV role loads Q/dO through pointers (kernels/triton/attn_bwd.py says why); the dQ role streams
    # K/V
    k_desc, v_desc = [tma.descriptor(t, q_cfg.block_n) for t in (k, v)] if route.tma else [None, None]
    roles = (
        (host.cdiv(pb.seqlen_k, kv_cfg.block_n) * pb.batch * pb.nheads_k, True, kv_cfg, False, (None, None)),
        (host.cdiv(pb.seqlen_q, q_cfg.block_m) * pb.batch * pb.nheads, False, q_cfg, route.tma,
         (k_desc, v_desc)),
    )
    for n_programs, role_dkdv, cfg, use_tma, descs in roles:
        launch(
            attn_bwd_kernel, (n_programs,),
            q, k, v, dout, lse, delta, dq, dk, dv, cu_q, cu_k, alibi, learnable_sink if has_sink else q,
            dsink_rows, *descs,
            *pb.rows(q), *pb.rows(k), *pb.rows(v), *pb.rows(dout), *pb.rows(dq), *pb.rows(dk), *pb.rows(dv),
            *lse_strides, stride_alibi, pb.nheads, pb.nheads_k, *pb.bounds(q, k), pb.seqlen_q, pb.seqlen_k,
            *pb.scalars, softmax_scale, pb.batch, route.kv_group, route.q_group,
            DKDV_BLOCK_M=kv_cfg.block_m, DKDV_BLOCK_N=kv_cfg.block_n, DQ_BLOCK_M=q_cfg.block_m,
            DQ_BLOCK_N=q_cfg.block_n, ROLE_DKDV=role_dkdv, HAS_SINK=has_sink, USE_TMA=use_tma,
            **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
        )
    # lse is (h, total) in varlen, (b, h, sq) otherwise: sum everything but the head axis
    dsink = dsink_rows.sum(1 if pb.varlen else (0, 2)) if has_sink else None
    return dq, dk, dv, dsink
