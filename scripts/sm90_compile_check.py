"""Compile every kernel variant the public API reaches for sm_90a, on a machine without a GPU.

The CPU tests run the kernels under TRITON_INTERPRET=1, which never compiles them: a kernel can pass every
interpreter test and still fail in Triton's GPU lowering (layouts, shared-memory budget, ptxas). This script
swaps Triton's driver for one that reports an H200 (sm_90, warp 32), turns every launch into a warm-up
(compile, do not run), and calls the public functions on CPU tensors with the H200 tile table, so the whole
TTIR -> TTGIR -> LLVM -> PTX -> cubin pipeline runs here, for free, before any device time is spent.

    python scripts/sm90_compile_check.py [dense] [decode] [sparse] [--quick] [--part I/N]

prints a line per case, then how many cases there were, and exits 1 if any failed (or none ran); --quick:
the bf16 subset tests/backends/triton/test_sm90_compile.py runs; --part I/N: every N-th case from the I-th
(the test splits the dense family so that xdist's workers share it).
"""

import os
import sys
import time
from functools import partial

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _H200Driver:
    """What JITFunction.run asks of a driver before it compiles: a device, a stream and a target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


_SMEM = 232448  # bytes of shared memory a block may use on the H200 (227 KiB opt-in)
driver.set_active(_H200Driver())
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    # the launch would raise OutOfResources here; the compiler does not check it
    if kernel.metadata.shared > _SMEM:
        raise RuntimeError(f"{self.__name__} needs {kernel.metadata.shared} B of shared memory > {_SMEM}")
    return kernel


JITFunction.run = _compile_only

# import every kernel module while TRITON_INTERPRET is unset, then route CPU tensors to the Triton launchers
# as on an H200: the device facts routing reads, its SM count
import dataclasses  # noqa: E402

from flashattn import config  # noqa: E402
from flashattn.backends.triton import attention as dense_ops  # noqa: E402
from flashattn.backends.triton import block_sparse, gluon, routes, tma  # noqa: E402, F401
from flashattn.backends.triton import decode as decode_ops  # noqa: E402
from flashattn.backends.triton import merge as merge_ops  # noqa: E402

config.INTERPRET = True
tma.device_facts = lambda device: (True, (9, 0))
merge_ops.sm_count = decode_ops.sm_count = gluon.sm_count = lambda device: 132
_tiles = merge_ops.combine_tiles
merge_ops.combine_tiles = lambda n, rows, bd, device: _tiles(n, rows, bd, torch.device("meta"))


def _t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(shape, dtype=dtype).requires_grad_(grad)


def _fwd_bwd(fn, *tensors, **kw):
    """The public call and its backward, on the routes an H200 would take."""
    out = fn(*tensors, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


def _routes(q, k, v, fwd, bwd, causal=False, **kw):
    """The dense launchers forward and backward on explicit routes: fwd(spec) and bwd(spec) make them from the
    call's spec (routes.triton_forward_route, ...); kw: options and route fields to replace (tma=...)."""
    scale = q.shape[-1] ** -0.5
    pb = dense_ops._problem(q, k, v, scale, causal, (-1, -1), 0.0, None, 0.0, 0, 0, None, None, None, None)
    f, b = fwd(pb.spec), bwd(pb.spec)
    fields = {name: kw.pop(name) for name in list(kw) if name in ("tma",)}
    f, b = dataclasses.replace(f, **fields), dataclasses.replace(b, **fields)
    options = dict(softmax_scale=scale, causal=causal)
    out, lse = dense_ops.attention_forward(q, k, v, route=f, **options)
    dense_ops.attention_backward(torch.ones_like(out), q, k, v, out, lse, route=b, **options)


