"""The launchers' per-signature cache (backends/triton/attention.py, gluon.py) and check_qkv's: a call that
hits gives the launch the uncached path gives, anything the derivations read makes a miss, an explicit route
bypasses it, and the caches stay bounded and hold no tensor.

On the CPU, with an H200 faked (the device facts routing reads, the SM count, the CUDA stream) and every
kernel replaced by a recorder whose compiled kernel's launcher records instead of launching: the whole path
down to `compiled.run` runs, the cached and the uncached one.
"""

from __future__ import annotations

import dataclasses
import itertools

import fake_h200
import pytest
import torch
from utils import use_tiles

import flashattn.kernels.gluon.attn_bwd as bwd_ws_kernels
import flashattn.kernels.gluon.attn_fwd as fwd_ws_kernels
from flashattn import _validate, flash_attn_func
from flashattn.backends.triton import attention, gluon, routes
from flashattn.backends.triton import launch as launch_mod


@pytest.fixture
def h200(monkeypatch):
    """The launch log: ("jit", kernel, (grid, args, kwargs)) or ("run", kernel, compiled.run's args)."""
    return fake_h200.install(monkeypatch)


def _qkv(d=128, dtype=torch.bfloat16, s=256, h=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, s, h, d, generator=g).to(dtype) for _ in range(3)]


def _fwd(q, k, v, **kw):
    return attention.attention_forward(q, k, v, softmax_scale=kw.pop("softmax_scale", 0.125),
                                       causal=kw.pop("causal", True), **kw)


