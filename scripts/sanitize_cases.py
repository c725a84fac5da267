"""Small odd-shaped cases of every kernel for compute-sanitizer (memcheck / racecheck) on the device.

    python scripts/sanitize_cases.py [dense] [decode] [decode_bad] [sparse] [ws_fwd] [ws_fwd64] [ws_bwd]
        [ws_deterministic] [ws_features] [ws_chunked] [ws_wide_bwd] [ws_keys] [ws_padded]
        [ws_paged] [ws_pack] [ws_sparse] [ws_ahead] [fp8] [softcap_wide]

(default: the first four). The backward kernels' cases (ws_bwd, ws_deterministic, ws_wide_bwd, ws_keys)
live in sanitize_bwd_cases.py beside it.

decode_bad passes out-of-range cache_seqlens, cache_leftpad, cache_batch_idx and block_table entries, with
the opt-in checks off (the kernel clamps them: memcheck must stay clean) and on (they raise before any
launch), through flash_attn_with_kvcache and a DecodePlan.

ws_fwd and ws_bwd isolate the warp-specialised Gluon kernels (the forward alone; the backward alone, after
the Triton forward's route) so that a hazard report names one of them. ws_features runs their compile-time
variants (windows, softcap, ALiBi, sinks, the forward's varlen layout) forward and backward at small odd
shapes. ws_deterministic runs the backward's fixed-order dQ variant (deterministic=True). ws_chunked runs the
forward's 192-wide heads (Q and K in three 64-wide chunks, one Q buffer or two) and one Q buffer at d = 256,
persistent programs taking several tiles, padded and varlen. ws_wide_bwd runs the wide heads' backward
(d 160..256: its column units, GQA and the group split, the options, varlen) after the Triton forward;
ws_keys the same cases on the 128-key wide-head backward (attn_bwd_keys.py, the default at width 192;
ws_deterministic covers its fixed-order variant).
ws_padded runs both Gluon kernels on head dims below their tiles' widths. ws_paged runs the Gluon forward on
page pools through a block table, entries outside the pool included. ws_pack runs the Gluon forward with
GQA groups packed into its query tiles (padded groups, a group wider than a warpgroup's rows, every option,
varlen). ws_sparse runs the Gluon forward's block-sparse variant (lists, bitmasks, empty query blocks).
ws_ahead runs the Gluon forward with the next key tile's QK^T issued before each softmax (qk_ahead), 16-bit
and FP8.

softcap_wide runs the Triton forward with a softcap over a padded 256-wide head (varlen, d 160): on its
route (one stage) and on the 2-stage tiles whose build stops on a misaligned address at full speed but not
under the sanitizer, so that racecheck can say whether a shared-memory hazard is behind it.

fp8 runs the FP8 forward (odd head dims, both V layouts, every option, varlen with empty sequences) and the
FP8 KV cache (contiguous and paged, appending across a page boundary, split).
"""

import dataclasses
import sys

import torch
from sanitize_bwd_cases import grad_check as _grad_check
from sanitize_bwd_cases import qkv as _qkv
from sanitize_bwd_cases import ws_bwd, ws_deterministic, ws_keys, ws_wide_bwd  # noqa: F401 (cases by name)

from flashattn import (
    BlockMask,
    DecodePlan,
    block_sparse_attn_func,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)


def dense():
    # d = 64 and 128 take the TMA path (tails past seqlen read through the descriptor), 40 and 256 pointers
    for b, sq, sk, h, hk, d in [(1, 113, 67, 2, 1, 40), (2, 67, 130, 4, 2, 64), (1, 200, 137, 4, 1, 128),
                                (1, 33, 33, 2, 2, 256)]:
        for causal in (False, True):
            q, k, v = _qkv((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
            _grad_check(flash_attn_func(q, k, v, causal=causal), q, k, v)
    # every feature at once, and varlen with empty sequences
    q, k, v = _qkv((2, 150, 4, 48), (2, 190, 2, 48), (2, 190, 2, 32))
    sink = torch.zeros(4, device="cuda", requires_grad=True)
    out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, window_size=(40, -1), softcap=3.0,
                          alibi_slopes=torch.rand(4, device="cuda"), learnable_sink=sink)
    _grad_check(out, q, k, v, sink)
    lens = [0, 77, 1, 130]
    cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32, device="cuda")
    q, k, v = _qkv((sum(lens), 4, 64), (sum(lens), 2, 64), (sum(lens), 2, 64))
    _grad_check(flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True), q, k, v)


