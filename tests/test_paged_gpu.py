"""Paged varlen prefill read in the kernel (the Gluon forward's loader mapping each key tile through the
block table, routes.reads_pages) on a Hopper GPU (``pytest -m gpu``): bit for bit the packed call's
output and LSE (the same tiles see the same keys in the same order), asserting the route read the pools;
page sizes its tiles do not divide take the gather, and bad table entries are clamped into the pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashattn import config as flashattn_config
from flashattn import flash_attn_varlen_func
from flashattn.backends.triton import attention, gluon, routes

pytestmark = pytest.mark.gpu


@pytest.fixture
def pools_read(monkeypatch):
    """The block tables the Gluon forward's launcher received (None: a packed call)."""
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    seen = []
    real = gluon.forward

    def record(*args, **kwargs):
        seen.append(kwargs.get("block_table"))
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon, "forward", record)
    return seen


def _paged(lq, lk, h, hk, d, dv, page, spare=1, seed=0):
    """q and packed k / v, and the same keys scattered into shuffled page pools (the slots no key takes hold
    1e4, which would show if attended) with the table."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), h, d, generator=gen).cuda().bfloat16()
    k = torch.randn(sum(lk), hk, d, generator=gen).cuda().bfloat16()
    v = torch.randn(sum(lk), hk, dv, generator=gen).cuda().bfloat16()
    max_pages = -(-max(lk) // page) + spare
    num_pages = len(lk) * max_pages + 3
    table = torch.randperm(num_pages, generator=gen)[: len(lk) * max_pages].view(len(lk), max_pages)
    pools = []
    for x in (k, v):
        pool = torch.full((num_pages, page, *x.shape[1:]), 1e4, dtype=x.dtype, device="cuda")
        start = 0
        for i, n in enumerate(lk):
            for p in range(-(-n // page)):
                rows = x[start + p * page: start + min(n, (p + 1) * page)]
                pool[table[i, p], : rows.shape[0]] = rows
            start += n
        pools.append(pool)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for n in (lq, lk)]
    return q, k, v, *pools, table.to(torch.int32).cuda(), *cu


CASES = [  # (lq, lk, h, hk, d, dv, page, options)
    ([300, 0, 1, 700], [300, 5, 1, 900], 4, 2, 128, 128, 128, dict(causal=True)),
    ([17, 1023, 113], [1500, 1023, 113], 8, 1, 64, 64, 256, dict(window_size=(100, 0))),
    ([256, 77], [1024, 600], 4, 4, 64, 64, 512, dict(softcap=20.0, learnable_sink=True)),
    ([513, 40], [513, 2048], 8, 2, 128, 128, 256, dict(alibi_slopes=True, causal=True)),
    ([200, 390], [700, 390], 4, 2, 192, 128, 128, dict(causal=True)),
    ([129, 300], [640, 300], 2, 1, 256, 256, 128, dict(window_size=(64, 64))),
    ([64, 1], [0, 129], 4, 2, 96, 96, 128, {}),
    # short sequences of a GQA group (the packed tiles' case: test_paged_packed_gqa)
    ([17, 40, 5], [600, 300, 1000], 8, 2, 128, 128, 128, dict(causal=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[4]}-dv{c[5]}-page{c[6]}-{sorted(c[7])}")
def test_paged_in_kernel_equals_packed(pools_read, case):
    lq, lk, h, hk, d, dv, page, opts = case
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = _paged(lq, lk, h, hk, d, dv, page)
    if opts.pop("learnable_sink", False):
        opts["learnable_sink"] = torch.randn(h, device="cuda")
    if opts.pop("alibi_slopes", False):
        opts["alibi_slopes"] = torch.rand(len(lq), h, device="cuda")
    spec = dataclasses.replace(attention.spec_of(q, k_pool[0], v_pool[0], cu_seqlens_q=cu_q,
                                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk)), page_size=page)
    assert routes.reads_pages(spec, routes.forward_route(spec))
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lq), max(lk), block_table=table,
                                     **opts)
        ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **opts)
    assert pools_read[0] is table, "the paged call did not read its pools in the kernel"
    assert pools_read[1] is None
    assert torch.equal(out, ref)


def test_paged_kept_launch_with_another_table(pools_read, monkeypatch):
    # the same shapes with other pages, keys and lengths: the second paged call (and its packed reference)
    # runs the first's kept launch (attention.py's signature cache) on its own table and cu_seqlens
    monkeypatch.setattr(attention, "_forward_cache", {})
    prepared = []
    real = gluon._prepare_forward
    monkeypatch.setattr(gluon, "_prepare_forward", lambda *a, **kw: prepared.append(a) or real(*a, **kw))
    for seed, (lq, lk) in enumerate((([300, 1, 200], [900, 5, 640]), ([1, 200, 300], [640, 900, 5]))):
        q, k, v, k_pool, v_pool, table, cu_q, cu_k = _paged(lq, lk, 4, 2, 128, 128, 128, seed=seed)
        with torch.no_grad():
            out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 300, 900, block_table=table,
                                         causal=True)
            ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 900, causal=True)
        assert pools_read[-2] is table and pools_read[-1] is None
        assert torch.equal(out, ref)
    assert len(prepared) == 2  # the first round's two launches, kept


def test_paged_lse_equals_packed(pools_read):
    """The op's LSE too (flash_attn_varlen_func returns it only on the gathering path)."""
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = _paged([300, 17], [1000, 17], 4, 2, 128, 128, 128)
    kw = dict(softmax_scale=0.1, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300,
              max_seqlen_k=1000)
    out, lse = attention.attention_forward(q, k_pool, v_pool, block_table=table, **kw)
    ref_out, ref_lse = attention.attention_forward(q, k, v, **kw)
    assert pools_read == [table, None]
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("page", [64, 16, 200])
def test_paged_pages_smaller_than_tiles_gather(pools_read, page):
    """Pages that split a 128-key tile take the gather: still equal to the packed call."""
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = _paged([100, 30], [700, 30], 4, 2, 128, 128, page)
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 100, 700, block_table=table, causal=True)
        ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 700, causal=True)
    assert pools_read == [None, None]
    assert torch.equal(out, ref)