def _varlen_backward(q, k, v, cu, max_seqlen, bwd, causal=False):
    """The varlen launchers, forward on its default route and backward on bwd(spec)'s."""
    options = dict(softmax_scale=q.shape[-1] ** -0.5, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    out, lse = dense_ops.attention_forward(q, k, v, **options)
    spec = dense_ops.spec_of(q, k, v, causal=causal, cu_seqlens_q=cu, max_seqlen_q=max_seqlen,
                             max_seqlen_k=max_seqlen)
    dense_ops.attention_backward(torch.ones_like(out), q, k, v, out, lse, route=bwd(spec), **options)


def _on_gluon(fn, *args, launchers=("backward", "forward"), **kw):
    """fn(*args, **kw), which must launch the Gluon kernels named (both by default): a case meant for them
    that the routes sent to the Triton kernels would compile those instead, and pass."""
    ran = []
    real = gluon.forward, gluon.backward

    def spy(name, launcher):
        return lambda *a, **k: (ran.append(name), launcher(*a, **k))[1]

    gluon.forward, gluon.backward = spy("forward", real[0]), spy("backward", real[1])
    try:
        fn(*args, **kw)
    finally:
        gluon.forward, gluon.backward = real
    if sorted(set(ran)) != sorted(launchers):
        raise RuntimeError(f"the Gluon kernels {launchers} did not all run: {ran}")


def _with_tiles(spec, fn, *args, **kw):
    with config.use_tiles(spec):
        fn(*args, **kw)


def _with_forward_fields(fields: dict, fn, *args, **kw):
    """fn(*args, **kw) with the forward's default route's `fields` replaced (its signature cache emptied
    before and after, so that no entry of either kind serves the other)."""
    default = routes.forward_route
    routes.forward_route = lambda spec: dataclasses.replace(default(spec), **fields)
    dense_ops._forward_cache.clear()
    try:
        fn(*args, **kw)
    finally:
        routes.forward_route = default
        dense_ops._forward_cache.clear()


QUICK = "--quick" in sys.argv  # bf16 at the table's head dims only: the CI test's subset


def dense_cases():
    from flashattn import flash_attn_func, flash_attn_varlen_func

    triton = (routes.triton_forward_route, routes.triton_backward_route)
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16, torch.float32):
        # fp32 compiles take ~30-100 s each (ptxas): one head dim covers its DOT_PREC path
        dims = (64, 128, 256) if QUICK else (40, 64, 96, 128, 192, 256) if dtype != torch.float32 else (64,)
        for d in dims:
            for causal in (False, True):
                # the Triton kernels on both load paths at the short-sequence tile rows, and the long rows
                # (N > 2K) with descriptors where their route takes them
                for sq, sk, use_tma in ((130, 70, False), (130, 70, True), (2100, 2060, True)):
                    if use_tma and (dtype == torch.float32 or d != 128):
                        continue  # descriptors only at d = 128
                    q = _t(1, sq, 2, d, dtype=dtype)
                    k, v = (_t(1, sk, 1, d, dtype=dtype) for _ in range(2))
                    yield f"dense triton {dtype} d={d} causal={causal} sq={sq} tma={use_tma}", partial(
                        _routes, q, k, v, *triton, causal=causal, tma=use_tma)
    # the Gluon kernels through the public call: d = 64 and 128, causal or not, GQA, fp16 and bf16
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for causal in (False, True):
                for n in (1100, 4500) if d == 64 else (1100,):  # two and three consumer warpgroups
                    q = _t(1, n, 4, d, dtype=dtype, grad=True)
                    k, v = (_t(1, n, 2, d, dtype=dtype, grad=True) for _ in range(2))
                    yield f"dense gluon {dtype} d={d} causal={causal} n={n}", partial(
                        _fwd_bwd, flash_attn_func, q, k, v, causal=causal)
    # the Gluon kernels' options, compile-time variants of both: every band shape (right edge at the diagonal,
    # elsewhere, none; left edge or none), softcap, ALiBi slopes (h,) and (b, h), a sink; d = 64 on two
    # consumer warpgroups (a band narrower than 4K) and three (the tile override), d = 128. The quick set
    # covers each option once per configuration
    # qk_ahead: the forward's next QK^T issued before the softmax, on 128-row tiles of 64 keys
    two, three = (64, None, None), (64, "fwd_ws=192,128,4,3", None)
    ahead = [(d, "fwd_ws=128,64,4,2", dict(qk_ahead=True)) for d in (64, 128)]
    if QUICK:
        cases = [(two, "swa+softcap", dict(causal=True, window_size=(255, -1), softcap=20.0)),
                 (three, "window+alibi_bh+sink", dict(window_size=(100, 37), alibi=(1, 4), sink=True)),
                 ((128, None, None), "right+softcap+alibi", dict(window_size=(-1, 8), softcap=20.0,
                                                                 alibi=(4,))),
                 ((128, None, None), "left+sink", dict(window_size=(300, -1), sink=True)),
                 (ahead[1], "causal", dict(causal=True))]
    else:
        options = {"swa": dict(causal=True, window_size=(255, -1)), "window": dict(window_size=(100, 37)),
                   "left": dict(window_size=(300, -1)), "right": dict(window_size=(-1, 8)),
                   "softcap": dict(softcap=20.0), "alibi": dict(alibi=(4,)), "alibi_bh": dict(alibi=(1, 4)),
                   "sink": dict(sink=True),
                   "all": dict(window_size=(100, 37), softcap=20.0, alibi=(1, 4), sink=True)}
        cases = [(c, name, opts) for c in (two, three, (128, None, None)) for name, opts in options.items()]
        cases += [(c, name, options[name]) for c in ahead for name in ("swa", "all")]
    for (d, tiles, fields), name, opts in cases:
        q = _t(1, 1100, 4, d, grad=True)
        k, v = (_t(1, 1100, 2, d, grad=True) for _ in range(2))
        opts = dict(opts)
        if "alibi" in opts:
            opts["alibi_slopes"] = torch.rand(opts.pop("alibi"))
        if opts.pop("sink", False):
            opts["learnable_sink"] = torch.zeros(4, requires_grad=True)
        call = partial(_on_gluon, _fwd_bwd, flash_attn_func, q, k, v, **opts)
        if fields:
            call = partial(_with_forward_fields, fields, call)
        label = " ".join([tiles or "table tiles", *(fields or ())])
        yield f"dense gluon d={d} {label} {name}", partial(_with_tiles, tiles, call) if tiles else call
    # the Gluon kernels at d = 256 (the forward's 64-key steps beside one Q buffer, the wide heads' backward),
    # padded and varlen
    cu, cu_k = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32), torch.tensor([0, 5, 70, 70, 300],
                                                                                  dtype=torch.int32)
    d256 = [("causal", dict(causal=True)), ("swa+softcap+sink", dict(causal=True, window_size=(255, -1),
                                                                      softcap=20.0, sink=True))]
    if not QUICK:
        d256 += [("full", {}), ("window+alibi_bh", dict(window_size=(100, 37), alibi=True))]
    for varlen in (False, True):
        for name, opts in d256:
            opts = dict(opts)
            if opts.pop("alibi", False):  # (batch, nheads): 4 sequences, or 1 batch
                opts["alibi_slopes"] = torch.rand(4 if varlen else 1, 4)
            if opts.pop("sink", False):
                opts["learnable_sink"] = torch.zeros(4, requires_grad=True)
            if varlen:
                q, k, v = _t(208, 4, 256, grad=True), _t(300, 2, 256, grad=True), _t(300, 2, 256, grad=True)
                args = (flash_attn_varlen_func, q, k, v, cu, cu_k, 130, 230)
            else:
                q = _t(1, 1100, 4, 256, grad=True)
                k, v = (_t(1, 1100, 2, 256, grad=True) for _ in range(2))
                args = (flash_attn_func, q, k, v)
            yield f"{'varlen' if varlen else 'dense'} gluon d=256 {name}", partial(
                _on_gluon, _fwd_bwd, *args, **opts)
    # dv < d: Q and K padded to the tile width, O staged in Q's buffer (the backward attn_bwd.py's at
    # d <= 128, attn_bwd_keys.py's at width 192, attn_bwd_dsplit.py's at 256); d in 129..192 as three 64-wide
    # chunks, on one Q buffer beside the 128-key ring; one Q buffer at d = 256 too (64-key steps)
    cases = ((192, 128, None),) if QUICK else (
        (192, 128, None), (160, 128, None), (192, 64, None), (192, 128, "fwd_ws=128,64,4,3"), (128, 64, None),
        (96, 64, None), (40, 64, None), (256, 256, "fwd_ws=128,64,4,2"))
    for d, dv, tiles in cases:
        q = _t(1, 1100, 4, d, grad=True)
        k, v = _t(1, 1100, 2, d, grad=True), _t(1, 1100, 2, dv, grad=True)
        launchers = ("forward", "backward") if dv <= d else ("forward",)  # the Gluon backward: dv <= d
        call = partial(_on_gluon, _fwd_bwd, flash_attn_func, q, k, v, launchers=launchers, causal=True,
                       softcap=20.0)
        yield f"dense gluon d={d} dv={dv} {tiles or 'table tiles'} causal softcap", (
            partial(_with_tiles, tiles, call) if tiles else call)
    # the Gluon backward's group split (a named route): MQA and GQA parts adding dK / dV with atomics,
    # padded and varlen, d = 64 (64-row steps, deferred dQ) and 128
    def split(n):
        return lambda spec: dataclasses.replace(routes.gluon_backward_route(spec), group_split=n)

    for d, dv, hk, n, causal in ((128, 128, 1, 4, True), (64, 64, 2, 2, False), (256, 256, 1, 4, True),
                                 (192, 128, 2, 2, False)):
        q, k, v = _t(1, 1100, 8, d), _t(1, 1100, hk, d), _t(1, 1100, hk, dv)
        yield f"dense gluon bwd d={d} dv={dv} h8/{hk} group_split={n} causal={causal}", partial(
            _routes, q, k, v, routes.gluon_forward_route, split(n), causal=causal)
    # head dims below their tiles' width (the default routes take them; named here so that every padded
    # shape builds whatever the routes' predicates): TMA reads zeros past d and dv and clips the stores there
    if not QUICK:
        gluon_routes = (routes.gluon_forward_route, routes.gluon_backward_route)
        for d, dv, hk, causal in ((96, 96, 2, True), (40, 40, 2, False), (80, 80, 1, True),
                                  (128, 96, 2, False), (72, 64, 2, True), (200, 96, 2, True),
                                  (160, 160, 2, True), (192, 192, 2, False)):
            q, k, v = _t(1, 1100, 8, d), _t(1, 1100, hk, d), _t(1, 1100, hk, dv)
            yield f"dense gluon padded d={d} dv={dv} h8/{hk} causal={causal}", partial(
                _routes, q, k, v, *gluon_routes, causal=causal)
        for d, dv in ((96, 96), (160, 96)):
            q, k, v = _t(208, 4, d), _t(208, 2, d), _t(208, 2, dv)
            yield f"varlen gluon bwd padded d={d} dv={dv} causal", partial(
                _varlen_backward, q, k, v, torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32), 130,
                routes.gluon_backward_route, causal=True)
        # the 128-key wide-head backward (attn_bwd_keys.py, the default at width 192), and at width 192 the
        # 64-key one (attn_bwd_dsplit.py) on its explicit route (A/B timing)
        for d, dv, causal in ((192, 128, True), (160, 104, False), (192, 64, True)):
            q, k, v = _t(1, 1100, 8, d), _t(1, 1100, 2, d), _t(1, 1100, 2, dv)
            yield f"dense gluon bwd 128 keys d={d} dv={dv} causal={causal}", partial(
                _routes, q, k, v, routes.gluon_forward_route, routes.wide_keys_backward_route, causal=causal)
        q, k, v = _t(208, 4, 192), _t(208, 2, 192), _t(208, 2, 128)
        yield "varlen gluon bwd 128 keys d=192 dv=128 causal", partial(
            _varlen_backward, q, k, v, torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32), 130,
            routes.wide_keys_backward_route, causal=True)
        for d, causal in ((192, True), (160, False)):
            q, k, v = _t(1, 1100, 8, d), _t(1, 1100, 2, d), _t(1, 1100, 2, 128)
            yield f"dense gluon bwd d-split d={d} dv=128 causal={causal}", partial(
                _routes, q, k, v, routes.gluon_forward_route, routes.dsplit_backward_route, causal=causal)
    cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32)
    q, k, v = _t(208, 8, 128), _t(208, 1, 128), _t(208, 1, 128)
    yield "varlen gluon bwd d=128 h8/1 group_split=8 causal", partial(
        _varlen_backward, q, k, v, cu, 130, split(8), causal=True)
    # d = 128 without GQA: ptxas crashed (SIGSEGV) on the dK/dV program's descriptor loads at these shapes,
    # so that program loads Q/dO through pointers
    for sq, causal in ((300, False), (300, True), (512, True)):
        q, k, v = (_t(1, sq, 4, 128) for _ in range(3))
        yield f"dense triton d=128 mha sq={sq} causal={causal}", partial(_routes, q, k, v, *triton,
                                                                         causal=causal)
    # 2-stage pipelines must take the pointer path: ptxas crashes on them with descriptors
    q, k, v = (_t(2, 130, 4, 64) for _ in range(3))
    yield "dense triton with 2-stage tiles", partial(
        _with_tiles, "fwd=64,64,4,2;dkdv=32,64,4,2;dq=64,64,4,2", _routes, q, k, v, *triton, causal=True)
    q, k, v = _t(2, 150, 4, 48, grad=True), _t(2, 190, 2, 48, grad=True), _t(2, 190, 2, 32, grad=True)
    yield "dense all features", partial(
        _fwd_bwd, flash_attn_func, q, k, v, dropout_p=0.1, causal=True, window_size=(40, -1), softcap=3.0,
        alibi_slopes=torch.rand(4), learnable_sink=torch.zeros(4, requires_grad=True))
    if not QUICK:
        # a masked dv narrower than d: V's tiles at the head's width (host.block_dv), 256 wide here
        q, k, v = _t(2, 150, 4, 256, grad=True), _t(2, 190, 2, 256, grad=True), _t(2, 190, 2, 200, grad=True)
        yield "dense triton d=256 dv=200 causal", partial(_fwd_bwd, flash_attn_func, q, k, v, causal=True)
    yield from fp8_cases()
    # the Gluon kernels' varlen variants, forward and backward: causal and not at d = 64 and 128, then every
    # option, d = 64 on two and three consumer warpgroups (the forward's), d = 128
    cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32)
    for d in (64,) if QUICK else (64, 128):
        for causal in (False, True):
            q, k, v = _t(208, 4, d, grad=True), _t(208, 2, d, grad=True), _t(208, 2, d, grad=True)
            yield f"varlen gluon d={d} causal={causal}", partial(
                _on_gluon, _fwd_bwd, flash_attn_varlen_func, q, k, v, cu, cu, 130, 130, causal=causal)
    cu_k = torch.tensor([0, 5, 70, 70, 300], dtype=torch.int32)
    for d, tiles in ((64, None), (64, "fwd_ws=192,128,4,3"), (128, None)):
        q, k, v = _t(208, 4, d, grad=True), _t(300, 2, d, grad=True), _t(300, 2, d, grad=True)
        call = partial(_on_gluon, _fwd_bwd, flash_attn_varlen_func, q, k, v, cu, cu_k, 130, 230,
                       window_size=(40, 3), softcap=10.0, alibi_slopes=torch.rand(4, 4),
                       learnable_sink=torch.zeros(4, requires_grad=True))
        yield f"varlen gluon d={d} {tiles or 'table tiles'} window softcap alibi sink", (
            partial(_with_tiles, tiles, call) if tiles else call)
    # paged prefill read in the kernel (inference: no gradient), the loader mapping key tiles through the
    # block table: d = 64 with every option on pages of 256, 128 causal and 192 / dv 128 on pages of 128
    table = torch.tensor([[3, 0], [1, 5], [2, 4], [6, 7]], dtype=torch.int32)
    paged = [(64, 64, 256, dict(window_size=(40, 3), softcap=10.0, alibi_slopes=torch.rand(4, 4),
                                learnable_sink=torch.zeros(4))), (128, 128, 128, dict(causal=True)),
             (192, 128, 128, dict(causal=True))]
    for d, dv, page, opts in paged[1:2] if QUICK else paged:
        q, k, v = _t(208, 4, d), _t(8, page, 2, d), _t(8, page, 2, dv)
        cu_p = torch.tensor([0, 5, 70, 70, 2 * page - 1], dtype=torch.int32)
        yield f"paged gluon fwd d={d} dv={dv} page={page} {sorted(opts)}", partial(
            _on_gluon, flash_attn_varlen_func, q, k, v, cu, cu_p, 130, 2 * page - 1 - 70, block_table=table,
            launchers=("forward",), **opts)
    # deterministic=True on the Gluon backward (its dQ writer warp and counters, the order kept per 128 rows
    # over 64-row steps): the order under a right edge (causal; a two-sided window) and without one (full; a
    # left edge only), d = 64 (deferred dQ) and 128, GQA, padded and varlen
    det = [(64, dict(causal=True)), (128, dict()), (128, dict(window_size=(300, -1))),
           (64, dict(window_size=(100, 37)))]
    for d, opts in det[:2] if QUICK else det:
        q, k, v = _t(1, 1100, 4, d, grad=True), _t(1, 1100, 2, d, grad=True), _t(1, 1100, 2, d, grad=True)
        yield f"dense gluon deterministic d={d} {opts}", partial(
            _on_gluon, _fwd_bwd, flash_attn_func, q, k, v, deterministic=True, **opts)
    # and on the 128-key wide-head backward (attn_bwd_keys.py's three dQ units for the same writer warp):
    # under a right edge (causal) and without one, GQA, padded and varlen
    keys_det = [(192, 128, dict(causal=True)), (160, 104, dict(window_size=(300, -1)))]
    for d, dv, opts in keys_det[:1] if QUICK else keys_det:
        q, k, v = _t(1, 1100, 4, d, grad=True), _t(1, 1100, 2, d, grad=True), _t(1, 1100, 2, dv, grad=True)
        yield f"dense gluon deterministic 128 keys d={d} dv={dv} {opts}", partial(
            _on_gluon, _fwd_bwd, flash_attn_func, q, k, v, deterministic=True, **opts)
    # and on the d-split wide-head backward (attn_bwd_dsplit.py's two rounds of dQ units): d 256 and 224
    # beside dv 256 / 128, under a right edge and without one
    dsplit_det = [(256, 256, dict(causal=True)), (224, 128, dict(window_size=(300, -1)))]
    for d, dv, opts in dsplit_det[:1] if QUICK else dsplit_det:
        q, k, v = _t(1, 1100, 4, d, grad=True), _t(1, 1100, 2, d, grad=True), _t(1, 1100, 2, dv, grad=True)
        yield f"dense gluon deterministic d-split d={d} dv={dv} {opts}", partial(
            _on_gluon, _fwd_bwd, flash_attn_func, q, k, v, deterministic=True, **opts)
    q, k, v = _t(208, 4, 256, grad=True), _t(208, 2, 256, grad=True), _t(208, 2, 256, grad=True)
    yield "varlen gluon deterministic d-split d=256 causal", partial(
        _on_gluon, _fwd_bwd, flash_attn_varlen_func, q, k, v, cu, cu, 130, 130, causal=True,
        deterministic=True)
    q, k, v = _t(208, 4, 192, grad=True), _t(208, 2, 192, grad=True), _t(208, 2, 128, grad=True)
    yield "varlen gluon deterministic 128 keys d=192 dv=128 causal", partial(
        _on_gluon, _fwd_bwd, flash_attn_varlen_func, q, k, v, cu, cu, 130, 130, causal=True,
        deterministic=True)
    if not QUICK:
        # the fixed-order variant at padded head dims, on its explicit route (the default keeps Triton there)
        def fixed_order(spec):
            return dataclasses.replace(routes.gluon_backward_route(spec), deterministic=True)

        for d, dv, causal in ((96, 96, True), (80, 80, False), (128, 96, True)):
            q, k, v = _t(1, 1100, 4, d), _t(1, 1100, 2, d), _t(1, 1100, 2, dv)
            yield f"dense gluon deterministic padded d={d} dv={dv} causal={causal}", partial(
                _routes, q, k, v, routes.gluon_forward_route, fixed_order, causal=causal)
    # the default deterministic route with fields replaced
    def fixed(**fields):
        def make(spec):
            return dataclasses.replace(routes.backward_route(dataclasses.replace(spec, deterministic=True)),
                                       **fields)
        return make

    # the GQA group split (each part's dK and dV into kv heads of its own), each count forced: the three
    # kernels
    for d, dv, n in ((128, 128, 4), (192, 128, 2), (256, 256, 2)) if not QUICK else ((128, 128, 4),):
        q, k, v = _t(1, 700, 8, d), _t(1, 700, 1, d), _t(1, 700, 1, dv)
        yield f"dense gluon deterministic split={n} d={d} dv={dv} causal", partial(
            _routes, q, k, v, routes.gluon_forward_route, fixed(group_split=n), causal=True)
    # packed documents, 4 heads over 2 and (the default split of deterministic calls) 8 over 1
    for h, hk in ((4, 2), (8, 1)) if not QUICK else ((4, 2),):
        q, k, v = _t(208, h, 128, grad=True), _t(208, hk, 128, grad=True), _t(208, hk, 128, grad=True)
        yield f"varlen gluon deterministic d=128 h={h} hk={hk} causal", partial(
            _on_gluon, _fwd_bwd, flash_attn_varlen_func, q, k, v, cu, cu, 130, 130, causal=True,
            deterministic=True)
    # S_dmask (return_attn_probs with dropout): its key tiles are 128, 64 and 32 wide by head dim
    for d in (32, 64, 128, 256):
        q, k, v = _t(2, 150, 4, d), _t(2, 190, 2, d), _t(2, 190, 2, d)
        yield f"S_dmask d={d}", partial(flash_attn_func, q, k, v, 0.1, causal=True, return_attn_probs=True)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 70, 150], [0, 90, 190]))
    yield "S_dmask varlen", partial(flash_attn_varlen_func, q[0], k[0], v[0], cu_q, cu_k, 80, 100, 0.1,
                                    return_attn_probs=True)


