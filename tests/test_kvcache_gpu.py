"""flash_attn_with_kvcache and merge_attention_states on the GPU at real sizes (bf16, 32 query / 8 kv heads,
d = 128, kv_len up to 128K, paged 64/256). Run on the device: `PYTHONPATH=src pytest -m gpu
tests/test_decode_gpu.py`. The oracle is fp64 on a subset of the sequences (all heads, all their keys)."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close_to_ref, use_tiles

from flashattn import flash_attn_func
from flashattn.kvcache import flash_attn_with_kvcache
from flashattn.merge import merge_attention_states
from flashattn.reference import attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, HK, D = 32, 8, 128
DT = torch.bfloat16


def _paged(k, v, page, gen):
    """Shuffled page pools holding k, v (b, cap, hk, d) and the block table."""
    b, cap = k.shape[:2]
    n = cap // page
    perm = torch.randperm(b * n, device=k.device, generator=gen)
    pool_k = torch.empty(b * n, page, HK, D, dtype=k.dtype, device=k.device)
    pool_v = torch.empty_like(pool_k)
    pool_k[perm] = k.reshape(b * n, page, HK, D)
    pool_v[perm] = v.reshape(b * n, page, HK, D)
    return pool_k, pool_v, perm.view(b, n).to(torch.int32)


def _check_rows(out, lse, q, k, v, seqlens, rows, causal=False):
    """Tolerance rule against the fp64 oracle on the sequences `rows` (keys [0, seqlens[i]))."""
    for i in rows:
        n = int(seqlens[i])
        args = (q[i : i + 1], k[i : i + 1, :n], v[i : i + 1, :n])
        ref = attention_ref(*args, causal=causal)
        pt = attention_ref(*args, causal=causal, upcast=False)
        assert_close_to_ref(out[i : i + 1], ref[0], pt[0], name=f"out[{i}]")
        assert_close_to_ref(lse[i : i + 1], ref[1], pt[1], name=f"lse[{i}]")


@pytest.mark.parametrize("b, kv_len", [(1, 4096), (1, 131072), (16, 16384), (16, 131072)])
@pytest.mark.parametrize("page", [None, 64, 256], ids=["contiguous", "page64", "page256"])
def test_decode_bf16_vs_oracle(b, kv_len, page):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen)
    k = torch.randn(b, kv_len, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(b, kv_len, HK, D, device="cuda", dtype=DT, generator=gen)
    # ragged lengths: the last one fills the cache, the others end mid-tile / mid-page
    seqlens = torch.randint(kv_len // 2, kv_len, (b,), device="cuda", generator=gen, dtype=torch.int32)
    seqlens[-1] = kv_len
    if page is None:
        out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, return_softmax_lse=True)
    else:
        pk, pv, bt = _paged(k, v, page, gen)
        out, lse = flash_attn_with_kvcache(q, pk, pv, cache_seqlens=seqlens, block_table=bt,
                                           return_softmax_lse=True)
    _check_rows(out, lse, q, k, v, seqlens, sorted({0, b - 1}))


@pytest.mark.parametrize("page", [64, 256])
def test_paged_equals_contiguous(page, monkeypatch):
    # at batch 16 a paged cache takes 64-key tiles by default (decode_routes.decode_tiles_for); the contiguous
    # cache's tile here, so that both run the same arithmetic (the default paged tile is checked against the
    # oracle)
    use_tiles(monkeypatch, "decode_paged=64,128,4,5")
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, kv_len = 16, 32768
    q = torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen)
    k = torch.randn(b, kv_len, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(b, kv_len, HK, D, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.randint(1, kv_len, (b,), device="cuda", generator=gen, dtype=torch.int32)
    out_c = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
    pk, pv, bt = _paged(k, v, page, gen)
    out_p = flash_attn_with_kvcache(q, pk, pv, cache_seqlens=seqlens, block_table=bt)
    # same tiles, same splits, same arithmetic: at most a rounding apart
    diff = (out_p.float() - out_c.float()).abs().max().item()
    assert diff <= 2 * torch.finfo(DT).eps * out_c.float().abs().max().item(), diff


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_append_rotary_paged_real_size(interleaved):
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, cap, page, s_new = 16, 8192, 256, 1
    k0 = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    v0 = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    pk, pv, bt = _paged(k0, v0, page, gen)
    seqlens = torch.randint(0, cap - s_new, (b,), device="cuda", generator=gen, dtype=torch.int32)
    seqlens[0] = page - 1  # the appended key is the last of a page
    q = torch.randn(b, s_new, H, D, device="cuda", dtype=DT, generator=gen)
    kn = torch.randn(b, s_new, HK, D, device="cuda", dtype=DT, generator=gen)
    vn = torch.randn(b, s_new, HK, D, device="cuda", dtype=DT, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(cap, device="cuda", dtype=torch.float32), inv)
    cos, sin = freqs.cos().to(DT), freqs.sin().to(DT)
    out, lse = flash_attn_with_kvcache(q, pk, pv, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, block_table=bt, causal=True,
                                       rotary_interleaved=interleaved, return_softmax_lse=True)

    def rope(x, pos):  # plain torch, fp32
        c, s = cos.float()[pos][:, :, None], sin.float()[pos][:, :, None]
        x = x.float()
        if interleaved:
            a, bb = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * c - bb * s, bb * c + a * s), -1).flatten(-2).to(DT)
        a, bb = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat((a * c - bb * s, bb * c + a * s), -1).to(DT)

    pos = seqlens.long().view(-1, 1)
    k_exp, v_exp = k0.clone(), v0.clone()
    k_exp[torch.arange(b), seqlens.long()] = rope(kn, pos)[:, 0]
    v_exp[torch.arange(b), seqlens.long()] = vn[:, 0]
    k_got = pk[bt.long()].flatten(1, 2)
    v_got = pv[bt.long()].flatten(1, 2)
    torch.testing.assert_close(k_got.float(), k_exp.float(), rtol=0, atol=1e-2)
    assert torch.equal(v_got, v_exp)
    _check_rows(out, lse, rope(q, pos), k_exp, v_exp, seqlens + s_new, [0, 7, b - 1], causal=True)


def test_speculative_verify_causal():
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, cap, sq = 4, 32768, 4
    k = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor([100, 5000, 20000, cap - sq], device="cuda", dtype=torch.int32)
    q = torch.randn(b, sq, H, D, device="cuda", dtype=DT, generator=gen)
    kn = torch.randn(b, sq, HK, D, device="cuda", dtype=DT, generator=gen)
    vn = torch.randn(b, sq, HK, D, device="cuda", dtype=DT, generator=gen)
    k_exp, v_exp = k.clone(), v.clone()
    for i in range(b):
        n = int(seqlens[i])
        k_exp[i, n : n + sq], v_exp[i, n : n + sq] = kn[i], vn[i]
    out, lse = flash_attn_with_kvcache(q, k, v, kn, vn, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True)
    _check_rows(out, lse, q, k_exp, v_exp, seqlens + sq, range(b), causal=True)


def test_split_heuristic_matches_one_split():
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(1, 1, H, D, device="cuda", dtype=DT, generator=gen)
    k = torch.randn(1, 65536, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(1, 65536, HK, D, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor([60000], device="cuda", dtype=torch.int32)
    o1, l1 = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1, return_softmax_lse=True)
    oa, la = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, return_softmax_lse=True)
    _check_rows(o1, l1, q, k, v, seqlens, [0])
    _check_rows(oa, la, q, k, v, seqlens, [0])


def test_cascade_shared_prefix_gpu():
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, n_prefix, cap, page = 16, 16384, 4096, 64
    q = torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen)
    kp = torch.randn(1, n_prefix, HK, D, device="cuda", dtype=DT, generator=gen)
    vp = torch.randn(1, n_prefix, HK, D, device="cuda", dtype=DT, generator=gen)
    ks = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    vs = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    pk, pv, bt = _paged(ks, vs, page, gen)
    seqlens = torch.randint(1, cap, (b,), device="cuda", generator=gen, dtype=torch.int32)
    kp_b, vp_b = kp.expand(b, -1, -1, -1), vp.expand(b, -1, -1, -1)
    o_p, l_p, _ = flash_attn_func(q, kp_b, vp_b, return_attn_probs=True)
    o_s, l_s = flash_attn_with_kvcache(q, pk, pv, cache_seqlens=seqlens, block_table=bt,
                                       return_softmax_lse=True)
    out, lse = merge_attention_states(o_p, l_p, o_s, l_s)
    for i in (0, b - 1):
        n = int(seqlens[i])
        kf = torch.cat((kp[0], ks[i, :n]))[None]
        vf = torch.cat((vp[0], vs[i, :n]))[None]
        ref = attention_ref(q[i : i + 1], kf, vf)
        pt = attention_ref(q[i : i + 1], kf, vf, upcast=False)
        assert_close_to_ref(out[i : i + 1], ref[0], pt[0], name=f"out[{i}]")
        assert_close_to_ref(lse[i : i + 1], ref[1], pt[1], name=f"lse[{i}]")


@pytest.mark.parametrize("b, cap, page", [(8, 4096, 64), (1, 4096, None), (1, 16384, None), (16, 16384, None),
                                           (1, 16384, 256)])
def test_cuda_graph_capture(b, cap, page):
    """A decode step captured in a CUDA graph replays like the eager call, with the shapes the decode suite
    times (split-KV at batch 1, the splits merged in the kernel). The default call reads no index on the host,
    so nothing needs turning off for the capture."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    k = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    kc, vc, bt = _paged(k, v, page, gen) if page else (k, v, None)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.full((b,), cap // 4, device="cuda", dtype=torch.int32)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=bt)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=bt)
    seqlens.fill_(cap)  # the captured step reads the lengths at replay time
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    expect = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=bt)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