def decode():
    # paged (page 16: a key tile spans pages) and contiguous; append + rotary, GQA 4, three splits
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for page in (None, 16):
        q = torch.randn(2, 3, 8, 64, **bf)
        kn, vn = torch.randn(2, 3, 2, 64, **bf), torch.randn(2, 3, 2, 64, **bf)
        if page is None:
            kc, vc, table = torch.randn(2, 300, 2, 64, **bf), torch.randn(2, 300, 2, 64, **bf), None
        else:
            kc, vc = torch.randn(40, page, 2, 64, **bf), torch.randn(40, page, 2, 64, **bf)
            table = torch.randperm(40, device="cuda", dtype=torch.int32)[:38].view(2, 19)
        cos, sin = torch.rand(304, 16, **bf), torch.rand(304, 16, **bf)
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, causal=True,
                                      cache_seqlens=torch.tensor([0, 297], device="cuda", dtype=torch.int32),
                                      block_table=table, num_splits=3)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()


def decode_bad():
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def i32(*values):
        return torch.tensor(values, device="cuda", dtype=torch.int32)

    q, kn, vn = torch.randn(3, 2, 8, 64, **bf), torch.randn(3, 2, 2, 64, **bf), torch.randn(3, 2, 2, 64, **bf)
    cos, sin = torch.rand(320, 16, **bf), torch.rand(320, 16, **bf)
    bad = dict(cache_seqlens=i32(10**6, -5, 2**31 - 1), cache_leftpad=i32(-3, 10**5, 7))
    contiguous = (torch.randn(4, 320, 2, 64, **bf), torch.randn(4, 320, 2, 64, **bf))
    pool = (torch.randn(20, 16, 2, 64, **bf), torch.randn(20, 16, 2, 64, **bf))
    table = torch.tensor([[0, 10**7, -1, 3, 4], [-10**9, 6, 7, 8, 9], [2**31 - 1, 11, -2**31, 13, 14]],
                         device="cuda", dtype=torch.int32)
    calls = [
        dict(bad, k_cache=contiguous[0], v_cache=contiguous[1], cache_batch_idx=i32(9, -9, 2**31 - 1)),
        dict(bad, k_cache=pool[0], v_cache=pool[1], block_table=table),
    ]
    for kwargs in calls:
        for check in (False, True):
            for splits in (1, 5):
                try:
                    flash_attn_with_kvcache(q, k=kn, v=vn, rotary_cos=cos, rotary_sin=sin, causal=True,
                                            num_splits=splits, check_inputs=check, **kwargs)
                except ValueError:
                    assert check, "an unchecked call raised"
                torch.cuda.synchronize()
    plan = DecodePlan(3, 8, 2, 64, page_size=16, max_seqlen_k=80, num_splits=3)
    for _ in range(3):
        plan.run(q[:, :1], pool[0], pool[1], bad["cache_seqlens"], table, k=kn[:, :1], v=vn[:, :1],
                 cache_leftpad=bad["cache_leftpad"])
    torch.cuda.synchronize()


def sparse():
    # a built-in pattern and a mask_mod bitmask, odd length, GQA
    for mask in (BlockMask.local_global(333, 70, 16, block_size=(64, 64), device="cuda"),
                 BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 5 == 0, None, None, 333, 333,
                                         block_size=(64, 64), device="cuda")):
        q, k, v = _qkv((1, 333, 4, 64), (1, 333, 2, 64), (1, 333, 2, 64))
        _grad_check(block_sparse_attn_func(q, k, v, mask), q, k, v)