def test_paged_bad_entries_clamped(pools_read):
    """Entries out of the pool (negative, past its end) read its first / last page, as the gather clamps
    them: the same output either way, and no access outside the pool (compute-sanitizer: ws_paged)."""
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = _paged([200, 50], [600, 300], 4, 2, 128, 128, 128)
    bad = table.clone()
    bad[0, 1], bad[1, 0] = -7, 10**6
    clamped = bad.clamp(0, k_pool.shape[0] - 1)
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 200, 600, block_table=bad)
        ref = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 200, 600, block_table=clamped)
    assert pools_read == [bad, clamped] and torch.equal(out, ref)


def test_paged_packed_gqa(pools_read, monkeypatch):
    """The Gluon forward's packed GQA tiles (its default route here: routes.gqa_pack) over pages: bit for bit
    the packed layout's call on the same route."""
    monkeypatch.setattr(attention, "_forward_cache", {})
    q, k, v, k_pool, v_pool, table, cu_q, cu_k = _paged([17, 40, 5], [600, 300, 1000], 8, 2, 128, 128, 128)
    spec = dataclasses.replace(attention.spec_of(q, k_pool[0], v_pool[0], cu_seqlens_q=cu_q, max_seqlen_q=40,
                                                 max_seqlen_k=1000, causal=True), page_size=128)
    route = routes.forward_route(spec)
    assert route.pack == 4 and routes.reads_pages(spec, route)
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 40, 1000, block_table=table, causal=True)
        ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 1000, causal=True)
    assert pools_read == [table, None]
    assert torch.equal(out, ref)