def _bwd(q, k, v, out, lse, dout, **kw):
    return attention.attention_backward(dout, q, k, v, out, lse, softmax_scale=0.125,
                                        causal=kw.pop("causal", True), **kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_hit_launches_as_the_uncached_path(h200, monkeypatch, d, causal):
    q, k, v = _qkv(d)
    dout = torch.randn_like(q)
    names = {t.data_ptr(): n for n, t in dict(q=q, k=k, v=v, dout=dout).items()}
    runs = []
    for cached in (True, True, False):  # a miss, a hit, then the uncached path through launch's plans
        monkeypatch.setattr(attention, "_cacheable", attention._cacheable if cached else lambda *a: False)
        h200.clear()
        out, lse = _fwd(q, k, v, causal=causal)
        names.update({out.data_ptr(): "out", lse.data_ptr(): "lse"})
        _bwd(q, k, v, out, lse, dout, causal=causal)
        runs.append(fake_h200.launches(h200, names))
        del names[out.data_ptr()], names[lse.data_ptr()]
    miss, hit, uncached = runs
    assert [name for name, *_ in hit] == ["attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel",
                                          "attn_bwd_ws_kernel"]
    assert hit == miss == uncached
    assert [kind for kind, *_ in h200] == ["run"] * 3  # the plans that the miss's JIT calls returned


@pytest.mark.parametrize("causal, block_m, defer", [(False, 128, False), (True, 64, True)])
def test_d64_backward_steps(h200, causal, block_m, defer):
    # 128-row steps, dQ in step order, without the mask; 64-row steps and the deferred dQ with it
    q, k, v = _qkv(64)
    out, lse = _fwd(q, k, v, causal=causal)
    h200.clear()
    _bwd(q, k, v, out, lse, torch.randn_like(q), causal=causal)
    ((_, _, params),) = [c for c in fake_h200.launches(h200, {}) if c[0] == "attn_bwd_ws_kernel"]
    names = bwd_ws_kernels.attn_bwd_ws_kernel.arg_names
    assert params[names.index("BLOCK_M")] == block_m
    assert params[names.index("DEFER_DQ")] is defer
    # the stats planes come with each stage: one row of each per query row
    stats = params[names.index("stats_desc")]
    assert stats[4] == [2, 1, block_m]


def test_the_public_call_hits_forward_and_backward(h200):
    q, k, v = (t.requires_grad_() for t in _qkv())
    for _ in range(3):
        h200.clear()
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [kind for kind, *_ in h200] == ["run"] * 3
    assert len(attention._forward_cache) == len(attention._backward_cache) == 1


def _hits(call) -> bool:
    """Whether call() took the cache: a Gluon launcher ran without preparing its launch."""
    ran, prepared = [], []

    def spy(log, real):
        def wrapper(*args, **kwargs):
            log.append(real)
            return real(*args, **kwargs)

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        for name in ("forward", "backward"):
            mp.setattr(gluon, name, spy(ran, getattr(gluon, name)))
            prepare = f"_prepare_{name}"
            mp.setattr(gluon, prepare, spy(prepared, getattr(gluon, prepare)))
        call()
    return bool(ran) and not prepared


def _variants():
    """(name, a change of one thing the derivations read) as (tile overrides, qkv, call options)."""
    def strided(d=128):  # another head count's tensors, a head sliced out: other strides
        return [t[:, :, :2] for t in _qkv(d, h=3)]

    def misaligned():  # 8 bytes past an aligned address (the pointer path's Triton forward takes it)
        return [torch.cat([t.flatten()[:4], t.flatten()])[4:].view(t.shape) for t in _qkv()]

    return [
        ("strides", {}, strided, {}),
        ("alignment", {}, misaligned, {}),
        ("dtype", {}, lambda: _qkv(dtype=torch.float16), {}),
        ("length", {}, lambda: _qkv(s=320), {}),
        ("causal", {}, _qkv, dict(causal=False)),
        ("scale", {}, _qkv, dict(softmax_scale=0.25)),
        ("tile override", "fwd_ws=128,128,4,3", _qkv, {}),
        ("window", None, _qkv, dict(window_size=(64, 0))),
        ("softcap", None, _qkv, dict(softcap=5.0)),
        ("alibi", None, _qkv, dict(alibi_slopes=torch.rand(2))),
        ("batched alibi", None, _qkv, dict(alibi_slopes=torch.rand(1, 2))),
        ("sink", None, _qkv, dict(learnable_sink=torch.rand(2))),
    ]


@pytest.mark.parametrize("name, tiles, qkv, options", _variants(), ids=[v[0] for v in _variants()])
def test_any_change_the_forward_reads_misses(h200, monkeypatch, name, tiles, qkv, options):
    q, k, v = _qkv()
    _fwd(q, k, v)
    assert _hits(lambda: _fwd(q, k, v))
    if tiles:
        use_tiles(monkeypatch, tiles)
    tensors = qkv()
    assert not _hits(lambda: _fwd(*tensors, **options))
    # and the next call of the new signature, a hit where it takes the Gluon forward, launches as uncached
    h200.clear()
    _fwd(*tensors, **options)
    cached = fake_h200.launches(h200, {})
    with monkeypatch.context() as mp:
        mp.setattr(attention, "_cacheable", lambda *a: False)
        h200.clear()
        _fwd(*tensors, **options)
        uncached = fake_h200.launches(h200, {})
    assert cached == uncached


@pytest.mark.parametrize("tiles, d, deterministic", [
    ("bwd_ws=128,128,4,2", 64, False),
    (None, 128, True),
])
def test_any_change_the_backward_reads_misses(h200, monkeypatch, tiles, d, deterministic):
    q, k, v = _qkv(d)
    dout = torch.randn_like(q)
    out, lse = _fwd(q, k, v)
    _bwd(q, k, v, out, lse, dout)
    assert _hits(lambda: _bwd(q, k, v, out, lse, dout))
    if tiles:
        use_tiles(monkeypatch, tiles)
    assert not _hits(lambda: _bwd(q, k, v, out, lse, dout, deterministic=deterministic))
    h200.clear()
    _bwd(q, k, v, out, lse, dout, deterministic=deterministic)
    cached = fake_h200.launches(h200, {})
    monkeypatch.setattr(attention, "_cacheable", lambda *a: False)
    h200.clear()
    _bwd(q, k, v, out, lse, dout, deterministic=deterministic)
    assert cached == fake_h200.launches(h200, {})
    if tiles:  # 128-row steps at d = 64 under the causal mask: no deferred dQ
        ((_, _, params),) = [c for c in cached if c[0] == "attn_bwd_ws_kernel"]
        assert params[bwd_ws_kernels.attn_bwd_ws_kernel.arg_names.index("DEFER_DQ")] is False


def test_an_explicit_route_bypasses_the_cache_and_runs_as_given(h200):
    q, k, v = _qkv(64, s=8192, h=8)
    _fwd(q, k, v)
    spec = attention._problem(q, k, v, 0.125, True, (-1, -1), 0.0, None, 0.0, 0, 0, None, None, None,
                              None).spec
    route = dataclasses.replace(routes.forward_route(spec), half_diag=False, persistent=False)
    assert not _hits(lambda: _fwd(q, k, v, route=route))
    h200.clear()
    _fwd(q, k, v, route=route)
    ((name, grid, params),) = fake_h200.launches(h200, {})
    names = fwd_ws_kernels.attn_fwd_ws_kernel.arg_names
    assert name == "attn_fwd_ws_kernel" and params[names.index("HALF_DIAG")] is False
    assert grid[0] == 8 * -(-8192 // route.tiles.block_m) > 132  # one program per tile, not per SM
    triton = routes.forward_route(dataclasses.replace(spec, dropout=True))
    h200.clear()
    _fwd(q, k, v, route=triton)
    assert [c[0] for c in fake_h200.launches(h200, {})] == ["attn_fwd_kernel"]


def test_an_installed_hook_bypasses_the_cache(h200):
    from triton import knobs

    q, k, v = _qkv()
    _fwd(q, k, v)

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not _hits(lambda: _fwd(q, k, v))
        h200.clear()
        _fwd(q, k, v)
        assert [kind for kind, *_ in h200] == ["jit"]  # launch's JIT path, which calls the hooks
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert _hits(lambda: _fwd(q, k, v))


def test_the_caches_stay_bounded_and_hold_no_tensor(h200, monkeypatch):
    monkeypatch.setattr(attention, "_CACHED_SIGNATURES", 3)
    monkeypatch.setattr(_validate, "_PASSED_SIGNATURES", 3)
    for s in range(200, 208):
        q, k, v = (t.requires_grad_() for t in _qkv(s=s))
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert len(attention._forward_cache) <= 3 and len(attention._backward_cache) <= 3
        assert len(_validate._passed) <= 3
    reached = fake_h200.objects_reached(attention._forward_cache, attention._backward_cache,
                                        _validate._passed)
    assert reached > 50  # it did walk the entries


def test_a_hit_launches_the_calls_own_slopes_and_sink(h200):
    # ALiBi's slopes and a sink are per-call tensors: a hit keyed on their presence and layout launches the
    # ones it is given, forward and backward, and the backward returns the sink's gradient
    q, k, v = _qkv()
    dout = torch.randn_like(q)
    for _ in range(2):
        options = dict(alibi_slopes=torch.rand(1, 2), learnable_sink=torch.rand(2))
        names = {options["alibi_slopes"].data_ptr(): "slopes", options["learnable_sink"].data_ptr(): "sink"}
        h200.clear()
        out, lse = _fwd(q, k, v, **options)
        *_, dsink = _bwd(q, k, v, out, lse, dout, **options)
        assert dsink.shape == (2,) and dsink.dtype == torch.float32
    assert [kind for kind, *_ in h200] == ["run"] * 3  # the second round: all hits
    launched = {name: params for name, _, params in fake_h200.launches(h200, names)}
    fwd_names = fwd_ws_kernels.attn_fwd_ws_kernel.arg_names
    fwd = launched["attn_fwd_ws_kernel"]
    assert fwd[fwd_names.index("ALIBI")][0] == "slopes" and fwd[fwd_names.index("SINK")][0] == "sink"
    assert fwd[fwd_names.index("stride_alibi_b")] == 2
    bwd = launched["attn_bwd_ws_kernel"]
    bwd_names = bwd_ws_kernels.attn_bwd_ws_kernel.arg_names
    assert bwd[bwd_names.index("ALIBI")][0] == "slopes" and bwd[bwd_names.index("SINK")][0] == "sink"


def _packed(lengths, d=128, h=2, hk=2):
    """Packed q, k, v of these sequences and their cu_seqlens (int32, shared by q and k)."""
    g = torch.Generator().manual_seed(1)
    total = sum(lengths)
    q = torch.randn(total, h, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(total, hk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


def _varlen(cu, longest):
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)


@pytest.mark.parametrize("hk", [2, 1])
def test_a_varlen_hit_launches_as_the_uncached_path(h200, monkeypatch, hk):
    q, k, v, cu, longest = _packed([100, 60, 96], hk=hk)
    dout = torch.randn_like(q)
    names = {t.data_ptr(): n for n, t in dict(q=q, k=k, v=v, dout=dout, cu=cu).items()}
    runs, cacheable = [], attention._cacheable
    for cached in (True, True, False):
        monkeypatch.setattr(attention, "_cacheable", cacheable if cached else lambda *a: False)
        h200.clear()
        out, lse = _fwd(q, k, v, **_varlen(cu, longest))
        names.update({out.data_ptr(): "out", lse.data_ptr(): "lse"})
        _bwd(q, k, v, out, lse, dout, **_varlen(cu, longest))
        runs.append(fake_h200.launches(h200, names))
        del names[out.data_ptr()], names[lse.data_ptr()]
    miss, hit, uncached = runs
    offsets = "varlen_tile_offsets_kernel"
    # the backward's two lists (stats rows, key tiles) in one launch
    assert [name for name, *_ in hit] == [offsets, "attn_fwd_ws_kernel", offsets,
                                          "attn_bwd_preprocess_kernel", "attn_bwd_ws_kernel"]
    assert hit == miss == uncached
    assert len(attention._forward_cache) == len(attention._backward_cache) == 1
    # a hit's offsets through the launches kept with its Gluon launches: no argument keyed per call
    keyed = []
    monkeypatch.setattr(attention, "_cacheable", cacheable)
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: keyed.append(a[0]))
    h200.clear()
    out, lse = _fwd(q, k, v, **_varlen(cu, longest))
    _bwd(q, k, v, out, lse, dout, **_varlen(cu, longest))
    assert not keyed and [name for _, name, _ in h200] == [name for name, *_ in hit]


def test_a_varlen_hit_launches_the_calls_own_offsets(h200):
    # same batch, maxima and packed shapes, other lengths: a hit that hands the kernels this call's cu_seqlens
    q, k, v, cu, longest = _packed([100, 60, 96])
    out, lse = _fwd(q, k, v, **_varlen(cu, longest))
    _bwd(q, k, v, out, lse, torch.randn_like(q), **_varlen(cu, longest))
    other = torch.tensor([0, 60, 160, 256], dtype=torch.int32)
    assert _hits(lambda: _fwd(q, k, v, **_varlen(other, longest)))
    assert _hits(lambda: _bwd(q, k, v, out, lse, torch.randn_like(q), **_varlen(other, longest)))
    h200.clear()
    _fwd(q, k, v, **_varlen(other, longest))
    launched = fake_h200.launches(h200, {other.data_ptr(): "other", cu.data_ptr(): "cu"})
    cus = [a[0] for _, _, params in launched for a in params if isinstance(a, tuple) and a and
           a[0] in ("other", "cu")]
    assert cus and set(cus) == {"other"}


@pytest.mark.parametrize("lengths, longest", [
    ([128, 128], 128),  # another batch, the same packed shapes
    ([100, 60, 96], 112),  # another max_seqlen
])
def test_any_change_the_varlen_derivations_read_misses(h200, lengths, longest):
    q, k, v, cu, m = _packed([100, 60, 96])
    out, lse = _fwd(q, k, v, **_varlen(cu, m))
    dout = torch.randn_like(q)
    _bwd(q, k, v, out, lse, dout, **_varlen(cu, m))
    assert _hits(lambda: _fwd(q, k, v, **_varlen(cu, m)))
    other = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    assert not _hits(lambda: _fwd(q, k, v, **_varlen(other, longest)))
    assert not _hits(lambda: _bwd(q, k, v, out, lse, dout, **_varlen(other, longest)))


def _paged(page=256, pages_per_seq=4, batch=3):
    """q of 3 sequences, page pools of batch · pages_per_seq pages, a block table and cu_seqlens."""
    g = torch.Generator().manual_seed(2)
    lens_q, lens_k = [100, 17, 64], [700, 1000, 300]
    q = torch.randn(sum(lens_q), 4, 128, generator=g).to(torch.bfloat16)
    pool = (batch * pages_per_seq, page, 2, 128)
    k, v = (torch.randn(pool, generator=g).to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(batch * pages_per_seq, generator=g).to(torch.int32).view(batch, pages_per_seq)
    cu = [torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32) for ls in (lens_q, lens_k)]
    return q, k, v, table, dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(lens_q),
                                max_seqlen_k=max(lens_k))


def test_a_paged_hit_launches_as_the_uncached_path_with_its_own_table(h200, monkeypatch):
    q, k, v, table, lengths = _paged()
    names = {t.data_ptr(): n for n, t in dict(q=q, k=k, v=v, table=table).items()}
    runs, cacheable = [], attention._cacheable
    for cached in (True, True, False):
        monkeypatch.setattr(attention, "_cacheable", cacheable if cached else lambda *a: False)
        h200.clear()
        _fwd(q, k, v, block_table=table, **lengths)
        runs.append(fake_h200.launches(h200, names))
    miss, hit, uncached = runs
    assert [name for name, *_ in hit] == ["varlen_tile_offsets_kernel", "attn_fwd_ws_kernel"]
    assert hit == miss == uncached
    ((_, _, params),) = [c for c in hit if c[0] == "attn_fwd_ws_kernel"]
    assert params[fwd_ws_kernels.attn_fwd_ws_kernel.arg_names.index("PAGES")][0] == "table"
    monkeypatch.setattr(attention, "_cacheable", cacheable)
    other = table.flip(0).contiguous()  # another table of the same shape: a hit that reads its own
    assert _hits(lambda: _fwd(q, k, v, block_table=other, **lengths))
    h200.clear()
    _fwd(q, k, v, block_table=other, **lengths)
    ((_, _, params),) = [c for c in fake_h200.launches(h200, {other.data_ptr(): "other"})
                         if c[0] == "attn_fwd_ws_kernel"]
    assert params[fwd_ws_kernels.attn_fwd_ws_kernel.arg_names.index("PAGES")][0] == "other"


def test_any_change_the_paged_derivations_read_misses(h200):
    q, k, v, table, lengths = _paged()
    _fwd(q, k, v, block_table=table, **lengths)
    assert _hits(lambda: _fwd(q, k, v, block_table=table, **lengths))
    wider = torch.cat([table, table[:, :1]], 1)  # another table width: another bound on the keys
    assert not _hits(lambda: _fwd(q, k, v, block_table=wider, **lengths))
    q2, k2, v2, table2, lengths2 = _paged(page=128, pages_per_seq=8)  # another page size
    assert not _hits(lambda: _fwd(q2, k2, v2, block_table=table2, **lengths2))