def ws_sparse():
    # the Gluon kernels' block-sparse variants (128-row mask blocks; not the default route yet): odd
    # lengths (a key block past seqlen_k, rows past seqlen_q), masks per head and batch element, empty query
    # blocks, key blocks of two key tiles, d 64 / 128 / 256, GQA; the backward where it takes the call
    # (128 x 128 blocks, d up to 128)
    masks = (
        BlockMask.from_mask_mod(lambda b, h, i, j: (i >= 200) & ((i - j) % 5 == 0), 2, 4, 333, 333,
                                device="cuda"),
        BlockMask.local_global(333, 70, 16, device="cuda"),
        BlockMask.from_mask_mod(lambda b, h, i, j: (i + j) % 3 != 0, None, None, 333, 333,
                                block_size=(128, 256), device="cuda"),
    )
    from flashattn.backends.triton import block_sparse

    for d in (64, 128, 256):
        for mask in masks:
            q, k, v = (torch.randn(2, 333, h, d, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
            kt = mask.to_kernel_tensors("cuda")
            route = block_sparse.gluon_route(q, k, v, kt)
            out, lse = block_sparse.block_sparse_forward(q, k, v, kt, softmax_scale=d ** -0.5, route=route)
            torch.cuda.synchronize()
            assert route.gluon_fwd is not None and torch.isfinite(out).all()
            if route.gluon_bwd is not None:
                grads = block_sparse.block_sparse_backward(torch.randn_like(out), q, k, v, out, lse, kt,
                                                           softmax_scale=d ** -0.5, route=route)
                torch.cuda.synchronize()
                assert all(torch.isfinite(g).all() for g in grads)


def ws_fwd(head_dims=(64, 128)):
    # 140 tiles of 256 rows x 70 heads: more than the 132 programs, so some take a second from the counter
    for causal, n, h, d in ((False, 200, 2, 128), (True, 1100, 2, 128), (True, 256, 70, 128),
                            (False, 256, 70, 128), (False, 256, 70, 64), (True, 1000, 2, 64),
                            (True, 700, 70, 64)):
        if d not in head_dims:
            continue
        q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()


def ws_fwd64():
    # d = 64 alone: its three consumer warpgroups of 192-row tiles exist at d = 64 only
    ws_fwd(head_dims=(64,))


def ws_features():
    # each option at d = 64 (two and, past a 4K band, three consumer warpgroups), 128 and 256, GQA; among them
    # query tiles with no key (sq > sk under a band), key tiles no query sees (sq < sk with a left edge),
    # windows ending mid-tile, and persistent programs taking several tiles (70 heads)
    h = 4
    cases = [
        ((1, 200, 137, 128), dict(window_size=(33, 17))),
        ((1, 300, 100, 128), dict(window_size=(20, 10), learnable_sink=True)),
        ((1, 100, 700, 64), dict(window_size=(50, 0), softcap=5.0)),
        ((2, 67, 130, 64), dict(causal=True, window_size=(40, -1), alibi_slopes=(2, h))),
        ((1, 257, 257, 128), dict(window_size=(-1, 3), softcap=3.0, alibi_slopes=(h,), learnable_sink=True)),
        ((1, 4500, 130, 64), dict(window_size=(64, -1))),
        ((1, 256, 256, 128), dict(causal=True, window_size=(100, -1), nheads=70)),
        # d = 256: the forward's 64-key steps beside one Q buffer (its backward is the Triton one)
        ((1, 257, 300, 256), dict(causal=True, window_size=(64, -1), softcap=5.0, learnable_sink=True)),
    ]
    for (b, sq, sk, d), options in cases:
        options = dict(options)
        heads = options.pop("nheads", h)
        q, k, v = _qkv((b, sq, heads, d), (b, sk, 2, d), (b, sk, 2, d)) if heads == h else _qkv(
            (b, sq, heads, d), (b, sk, heads, d), (b, sk, heads, d))
        inputs = [q, k, v]
        if "alibi_slopes" in options:
            options["alibi_slopes"] = torch.rand(options["alibi_slopes"], device="cuda")
        if options.get("learnable_sink"):
            options["learnable_sink"] = torch.randn(heads, device="cuda", requires_grad=True)
            inputs.append(options["learnable_sink"])
        _grad_check(flash_attn_func(q, k, v, **options), *inputs)
    # varlen, forward and backward: empty sequences, a last tile ending mid-warpgroup, masked stores of those
    # rows beside the next sequence's TMA stores
    lens_q, lens_k = [0, 77, 1, 130, 64, 0, 191], [5, 77, 0, 200, 64, 3, 150]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    for d in (64, 128):
        q, k, v = _qkv((sum(lens_q), h, d), (sum(lens_k), 2, d), (sum(lens_k), 2, d))
        sink = torch.randn(h, device="cuda", requires_grad=True)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                     window_size=(50, -1), softcap=4.0, learnable_sink=sink)
        _grad_check(out, q, k, v, sink)


def ws_chunked():
    from flashattn import config

    h = 4
    lens_q, lens_k = [0, 77, 1, 130, 64, 191], [5, 77, 0, 200, 64, 150]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    for d, dv, tiles in ((192, 128, None), (160, 128, None), (192, 64, None), (192, 128, "fwd_ws=128,64,4,3"),
                         (256, 256, "fwd_ws=128,64,4,2")):
        with config.use_tiles(tiles):
            # 70 heads x 3 query tiles over 132 programs: programs take a second tile from the counter
            q, k, v = _qkv((1, 300, 70, d), (1, 333, 70, d), (1, 333, 70, dv))
            outs = [flash_attn_func(q, k, v, causal=True, window_size=(100, -1), softcap=5.0)]
            q, k, v = _qkv((1, 257, h, d), (1, 129, 2, d), (1, 129, 2, dv))
            outs.append(flash_attn_func(q, k, v, learnable_sink=torch.randn(h, device="cuda"),
                                        alibi_slopes=torch.rand(h, device="cuda")))
            q, k, v = _qkv((sum(lens_q), h, d), (sum(lens_k), 2, d), (sum(lens_k), 2, dv))
            outs.append(flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True))
            torch.cuda.synchronize()
            assert all(torch.isfinite(out).all() for out in outs)