def test_eager_calls_on_two_streams_keep_a_workspace_each():
    """Eager calls take their stream's split workspace (backends/triton/decode.py, stream_workspace): calls
    on two streams at once, each with launches of several splits in flight, give the single-stream results
    bit for bit, and each stream holds a workspace of its own whose counters the kernel left at 0."""
    from flashattn.backends.triton import decode

    gen = torch.Generator(device="cuda").manual_seed(7)
    b, cap = 1, 16384
    k = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    qs = [torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen) for _ in range(8)]
    expect = [flash_attn_with_kvcache(q, k, v) for q in qs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [None] * len(qs)
    torch.cuda.synchronize()
    for i, q in enumerate(qs):
        with torch.cuda.stream(streams[i % 2]):
            outs[i] = flash_attn_with_kvcache(q, k, v)
    torch.cuda.synchronize()
    for out, ref in zip(outs, expect, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    keys = {(torch.cuda.current_device(), s.cuda_stream) for s in streams}
    assert keys <= set(decode._stream_workspaces)
    for key in keys:
        assert torch.count_nonzero(decode._stream_workspaces[key].counters) == 0


def test_torch_compile_fullgraph():
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, cap = 2, 1024
    kc = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    vc = torch.randn(b, cap, HK, D, device="cuda", dtype=DT, generator=gen)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=DT, generator=gen)
    kn, vn = (torch.randn(b, 1, HK, D, device="cuda", dtype=DT, generator=gen) for _ in range(2))
    seqlens = torch.tensor([10, 500], device="cuda", dtype=torch.int32)

    def step(q, kc, vc, kn, vn, seqlens):
        out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, return_softmax_lse=True)
        return out * 2, lse

    kc2, vc2 = kc.clone(), vc.clone()
    eager = step(q, kc, vc, kn, vn, seqlens)
    compiled = torch.compile(step, fullgraph=True)(q, kc2, vc2, kn, vn, seqlens)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the in-place append happened under compile too
    assert math.isfinite(compiled[1].max().item())


def test_paged_varlen_prefill_equals_packed():
    """flash_attn_varlen_func with a block_table (pages of 64, shuffled) gives the packed call's result."""
    from flashattn import flash_attn_varlen_func

    gen = torch.Generator(device="cuda").manual_seed(8)
    lens, page = [700, 1, 2048, 333], 64
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), n, D, device="cuda", dtype=DT, generator=gen) for n in (H, HK, HK))
    max_pages = -(-max(lens) // page)
    table = torch.randperm(len(lens) * max_pages, device="cuda", generator=gen).view(len(lens), -1)
    k_pool = torch.zeros(len(lens) * max_pages, page, HK, D, device="cuda", dtype=DT)
    v_pool = torch.zeros_like(k_pool)
    for i, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        k_pool[table[i, pos // page], pos % page] = k[int(cu[i]) : int(cu[i + 1])]
        v_pool[table[i, pos // page], pos % page] = v[int(cu[i]) : int(cu[i + 1])]
    out = flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, max(lens), max(lens), causal=True,
                                 block_table=table.to(torch.int32))
    expect = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert torch.equal(out, expect)