def fp8_cases():
    """The FP8 forward (inference): e4m3 q, k, v with per-head descales, V with its seqlen dim contiguous
    (the layout the GPU launcher gives it), at the head dims of the FP8 targets."""
    from flashattn import flash_attn_func, flash_attn_varlen_func, fp8

    def quantized(b, s, h, hk, d):
        q8, qd = fp8.quantize(_t(b, s, h, d), "head")
        k8, kd = fp8.quantize(_t(b, s, hk, d), "head")
        v8, vd = fp8.quantize(_t(b, s, hk, d), "head", seq_contiguous=True)
        return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)

    for d in (64, 128, 256):
        for causal in (False, True):
            qkv, descales = quantized(1, 300, 4, 2, d)
            yield f"fp8 forward d={d} causal={causal}", partial(flash_attn_func, *qkv, causal=causal,
                                                                **descales)
    # head dims below 32: an 8-bit q·kᵀ needs 32 reduction columns (d 16 is padded to 32)
    for d in (16, 40):
        qkv, descales = quantized(1, 70, 4, 2, d)
        yield f"fp8 forward d={d} causal=True", partial(flash_attn_func, *qkv, causal=True, **descales)
    qkv, descales = quantized(2, 190, 4, 2, 128)
    yield "fp8 forward window softcap alibi sink", partial(
        flash_attn_func, *qkv, window_size=(40, 3), softcap=10.0, alibi_slopes=torch.rand(4),
        learnable_sink=torch.zeros(4), **descales)
    cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32)
    q8, k8, v8 = (fp8.quantize(_t(1, 208, h, 128), "tensor")[0][0] for h in (4, 2, 2))
    yield "fp8 forward varlen causal", partial(flash_attn_varlen_func, q8, k8, v8, cu, cu, 130, 130,
                                               causal=True)
    # the Gluon forward's FP8 variant, on an explicit route (the default routes keep FP8 on the Triton one)

    def on_gluon_fp8(qkv, descales, causal=False, window_size=(-1, -1), tiles=None, fields=None, **options):
        q8, k8, v8 = qkv
        spec = dense_ops.spec_of(q8, k8, v8, causal=causal, window_size=window_size, **options)

        def run():
            route = dataclasses.replace(routes.gluon_forward_route(spec), **(fields or {}))
            dense_ops.attention_forward_fp8(q8, k8, v8, *descales.values(), out_dtype=torch.bfloat16,
                                            softmax_scale=0.1, causal=causal, window_size=window_size,
                                            route=route, **options)
        if tiles is not None:
            return partial(_on_gluon, _with_tiles, tiles, run, launchers=("forward",))
        return partial(_on_gluon, run, launchers=("forward",))

    for d in (64, 128, 256):
        for causal in (False, True):
            qkv, descales = quantized(1, 300, 4, 2, d)
            yield f"fp8 gluon d={d} causal={causal}", on_gluon_fp8(qkv, descales, causal=causal)
    qkv, descales = quantized(1, 300, 4, 2, 64)
    yield "fp8 gluon d=64 fwd_ws=192,128,4,3 causal", on_gluon_fp8(qkv, descales, causal=True,
                                                                 tiles="fwd_ws=192,128,4,3")
    for d in (64, 128, 256):
        qkv, descales = quantized(1, 300, 4, 2, d)
        yield f"fp8 gluon d={d} qk_ahead fwd_ws=128,64,4,2 causal", on_gluon_fp8(
            qkv, descales, causal=True, tiles="fwd_ws=128,64,4,2", fields=dict(qk_ahead=True))
    qkv, descales = quantized(2, 190, 4, 2, 128)
    yield "fp8 gluon window softcap alibi sink", on_gluon_fp8(
        qkv, descales, window_size=(40, 3), softcap=10.0, alibi_slopes=torch.rand(4),
        learnable_sink=torch.zeros(4))


