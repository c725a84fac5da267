"""DecodePlan and the one-launch decode on the GPU: plan.run bitwise equal to flash_attn_with_kvcache, capture
and replay in CUDA graphs with cache lengths that change between replays, one plan across the layers of a
graph, torch.compile, out-of-range indices equal to their clamped values, a plan's counters left at zero.

    PYTHONPATH=src pytest -m gpu tests/test_decode_plan_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from flashattn import DecodePlan, flash_attn_with_kvcache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, HK, D = 32, 8, 128
BF = dict(device="cuda", dtype=torch.bfloat16)


def _caches(b, cap, page, gen):
    """(k_cache, v_cache, block_table): contiguous (b, cap, HK, D), or shuffled pools of `page`-key pages."""
    if page is None:
        k, v = (torch.randn(b, cap, HK, D, generator=gen, **BF) for _ in range(2))
        return k, v, None
    n = b * cap // page
    table = torch.randperm(n, device="cuda", generator=gen).view(b, -1).to(torch.int32)
    k, v = (torch.randn(n, page, HK, D, generator=gen, **BF) for _ in range(2))
    return k, v, table


def _rotary(cap):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(cap, device="cuda", dtype=torch.float32), inv)
    return freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)


@pytest.mark.parametrize("b, cap", [(1, 16384), (16, 16384), (3, 4096)])
@pytest.mark.parametrize("page", [None, 64, 256], ids=["contiguous", "page64", "page256"])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append-rotary"])
def test_run_bitwise_equals_flash_attn_with_kvcache(b, cap, page, append):
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, table = _caches(b, cap, page, gen)
    seqlens = torch.randint(1, cap - 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
    q = torch.randn(b, 1, H, D, generator=gen, **BF)
    new = {}
    if append:
        cos, sin = _rotary(cap)
        kn, vn = (torch.randn(b, 1, HK, D, generator=gen, **BF) for _ in range(2))
        new = dict(k=kn, v=vn, rotary_cos=cos, rotary_sin=sin)
    plan = DecodePlan(b, H, HK, D, page_size=page, max_seqlen_k=cap, causal=True)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = plan.run(q, kc, vc, seqlens, table, return_softmax_lse=True, **new)
    ref, ref_lse = flash_attn_with_kvcache(q, kc2, vc2, cache_seqlens=seqlens, block_table=table, causal=True,
                                           return_softmax_lse=True, **new)
    assert plan.num_splits == plan.route.num_splits
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # a plan for shorter sequences picks its own split count; the same count through num_splits agrees
    short = plan.replan(max_seqlen_k=cap // 8)
    out_s = short.run(q, kc, vc, seqlens // 8, table)
    ref_s = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens // 8, block_table=table, causal=True,
                                    num_splits=short.num_splits)
    assert torch.equal(out_s, ref_s)


@pytest.mark.parametrize("page", [None, 64], ids=["contiguous", "page64"])
def test_capture_replay_with_changing_lengths(page):
    """plan.run captured once with append + rotary; each replay appends a token at lengths set in place, as a
    serving loop does, and matches the eager call on a copy of the caches."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, cap = 4, 8192
    kc, vc, table = _caches(b, cap, page, gen)
    cos, sin = _rotary(cap)
    plan = DecodePlan(b, H, HK, D, page_size=page, max_seqlen_k=cap, causal=True)
    seqlens = torch.tensor([1, 100, 4000, cap - 9], device="cuda", dtype=torch.int32)
    q, kn, vn = (torch.empty(b, 1, n, D, **BF) for n in (H, HK, HK))

    def step():
        return plan.run(q, kc, vc, seqlens, table, k=kn, v=vn, rotary_cos=cos, rotary_sin=sin,
                        return_softmax_lse=True)

    for x in (q, kn, vn):
        x.normal_(generator=gen)
    step()  # compile outside the capture
    kc_ref, vc_ref = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    # the capture ran nothing: the caches are as before; replay steps from here on
    kc.copy_(kc_ref)
    vc.copy_(vc_ref)
    for i in range(6):
        for x in (q, kn, vn):
            x.normal_(generator=gen)
        if i == 3:
            seqlens.copy_(torch.tensor([7, 0, 2048, 33], dtype=torch.int32))  # another composition of lengths
        expect, expect_lse = flash_attn_with_kvcache(q, kc_ref, vc_ref, kn, vn, cos, sin, seqlens,
                                                     block_table=table, causal=True, return_softmax_lse=True,
                                                     num_splits=plan.num_splits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect) and torch.equal(lse, expect_lse), f"replay {i}"
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"replay {i}: the appended caches"
        seqlens += 1