def ws_padded():
    # head dims below the Gluon kernels' tile widths (their default routes): zeros read past d and dv, stores
    # clipped there, varlen's masked stores stopping at the head dims, the group split's float32 buffers
    # shaped like k and v
    from dataclasses import replace

    from flashattn.backends.triton import attention, routes

    default = routes.backward_route
    h = 4
    for d, dv in ((96, 96), (40, 40), (128, 96), (72, 64), (200, 96), (160, 104)):
        q, k, v = _qkv((1, 200, h, d), (1, 137, 2, d), (1, 137, 2, dv))
        _grad_check(flash_attn_func(q, k, v, causal=True), q, k, v)
    lens_q, lens_k = [0, 77, 1, 130, 64, 0, 191, 1], [5, 77, 0, 200, 64, 3, 150, 129]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    for d, dv in ((96, 96), (128, 96), (160, 104)):
        q, k, v = _qkv((sum(lens_q), h, d), (sum(lens_k), 2, d), (sum(lens_k), 2, dv))
        _grad_check(flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True),
                    q, k, v)
    routes.backward_route = lambda spec: replace(routes.gluon_backward_route(spec), group_split=2)
    attention._backward_cache.clear()
    for d, dv in ((96, 96), (160, 104)):
        q, k, v = _qkv((1, 150, 8, d), (1, 190, 2, d), (1, 190, 2, dv))
        _grad_check(flash_attn_func(q, k, v, causal=True), q, k, v)
    routes.backward_route = default
    attention._backward_cache.clear()


def ws_paged():
    # the Gluon forward reading page pools through the block table (paged varlen prefill, no gradient):
    # pages of 128 and 256 keys, sequences of 0, 1 and 129 keys, a spare table column, and entries outside
    # the pool (negative, past its end) on columns the sequences use, which the loader clamps into it
    h = 4
    lens_q, lens_k = [0, 77, 1, 130, 64], [5, 300, 0, 129, 1]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    with torch.no_grad():
        for d, dv, page, opts in ((128, 128, 128, dict(causal=True)),
                                  (64, 64, 256, dict(window_size=(50, 3))), (192, 128, 128, {})):
            max_pages = -(-max(lens_k) // page) + 1
            pool_k = torch.randn(len(lens_k) * max_pages, page, 2, d, device="cuda", dtype=torch.bfloat16)
            pool_v = torch.randn(len(lens_k) * max_pages, page, 2, dv, device="cuda", dtype=torch.bfloat16)
            table = torch.randperm(pool_k.shape[0], device="cuda").view(len(lens_k), max_pages).int()
            table[1, 0], table[3, 0] = -3, 10**6
            q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16)
            out = flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         block_table=table, **opts)
            assert torch.isfinite(out).all()