def decode_cases():
    from flashattn import flash_attn_with_kvcache

    hk, d, cap = 2, 128, 1024
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16, torch.float32):
        for group in (4,) if QUICK else (1, 4, 8, 32):
            for sq in (1, 4):
                for page in (None, 16) if QUICK else (None, 16, 64, 256):
                    pool = (2, cap) if page is None else (2 * cap // page, page)
                    kc, vc = _t(*pool, hk, d, dtype=dtype), _t(*pool, hk, d, dtype=dtype)
                    table = None if page is None else torch.arange(pool[0], dtype=torch.int32).view(2, -1)
                    cos, sin = torch.rand(cap, d // 2, dtype=dtype), torch.rand(cap, d // 2, dtype=dtype)
                    yield f"decode {dtype} group={group} sq={sq} page={page}", partial(
                        flash_attn_with_kvcache, _t(2, sq, hk * group, d, dtype=dtype), kc, vc,
                        _t(2, sq, hk, d, dtype=dtype), _t(2, sq, hk, d, dtype=dtype), rotary_cos=cos,
                        rotary_sin=sin, cache_seqlens=torch.tensor([5, 700], dtype=torch.int32),
                        block_table=table, causal=sq > 1)
    # a paged cache read by many programs (40 x 2 > 132 / 2) takes the narrower key tile
    pool = (40 * cap // 64, 64)
    table = torch.arange(pool[0], dtype=torch.int32).view(40, -1)
    yield "decode paged many programs", partial(
        flash_attn_with_kvcache, _t(40, 1, hk * 4, d), _t(*pool, hk, d), _t(*pool, hk, d),
        cache_seqlens=torch.full((40,), 700, dtype=torch.int32), block_table=table)
    yield "decode key_padding_mask leftpad batch_idx", partial(
        flash_attn_with_kvcache, _t(2, 1, hk * 4, d), _t(3, cap, hk, d), _t(3, cap, hk, d),
        cache_seqlens=torch.tensor([5, 700], dtype=torch.int32), cache_leftpad=torch.tensor([1, 0],
                                                                                            dtype=torch.int32),
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32), key_padding_mask=torch.rand(2, cap) > 0.5)
    # an FP8 cache (e4m3, the FP8_CACHE variant): per-head descales, append with rotary, split; paged and
    # contiguous, and per tensor with softcap
    fp8 = torch.float8_e4m3fn
    descale = torch.rand(2, hk) + 0.5
    for page in (None, 64):
        pool = (2, cap) if page is None else (2 * cap // page, page)
        table = None if page is None else torch.arange(pool[0], dtype=torch.int32).view(2, -1)
        cos, sin = torch.rand(cap, d // 2), torch.rand(cap, d // 2)
        yield f"decode fp8 cache page={page}", partial(
            flash_attn_with_kvcache, _t(2, 1, hk * 4, d), _t(*pool, hk, d).to(fp8), _t(*pool, hk, d).to(fp8),
            _t(2, 1, hk, d), _t(2, 1, hk, d), rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=torch.tensor([5, 700], dtype=torch.int32), block_table=table, k_descale=descale,
            v_descale=descale)
    yield "decode fp8 cache per tensor softcap sq=4", partial(
        flash_attn_with_kvcache, _t(2, 4, hk * 8, d), _t(2, cap, hk, d).to(fp8), _t(2, cap, hk, d).to(fp8),
        cache_seqlens=torch.tensor([5, 700], dtype=torch.int32), softcap=5.0, causal=True,
        k_descale=torch.rand(1), v_descale=torch.rand(1))
    yield "decode d=256 window softcap alibi", partial(
        flash_attn_with_kvcache, _t(1, 1, 8, 256), _t(1, 512, 8, 256), _t(1, 512, 8, 256),
        cache_seqlens=torch.tensor([300], dtype=torch.int32), window_size=(64, 0), softcap=5.0,
        alibi_slopes=torch.rand(8))


def _gluon_sparse_forward(q, k, v, mask, softcap=0.0):
    """The block-sparse forward on the Gluon kernel's variant (block_sparse.gluon_route), which must take
    the call."""
    kt = mask.to_kernel_tensors(q.device)
    route = block_sparse.gluon_route(q, k, v, kt, softcap)
    if route is None:
        raise RuntimeError("the Gluon forward's block-sparse variant does not take this call")
    _on_gluon(block_sparse.block_sparse_forward, q, k, v, kt, softmax_scale=q.shape[-1] ** -0.5,
              softcap=softcap, route=route, launchers=("forward",))


def _gluon_sparse_backward(q, k, v, mask, softcap=0.0):
    """The block-sparse forward and backward on the Gluon kernels' variants (block_sparse.gluon_route), which
    must take the call."""
    kt = mask.to_kernel_tensors(q.device)
    route = block_sparse.gluon_route(q, k, v, kt, softcap)
    if route is None or route.gluon_bwd is None:
        raise RuntimeError("the Gluon backward's block-sparse variant does not take this call")
    options = dict(softmax_scale=q.shape[-1] ** -0.5, softcap=softcap, route=route)

    def run():
        out, lse = block_sparse.block_sparse_forward(q, k, v, kt, **options)
        block_sparse.block_sparse_backward(torch.ones_like(out), q, k, v, out, lse, kt, **options)

    _on_gluon(run)


def sparse_cases():
    from flashattn import BlockMask, block_sparse_attn_func

    masks = {
        "local_global": BlockMask.local_global(1024, 256, 128),
        "mask_mod": BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 3 == 0, 1, 1, 1024, 1024),
    }
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            for name, mask in masks.items():
                q = _t(1, 1024, 4, d, dtype=dtype, grad=True)
                k, v = (_t(1, 1024, 2, d, dtype=dtype, grad=True) for _ in range(2))
                yield f"sparse {dtype} d={d} {name}", partial(_fwd_bwd, block_sparse_attn_func, q, k, v, mask)
                yield f"sparse gluon fwd {dtype} d={d} {name}", partial(_gluon_sparse_forward, q.detach(),
                                                                        k.detach(), v.detach(), mask)
                if d <= 128:
                    yield f"sparse gluon bwd {dtype} d={d} {name}", partial(
                        _gluon_sparse_backward, q.detach(), k.detach(), v.detach(), mask)
        q, k, v = (_t(1, 1024, h, 128, dtype=dtype) for h in (4, 2, 2))
        yield f"sparse gluon fwd {dtype} d=128 softcap", partial(_gluon_sparse_forward, q, k, v,
                                                                 masks["mask_mod"], 30.0)
        yield f"sparse gluon bwd {dtype} d=128 softcap", partial(_gluon_sparse_backward, q, k, v,
                                                                 masks["mask_mod"], 30.0)
        # GQA with a mask per query head: a program per head (the group split at the whole group)
        per_head = BlockMask.from_mask_mod(lambda b, h, i, j: (i + h * j) % 3 != 0, None, 4, 1024, 1024)
        yield f"sparse gluon bwd {dtype} d=128 mask per head", partial(_gluon_sparse_backward, q, k, v,
                                                                       per_head)
        wide = BlockMask.from_mask_mod(lambda b, h, i, j: (i + j) % 3 != 0, None, 4, 1024, 1024,
                                       block_size=(128, 256))
        yield f"sparse gluon fwd {dtype} d=128 256-key blocks", partial(_gluon_sparse_forward, q, k, v, wide)


def main() -> int:
    print("triton", triton.__version__, "target sm_90 (fake driver: compile only)")
    failed = ran = 0
    args = sys.argv[1:]
    part = args[args.index("--part") + 1] if "--part" in args else "0/1"
    index, parts = (int(x) for x in part.split("/"))
    only = [a for a in args if not a.startswith("--") and a != part]
    seen = 0
    for group in (dense_cases, decode_cases, sparse_cases):
        if only and group.__name__.removesuffix("_cases") not in only:
            continue
        for name, case in group():
            seen += 1
            if (seen - 1) % parts != index:
                continue
            ran += 1
            t0 = time.perf_counter()
            try:
                case()
            except Exception as e:  # report every failing variant, not just the first
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                continue
            print(f"ok   {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{ran} cases")
    print(f"{failed} failed")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main())