def test_one_plan_serves_every_layer_of_a_graph():
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, cap, layers = 2, 4096, 4
    caches = [_caches(b, cap, 64, gen) for _ in range(layers)]
    plan = DecodePlan(b, H, HK, D, page_size=64, max_seqlen_k=cap)
    seqlens = torch.tensor([1000, 4095], device="cuda", dtype=torch.int32)
    q = torch.randn(b, 1, H, D, generator=gen, **BF)

    def forward():
        x = q
        for kc, vc, table in caches:
            x = plan.run(x, kc, vc, seqlens, table)
        return x

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for lengths in ([1000, 4095], [1, 17]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, forward())


def test_torch_compile_fullgraph():
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, cap = 2, 2048
    kc, vc, table = _caches(b, cap, 64, gen)
    plan = DecodePlan(b, H, HK, D, page_size=64, max_seqlen_k=cap, causal=True)
    q, kn, vn = (torch.randn(b, 1, n, D, generator=gen, **BF) for n in (H, HK, HK))
    seqlens = torch.tensor([10, 2000], device="cuda", dtype=torch.int32)

    def step(q, kc, vc, kn, vn):
        return plan.run(q, kc, vc, seqlens, table, k=kn, v=vn) * 2

    kc2, vc2 = kc.clone(), vc.clone()
    eager = step(q, kc, vc, kn, vn)
    compiled = torch.compile(step, fullgraph=True)(q, kc2, vc2, kn, vn)
    assert torch.equal(compiled, eager)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the in-place append happened under compile too


@pytest.mark.parametrize("page", [None, 64], ids=["contiguous", "page64"])
def test_out_of_range_indices_equal_their_clamped_values(page):
    """Unchecked (the default), bad cache_seqlens / leftpad / batch_idx / block_table values are clamped
    in the kernel: the call equals the call with the clamped values, and reads and writes nothing outside
    the tensors (scripts/sanitize_cases.py runs this under compute-sanitizer)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    b, cap = 3, 2048
    if page is None:
        kc, vc, _ = _caches(b + 1, cap, None, gen)
    else:
        # pages 0 .. n-1 hold the sequences, n and n + 1 nobody's
        n = b * cap // page
        kc, vc = (torch.randn(n + 2, page, HK, D, generator=gen, **BF) for _ in range(2))
        table = torch.randperm(n, device="cuda", generator=gen).view(b, -1).to(torch.int32)
    q, kn, vn = (torch.randn(b, 2, n, D, generator=gen, **BF) for n in (H, HK, HK))
    cos, sin = _rotary(cap)
    bad = dict(cache_seqlens=torch.tensor([10**6, -5, 100], device="cuda", dtype=torch.int32),
               cache_leftpad=torch.tensor([-3, 7, 10**5], device="cuda", dtype=torch.int32))
    good = dict(cache_seqlens=torch.tensor([cap - 2, 0, 100], device="cuda", dtype=torch.int32),
                cache_leftpad=torch.tensor([0, 0, 100], device="cuda", dtype=torch.int32))
    if page is None:
        bad["cache_batch_idx"] = torch.tensor([10, -1, 2], device="cuda", dtype=torch.int32)
        good["cache_batch_idx"] = torch.tensor([3, 0, 2], device="cuda", dtype=torch.int32)
    else:
        # the last sequence's table points below the pool (a page it reads: another sequence's too) and past
        # it, where it appends (position 100 is in its second page): clamped to page 0 and to page n + 1
        bad_table = table.clone()
        bad_table[2, 0], bad_table[2, 1] = -10**7, 10**7
        good_table = table.clone()
        good_table[2, 0], good_table[2, 1] = 0, n + 1
        bad["block_table"], good["block_table"] = bad_table, good_table
    results = []
    for args in (bad, good):
        k2, v2 = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(q, k2, v2, kn, vn, cos, sin, causal=True, num_splits=4,
                                           return_softmax_lse=True, **args)
        torch.cuda.synchronize()
        results.append((out, lse, k2, v2))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_a_plans_counters_are_left_at_zero():
    # the workspace serves launch after launch because each leaves its counters at 0: splits of every
    # count, with and without appends, eager and replayed
    gen = torch.Generator(device="cuda").manual_seed(5)
    kc, vc, table = _caches(2, 8192, 64, gen)
    q, kn, vn = (torch.randn(2, 1, n, D, generator=gen, **BF) for n in (H, HK, HK))
    seqlens = torch.tensor([5000, 8000], device="cuda", dtype=torch.int32)
    for splits in (2, 7, 16, 0):
        plan = DecodePlan(2, H, HK, D, page_size=64, max_seqlen_k=8192, num_splits=splits)
        for i in range(20):
            out = plan.run(q, kc, vc, seqlens, table, **(dict(k=kn, v=vn) if i % 2 else {}))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = plan.run(q, kc, vc, seqlens, table)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        assert plan.route.num_splits > 1 and int(torch.count_nonzero(plan._workspace.counters)) == 0
        assert torch.equal(out, flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                        num_splits=plan.num_splits))