def fp8():
    from flashattn import fp8 as q8

    def quantized(shape, granularity="head", **kw):
        return q8.quantize(torch.randn(shape, device="cuda"), granularity, **kw)

    with torch.no_grad():
        shapes = [((1, 113, 67, 2, 1, 40), False), ((2, 67, 130, 4, 2, 64), True),
                  ((1, 200, 137, 4, 1, 128), False), ((1, 33, 300, 2, 2, 256), True)]
        for (b, sq, sk, h, hk, d), seq_v in shapes:
            (q, qd), (k, kd) = quantized((b, sq, h, d)), quantized((b, sk, hk, d))
            v, vd = quantized((b, sk, hk, d), seq_contiguous=seq_v)
            for causal in (False, True):
                out = flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                assert torch.isfinite(out).all()
        shapes = ((2, 150, 4, 48), (2, 190, 2, 48), (2, 190, 2, 48))
        (q, qd), (k, kd), (v, vd) = (quantized(s) for s in shapes)
        out = flash_attn_func(q, k, v, causal=True, window_size=(40, -1), softcap=3.0, q_descale=qd,
                              k_descale=kd, v_descale=vd, alibi_slopes=torch.rand(4, device="cuda"),
                              learnable_sink=torch.zeros(4, device="cuda"))
        lens = [0, 77, 1, 130]
        cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32, device="cuda")
        q, k, v = (quantized((1, 208, h, 64), "tensor")[0][0] for h in (4, 2, 2))
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        assert torch.isfinite(out).all()
        # the Gluon forward's FP8 variant on its explicit route: V read in place (1024 keys) and copied
        # K-major (300), two and three consumer warpgroups (d = 128 without a mask takes three), every option
        from flashattn import config
        from flashattn.backends.triton import attention as launchers
        from flashattn.backends.triton import routes

        for (b, sq, sk, h, hk, d), seq_v, tiles, opts in [
                ((1, 200, 1024, 4, 1, 128), True, None, dict(causal=True)),
                ((1, 200, 1024, 4, 1, 128), True, None, dict(causal=False)),
                ((2, 67, 300, 4, 2, 64), False, "fwd_ws=192,128,4,3",
                 dict(causal=False, window_size=(40, 3), softcap=5.0)),
                ((1, 130, 300, 2, 2, 256), False, None, dict(causal=True))]:
            (q, qd), (k, kd) = quantized((b, sq, h, d)), quantized((b, sk, hk, d))
            v, vd = quantized((b, sk, hk, d), seq_contiguous=seq_v)
            with config.use_tiles(tiles):
                route = routes.gluon_forward_route(launchers.spec_of(q, k, v, **opts))
                out, _ = launchers.attention_forward_fp8(q, k, v, qd, kd, vd, out_dtype=torch.bfloat16,
                                                         softmax_scale=d ** -0.5, route=route, **opts)
            assert torch.isfinite(out).all()
        # the FP8 cache: bf16 queries and new keys, e4m3 caches with per-(sequence, kv head) descales
        b, hk, d = 3, 2, 128
        kd, vd = (torch.rand(b, hk, device="cuda") * 0.01 + 0.001 for _ in range(2))
        seqlens = torch.tensor([0, 37, 250], dtype=torch.int32, device="cuda")
        for page in (None, 64):
            if page is None:
                kc, vc = (torch.zeros(b, 320, hk, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
                table = None
            else:
                kc, vc = (torch.zeros(b * 5, page, hk, d, device="cuda").to(torch.float8_e4m3fn)
                          for _ in range(2))
                table = torch.randperm(b * 5, device="cuda").to(torch.int32).view(b, 5)
            q = torch.randn(b, 3, 8, d, device="cuda", dtype=torch.bfloat16)
            kn, vn = (torch.randn(b, 3, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for splits in (1, 4):
                out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table,
                                              causal=True, num_splits=splits, k_descale=kd, v_descale=vd)
                assert torch.isfinite(out).all()
    torch.cuda.synchronize()


def ws_pack():
    import itertools

    from flashattn.backends.triton import attention, routes

    # the Gluon forward with GQA groups packed into its tiles (routes.gqa_pack): groups padded to a power of
    # two (6 -> 8, whose extra rows must read zeros and never be stored), a group past HALF_M (128: tiles of
    # one position's heads), rows without keys (sq > sk, causal), every option; each call's route asserted
    # packed
    band = dict(window_size=(100, 37), softcap=20.0)
    for (h, hk), (sq, sk), d, options in (((8, 2), (64, 300), 128, dict(causal=True)),
                                          ((12, 2), (17, 1023), 64, band),
                                          ((128, 1), (3, 200), 128, dict(causal=True)),
                                          ((6, 2), (50, 40), 256, dict(causal=True)),
                                          ((12, 2), (40, 113), 192, dict(causal=True))):
        q = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        spec = attention.spec_of(q, k, v, **options)
        route = routes.gluon_forward_route(spec)
        assert route.pack > 1, route
        opts = dict(options, causal=options.get("causal", False))
        extra = dict(alibi_slopes=torch.rand(2, h, device="cuda"),
                     learnable_sink=torch.randn(h, device="cuda")) if d == 64 else {}
        out, _ = attention.attention_forward(q, k, v, softmax_scale=d ** -0.5, route=route, **opts,
                                             **extra)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    # varlen: sequences ending inside a warpgroup's rows (masked stores of a position's heads), empty ones
    lens_q, lens_k = [0, 17, 64, 5, 40, 1], [5, 30, 64, 900, 0, 200]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), 12, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = dict(causal=True, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    route = routes.gluon_forward_route(attention.spec_of(q, k, v, **call))
    assert route.pack == 8, route
    out, _ = attention.attention_forward(q, k, v, softmax_scale=0.1, cu_seqlens_k=cu_k, route=route, **call)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def ws_ahead():
    # the Gluon forward with each next QK^T issued before the softmax (qk_ahead, 128-row tiles of 64 keys):
    # 16-bit d 64 / 128 (one key step, two, many; causal sq != sk, a window with softcap and a sink) and FP8
    from flashattn import config
    from flashattn import fp8 as q8
    from flashattn.backends.triton import attention, routes

    def ahead(q, k, v, opts):
        return dataclasses.replace(routes.gluon_forward_route(attention.spec_of(q, k, v, **opts)),
                                   qk_ahead=True)

    with config.use_tiles("fwd_ws=128,64,4,2"):
        for (b, sq, sk, h, hk, d), opts in [((2, 67, 130, 4, 2, 64), dict(causal=True)),
                                           ((1, 300, 137, 4, 1, 128), dict(causal=True)),
                                           ((1, 200, 63, 4, 2, 128), {}),
                                           ((1, 130, 300, 2, 2, 64), dict(window_size=(40, 3), softcap=5.0,
                                                                          sink=True))]:
            opts = dict(opts)
            opts.setdefault("causal", False)
            if opts.pop("sink", False):
                opts["learnable_sink"] = torch.zeros(h, device="cuda")
            q, k, v = (t.detach() for t in _qkv((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
            out, _ = attention.attention_forward(q, k, v, softmax_scale=d ** -0.5, route=ahead(q, k, v, opts),
                                                 **opts)
            (q, qd), (k, kd), (v, vd) = (q8.quantize(t.float(), "head") for t in (q, k, v))
            out8, _ = attention.attention_forward_fp8(q, k, v, qd, kd, vd, out_dtype=torch.bfloat16,
                                                      softmax_scale=d ** -0.5, route=ahead(q, k, v, opts),
                                                      **opts)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all() and torch.isfinite(out8).all()


def softcap_wide():
    import itertools
    from dataclasses import replace

    from flashattn.backends.triton import attention, routes

    lq, lk = [505, 512, 492, 500], [254, 236, 256, 241]
    q = torch.randn(sum(lq), 4, 160, device="cuda", dtype=torch.float16) * 50
    k, v = (torch.randn(sum(lk), 4, 160, device="cuda", dtype=torch.float16) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32, device="cuda")
                  for ls in (lq, lk))
    call = dict(causal=True, softcap=50.0, cu_seqlens_q=cu_q, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    route = routes.forward_route(attention.spec_of(q, k, v, **call))
    for r in (route, replace(route, tiles=replace(route.tiles, num_stages=2))):
        out, _ = attention.attention_forward(q, k, v, softmax_scale=160 ** -0.5, cu_seqlens_k=cu_k, route=r,
                                             **call)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()


for name in sys.argv[1:] or ("dense", "decode", "decode_bad", "sparse"):
    globals()[name]()
    print(f"sanitize case {name} done", flush=True)
