"""flash_attn_with_kvcache against the fp64 oracle on the gathered, appended cache (CPU: torch backend and the
Triton kernels under the interpreter; small shapes chosen to cross key tiles, pages and query blocks)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch
from utils import assert_close_to_ref

from flashattn import DecodePlan
from flashattn import config as flashattn_config
from flashattn.kvcache import flash_attn_with_kvcache
from flashattn.reference import attention_ref

# --------------------------------------------------------------------------------------------------------
# independent plain-torch references: rotary (complex-number form), paging, the expected cache after append


def rope_ref(x, cos, sin, positions, interleaved):
    """x (b, s, heads, d) rotated on its first 2·cos.shape[1] dims at positions (b, s), computed in fp64."""
    rd = 2 * cos.shape[1]
    angle = torch.atan2(sin.double(), cos.double())[positions].unsqueeze(2)  # (b, s, 1, rd/2)
    mag = torch.hypot(sin.double(), cos.double())[positions].unsqueeze(2)
    xr = x.double()[..., :rd]
    if interleaved:
        pairs = torch.view_as_complex(xr.unflatten(-1, (rd // 2, 2)).contiguous())
        turned = torch.view_as_real(pairs * torch.polar(mag, angle)).flatten(-2)
    else:
        pairs = torch.complex(xr[..., : rd // 2], xr[..., rd // 2 :])
        z = pairs * torch.polar(mag, angle)
        turned = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((turned, x.double()[..., rd:]), dim=-1).to(x.dtype)


def to_paged(cache, page_size, generator, extra_pages=3):
    """A page pool holding (b, cap, hk, d) in shuffled pages, and its block table (b, cap // page_size)."""
    b, cap, hk, d = cache.shape
    n = cap // page_size
    num_pages = b * n + extra_pages
    order = torch.randperm(num_pages, generator=generator)[: b * n]
    pool = torch.randn(num_pages, page_size, hk, d, generator=generator).to(cache.dtype)
    pool[order] = cache.reshape(b * n, page_size, hk, d)
    return pool, order.view(b, n).to(torch.int32)


def from_paged(pool, block_table):
    return pool[block_table.long()].flatten(1, 2)  # (b, max_pages · page_size, hk, d)


def rotary_tables(n, rd, dtype, generator):
    angle = torch.rand(n, rd // 2, generator=generator, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


@dataclass
class Case:
    b: int = 2
    sq: int = 1
    h: int = 8
    hk: int = 2
    d: int = 32
    cap: int = 80  # keys each cache row holds (a multiple of page_size when paged)
    seqlens: list | int | None = field(default_factory=lambda: [37, 70])
    s_new: int = 1
    page: int | None = None
    rotary: int = 0  # rotary_dim, 0 = off
    interleaved: bool = True
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    leftpad: list | None = None
    batch_idx: list | None = None
    b_cache: int | None = None
    splits: int = 0
    mask: float = 0.0  # share of cache positions a key_padding_mask hides (0: no mask)
    via: str = "func"  # "func": flash_attn_with_kvcache; "plan": a DecodePlan's run


def masked_ref(q, k, v, keep, lo, diag, *, causal, window, softcap, slopes, upcast=True):
    """Attention of q (sq, h, d) over keys k/v (n, hk, d) at absolute positions lo.., those with keep (n,)
    visible, query i aligned with key i + diag (absolute alignment, unlike attention_ref's padding masks).
    In float64 (upcast) or q's dtype; returns out (sq, h, d), lse (h, sq)."""
    dt = torch.float64 if upcast else q.dtype
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(dt), k.to(dt).repeat_interleave(group, 1), v.to(dt).repeat_interleave(group, 1)
    s = torch.einsum("ihd,nhd->hin", qf, kf) / math.sqrt(q.shape[-1])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rel = (torch.arange(k.shape[0]) + lo).view(1, -1) - (torch.arange(q.shape[0]) + diag).view(-1, 1)
    if slopes is not None:
        s = s - slopes.to(dt).view(-1, 1, 1) * rel.abs()
    left, right = window[0], 0 if causal else window[1]
    visible = keep.view(1, -1) & (rel >= -left if left >= 0 else True)
    visible = visible & (rel <= right if right >= 0 else True)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)  # (h, sq), -inf for rows that see nothing
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1).to(dt))
    out = torch.einsum("hin,nhd->ihd", p, vf)
    return out, torch.where(torch.isinf(lse), math.inf, lse)


def run_case(c: Case, dtype, *, check=True, seed=0):
    """Runs flash_attn_with_kvcache on a fresh cache; checks out, lse and the cache against the references.
    Returns (out, lse, the cache after the call as (b, cap, hk, d) per batch entry)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    b_cache = c.b_cache or c.b
    kc0, vc0 = randn(b_cache, c.cap, c.hk, c.d), randn(b_cache, c.cap, c.hk, c.d)
    q = randn(c.b, c.sq, c.h, c.d)
    k = randn(c.b, c.s_new, c.hk, c.d) if c.s_new else None
    v = randn(c.b, c.s_new, c.hk, c.d) if c.s_new else None
    idx = torch.tensor(c.batch_idx, dtype=torch.int32) if c.batch_idx is not None else None
    rows = idx.long() if idx is not None else torch.arange(c.b)
    if isinstance(c.seqlens, list):
        seqlens = torch.tensor(c.seqlens, dtype=torch.int32)
        starts = seqlens.long()
    else:
        seqlens = c.seqlens
        starts = torch.full((c.b,), c.cap if c.seqlens is None else c.seqlens, dtype=torch.long)
    leftpad = torch.tensor(c.leftpad, dtype=torch.int32) if c.leftpad is not None else None
    cos = sin = None
    if c.rotary:
        cos, sin = rotary_tables(c.cap, c.rotary, dtype, g)
    slopes = torch.rand(c.b, c.h, generator=g) * 0.3 if c.alibi else None
    capacity = c.cap
    keep = torch.rand(c.b, capacity, generator=g) >= c.mask if c.mask else None

    if c.page is None:
        kc, vc, bt = kc0.clone(), vc0.clone(), None
    else:
        kc, bt = to_paged(kc0, c.page, g)
        vc = kc.clone()
        vc[bt.long().flatten()] = vc0.reshape(-1, c.page, c.hk, c.d)
    if c.via == "plan":
        plan = DecodePlan(c.b, c.h, c.hk, c.d, page_size=c.page, max_seqlen_k=c.cap, dtype=dtype,
                          device="cpu", seqlen_q=c.sq, causal=c.causal, window_size=c.window,
                          softcap=c.softcap, rotary_interleaved=c.interleaved, num_splits=c.splits)
        out, lse = plan.run(q, kc, vc, seqlens, bt, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                            cache_leftpad=leftpad, cache_batch_idx=idx, alibi_slopes=slopes,
                            key_padding_mask=keep, return_softmax_lse=True)
    else:
        out, lse = flash_attn_with_kvcache(
            q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, cache_batch_idx=idx,
            cache_leftpad=leftpad, block_table=bt, causal=c.causal, window_size=c.window, softcap=c.softcap,
            rotary_interleaved=c.interleaved, alibi_slopes=slopes, num_splits=c.splits,
            return_softmax_lse=True, key_padding_mask=keep,
        )
    k_after = kc[rows] if bt is None else from_paged(kc, bt)
    v_after = vc[rows] if bt is None else from_paged(vc, bt)
    if not check:
        return out, lse, k_after

    # -- expected cache: rows[i] of the original with the (rotated) new keys at starts[i] + j
    k_exp, v_exp = kc0[rows].clone(), vc0[rows].clone()
    q_ro = q
    if c.s_new:
        pos = starts.view(-1, 1) + torch.arange(c.s_new)
        k_ro = rope_ref(k, cos, sin, pos, c.interleaved) if c.rotary else k
        for i in range(c.b):
            k_exp[i, pos[i]] = k_ro[i]
            v_exp[i, pos[i]] = v[i]
    if c.rotary:
        per_row = c.causal or tuple(c.window) != (-1, -1)
        q_ro = rope_ref(q, cos, sin, starts.view(-1, 1) + torch.arange(c.sq) * per_row, c.interleaved)
    ktol = 0.0 if not c.rotary else (1e-6 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(k_after, k_exp, rtol=0, atol=ktol, msg="k cache after append")
    assert torch.equal(v_after, v_exp), "v cache after append"

    # -- the oracle, one sequence at a time on its keys [leftpad, seqlen + s_new)
    out_ref = torch.zeros(c.b, c.sq, c.h, c.d, dtype=torch.float64)
    out_pt = torch.zeros(c.b, c.sq, c.h, c.d, dtype=dtype)
    lse_ref = torch.full((c.b, c.h, c.sq), math.inf, dtype=torch.float64)
    lse_pt = torch.full((c.b, c.h, c.sq), math.inf)
    for i in range(c.b):
        lo = int(leftpad[i]) if leftpad is not None else 0
        end = int(starts[i]) + c.s_new
        if end <= lo:
            continue
        if keep is not None:
            for upcast, o_dst, l_dst in ((True, out_ref, lse_ref), (False, out_pt, lse_pt)):
                o, l_ = masked_ref(q_ro[i], k_exp[i, lo:end], v_exp[i, lo:end], keep[i, lo:end], lo,
                                   end - c.sq, causal=c.causal, window=c.window, softcap=c.softcap,
                                   slopes=None if slopes is None else slopes[i], upcast=upcast)
                o_dst[i], l_dst[i] = o, l_
            continue
        kw = dict(causal=c.causal, window_size=c.window, softcap=c.softcap,
                  alibi_slopes=None if slopes is None else slopes[i])
        args = (q_ro[i : i + 1], k_exp[i : i + 1, lo:end], v_exp[i : i + 1, lo:end])
        o, l_ = attention_ref(*args, **kw)
        out_ref[i], lse_ref[i] = o[0], l_[0]
        o, l_ = attention_ref(*args, upcast=False, **kw)
        out_pt[i], lse_pt[i] = o[0], l_[0]
    assert_close_to_ref(out, out_ref, out_pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, name="lse")
    return out, lse, k_after


CASES = {
    "decode": Case(),
    "decode-page16": Case(page=16),
    "append-across-page64": Case(cap=128, seqlens=[60, 63], s_new=3, sq=3, causal=True, page=64),
    "page256": Case(cap=256, seqlens=[100, 200], s_new=2, sq=2, page=256),
    "rotary-gptj-causal": Case(sq=3, s_new=3, rotary=32, causal=True),
    "rotary-neox-partial-paged": Case(sq=2, s_new=2, rotary=16, interleaved=False, page=16),
    "spec-verify-causal-sq4": Case(sq=4, s_new=4, seqlens=[10, 45], causal=True, page=16),
    "empty-cache": Case(seqlens=[0, 0], causal=True),
    "no-key-row": Case(seqlens=[0, 5], s_new=0),
    "full-cache": Case(seqlens=[78, 78], s_new=2, causal=True),
    "full-default-seqlens": Case(seqlens=None, s_new=0, h=4, hk=4),
    "int-seqlens": Case(seqlens=30, s_new=2, sq=2, causal=True, d=24),
    "batch-idx": Case(b_cache=4, batch_idx=[3, 1], s_new=2, sq=2, rotary=32, causal=True),
    "leftpad": Case(leftpad=[5, 0], seqlens=[20, 30], causal=True),
    "gqa1": Case(h=4, hk=4, seqlens=[33, 17]),
    "gqa8": Case(h=8, hk=1, page=16),
    "gqa32": Case(h=32, hk=1, d=16, b=1, seqlens=[50]),
    "window-causal": Case(sq=3, s_new=3, causal=True, window=(8, 0)),
    "window-both": Case(sq=2, s_new=2, window=(10, 3), seqlens=[40, 70]),
    "softcap": Case(softcap=2.0, causal=True, sq=2, s_new=2),
    "alibi": Case(alibi=True, causal=True, sq=2, s_new=2, page=16),
    "chunked-prefill": Case(b=1, sq=20, s_new=20, h=4, hk=2, seqlens=[12], causal=True, cap=64, page=16),
    "splits-3": Case(splits=3),
    # more splits than the merge loads at once (LSEs and outputs both take several chunks); the short
    # sequence leaves most of its splits empty
    "splits-40-empty-partials": Case(h=4, hk=2, cap=1344, seqlens=[1300, 100], splits=40),
    # more new keys than a key tile: the append is shared by the (split, query block) programs of a sequence
    "append-two-tiles-rotary-splits": Case(b=1, sq=40, s_new=40, h=2, hk=2, cap=96, seqlens=[10], causal=True,
                                           page=16, rotary=16, splits=2),
    # a key_padding_mask (a flashattn extension): absolute positions hidden on top of the ranges
    "mask-decode": Case(mask=0.3),
    "mask-append-rotary-alibi-paged": Case(mask=0.4, page=16, sq=2, s_new=2, causal=True, alibi=True,
                                           rotary=16),
    "mask-window-splits": Case(mask=0.5, window=(10, 3), sq=2, s_new=2, splits=3, seqlens=[40, 70]),
    "mask-everything": Case(mask=1.0, seqlens=[20, 30]),
    # DecodePlan.run: the same machinery, a plan's route and workspace
    "plan-decode-page16": Case(page=16, via="plan"),
    "plan-append-rotary-causal-splits": Case(sq=3, s_new=3, rotary=32, causal=True, splits=3, via="plan"),
    "plan-leftpad-batch-idx-mask": Case(b_cache=4, batch_idx=[3, 1], leftpad=[5, 0], seqlens=[20, 30],
                                        mask=0.2, via="plan"),
}


# dtypes given explicitly: every case on both backends in fp32 (sharp tolerances), a few in fp16
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_cases(backend, dtype, name):
    run_case(CASES[name], dtype)


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("name", ["decode-page16", "rotary-gptj-causal", "spec-verify-causal-sq4"])
def test_kvcache_fp16(backend, dtype, name):
    run_case(CASES[name], dtype)


@pytest.mark.parametrize("page", [16, 64, 256])
def test_paged_equals_contiguous(backend, page):
    # same capacity and split count, so the kernels visit the same tiles: the results are identical
    base = Case(cap=256, seqlens=[100, 250], s_new=3, sq=3, causal=True, rotary=16, splits=2)
    out_c, lse_c, k_c = run_case(base, torch.float32, check=False)
    out_p, lse_p, k_p = run_case(replace(base, page=page), torch.float32, check=False)
    assert torch.equal(k_c, k_p)
    torch.testing.assert_close(out_p, out_c, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse_p, lse_c, rtol=0, atol=1e-6)


def test_split_counts_agree(backend):
    outs = [run_case(replace(CASES["decode"], splits=s), torch.float32, check=False)[0] for s in (1, 2, 5)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=1e-6)


def test_no_key_rows(backend):
    out, lse, _ = run_case(CASES["no-key-row"], torch.float32)
    assert torch.all(out[0] == 0) and torch.all(torch.isposinf(lse[0]))


# --------------------------------------------------------------------------------------------------------
# bad input: the message names the argument, the value and what was expected (torch backend: the checks are
# shared, no need to interpret kernels)


def _base(page=None, b=2, cap=64):
    """Valid arguments: q (b, 1, 4, 16) against a cache of 2 kv heads holding `cap` keys per sequence."""
    args = dict(q=torch.randn(b, 1, 4, 16), cache_seqlens=3)
    if page is None:
        args.update(k_cache=torch.randn(b, cap, 2, 16), v_cache=torch.randn(b, cap, 2, 16))
    else:
        args.update(k_cache=torch.randn(b * cap // page, page, 2, 16),
                    v_cache=torch.randn(b * cap // page, page, 2, 16),
                    block_table=torch.arange(b * cap // page, dtype=torch.int32).view(b, -1))
    return args


def _with(page=None, **changes):
    def make():
        args = _base(page)
        for key, value in changes.items():
            args[key] = value(args) if callable(value) else value
        return args

    return make


def _new(s=1):
    return torch.randn(2, s, 2, 16)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _bad_pages(a):
    bt = a["block_table"].clone()
    bt[0, 1] = 999
    return bt


def _odd_pages(a):
    return torch.randn(6, 20, 2, 16)


# the values of device tensors: checked only on request (check_inputs=True), with the messages of the checks
BAD_VALUES = {
    "block-table-range": (_with(16, block_table=_bad_pages, cache_seqlens=_i32(20, 5)), ValueError,
                          r"block_table\[0, 1\] = 999 but the cache has 8 pages"),
    "seqlens-over-capacity": (_with(k=_new(), v=_new(), cache_seqlens=_i32(64, 3)), ValueError,
                              r"cache_seqlens\[0\] = 64 with 1 new keys needs 65 cache positions; "
                              r"expected .* <= 64 \(the cache capacity: k_cache's seqlen_cache\)"),
    "paged-seqlens-over-capacity": (_with(16, cache_seqlens=_i32(3, 65)), ValueError,
                                    r"cache_seqlens\[1\] = 65 .* <= 64 \(the cache capacity: block_table's "
                                    r"max_pages 4 x page_size 16\)"),
    "batch-idx-range": (_with(cache_batch_idx=_i32(0, 2)), ValueError,
                        r"cache_batch_idx\[1\] = 2; expected a cache row in \[0, 2\)"),
    "leftpad-range": (_with(cache_leftpad=_i32(4, 0), cache_seqlens=_i32(3, 3)), ValueError,
                      r"cache_leftpad\[0\] = 4; expected 0 <= cache_leftpad <= cache_seqlens = 3"),
}

BAD = {
    "int-seqlens-over": (_with(cache_seqlens=65), ValueError, r"cache_seqlens=65 .* <= 64"),
    "seqlens-int64": (_with(cache_seqlens=torch.tensor([3, 3])), TypeError,
                      r"cache_seqlens has dtype torch.int64; expected torch.int32"),
    "block-table-int64": (_with(16, block_table=lambda a: a["block_table"].long()), TypeError,
                          r"block_table has dtype torch.int64; expected torch.int32"),
    "cache-dtype": (_with(k_cache=lambda a: a["k_cache"].half()), TypeError,
                    r"k_cache has dtype torch.float16 but q has torch.float32"),
    "q-float64": (_with(q=lambda a: a["q"].double()), TypeError, r"q has dtype torch.float64"),
    "page-size-20": (_with(16, k_cache=_odd_pages, v_cache=_odd_pages), ValueError,
                     r"page_size 20 .* expected a multiple of 16"),
    "k-without-v": (_with(k=_new()), ValueError, r"k and v must be given together"),
    "rotary-without-k": (_with(rotary_cos=torch.ones(64, 8), rotary_sin=torch.zeros(64, 8)), ValueError,
                         r"rotary_cos/rotary_sin are given without k/v"),
    "rotary-too-short": (_with(k=_new(), v=_new(), rotary_cos=torch.ones(32, 8),
                               rotary_sin=torch.zeros(32, 8)), ValueError,
                         r"rotary_cos has 32 rows .* at least the cache capacity 64"),
    "batch-idx-paged": (_with(16, cache_batch_idx=_i32(0, 1)), ValueError,
                        r"cache_batch_idx is not supported with a paged cache"),
    "int-seqlens-over-paged": (_with(16, cache_seqlens=61, k=_new(4), v=_new(4)), ValueError,
                               r"cache_seqlens=61 with 4 new keys .* <= 64 \(the cache capacity: "
                               r"block_table's max_pages 4 x page_size 16\)"),
    "new-keys-over-capacity": (_with(k=_new(65), v=_new(65), cache_seqlens=0), ValueError,
                               r"k has seqlen_new 65; expected at most 64"),
    "seqlens-strided": (_with(cache_seqlens=lambda a: _i32(3, 0, 3, 0)[::2]), ValueError,
                        r"cache_seqlens has stride 2; expected a contiguous"),
    "key-mask-dtype": (_with(key_padding_mask=torch.ones(2, 64, dtype=torch.uint8)), TypeError,
                       r"key_padding_mask must be a torch.bool tensor of shape \(2, 64\)"),
    "key-mask-shape": (_with(16, key_padding_mask=torch.ones(2, 63, dtype=torch.bool)), ValueError,
                       r"key_padding_mask has shape \(2, 63\); expected \(2, 64\) = \(batch, 64 \(the cache "
                       r"capacity: block_table's"),
    "gqa-heads": (_with(k_cache=torch.randn(2, 64, 3, 16), v_cache=torch.randn(2, 64, 3, 16)), ValueError,
                  r"k_cache has 3 heads but q has 4; nheads must be a multiple of nheads_k"),
    "append-without-seqlens": (_with(k=_new(), v=_new(), cache_seqlens=None), ValueError,
                               r"k/v are given but cache_seqlens is None"),
    "alibi-dtype": (_with(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError,
                    r"alibi_slopes must be a float32 tensor"),
    "window-type": (_with(window_size=(2.5, 0)), ValueError, r"window_size left must be an int >= -1"),
    "num-splits": (_with(num_splits=-1), ValueError, r"num_splits must be an int >= 0"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(monkeypatch, name):
    make, exc, match = BAD[name]
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**make())


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_bad_values_with_checks(monkeypatch, name):
    make, exc, match = BAD_VALUES[name]
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**make(), check_inputs=True)
    # the setting does the same for calls that leave check_inputs at None, and check_inputs=False wins
    with flashattn_config.use_check_indices(True), pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**make())
    with flashattn_config.use_check_indices(True):
        flash_attn_with_kvcache(**make(), check_inputs=False)


def test_unused_block_table_entries_are_not_checked(monkeypatch):
    # vLLM-style tables pad with -1 or garbage past each sequence's last page
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    args = _base(16)
    args["block_table"][0, 2:] = -1
    args["block_table"][1, 1:] = 1000
    args["cache_seqlens"] = _i32(32, 16)
    flash_attn_with_kvcache(**args)


def test_bench_decode_suite():
    # the `decode` bench suite: its grid, the paged copy its provider times, and the derived tbps
    from flashattn.bench.suites import decode as suite

    cases = suite.build_cases(suite._grid(quick=False))
    assert len(cases) == 2 * 4 * 3  # batch 1 and 16, four kv lengths, contiguous + two page sizes
    c = next(c for c in cases if c.batch == 16 and c.seqlen_k == 131072 and c.extra["page_size"] == 64)
    assert (c.seqlen_q, c.nheads, c.nheads_k, c.headdim) == (1, 32, 8, 128)
    assert c.extra["kv_bytes"] == 2 * 16 * 131072 * 8 * 128 * 2
    k = torch.randn(2, 40, 2, 16)
    pool, table = suite.paged_copy(k, 16)
    assert table.shape == (2, 3) and torch.equal(from_paged(pool, table)[:, :40], k)
    rows = [{"ms": 2.0, "kv_bytes": 4e9, "error": None}, {"ms": None, "kv_bytes": 4e9, "error": "skipped"}]
    suite.annotate(rows)
    assert rows[0]["tbps"] == pytest.approx(2.0) and rows[1]["tbps"] is None
    assert suite._skip(c, "sdpa-flash") and suite._skip(c, suite.OURS) is None
    assert suite._skip(c, suite.OURS_PLAN) is None
    # the eager providers on a small case (CPU, torch backend): the drop-in call and the plan agree
    from flashattn.bench.case import Case as BenchCase

    small = BenchCase(2, 4, 2, 1, 40, 16, False, "fp32", {"kv_len": 40, "page_size": 16, "kv_bytes": 0})
    q, kk, vv = torch.randn(2, 1, 4, 16), torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    with flashattn_config.use_backend("torch"):
        outs = [suite._setup_kvcache(small, q, kk, vv).fwd(), suite._setup_plan(small, q, kk, vv).fwd()]
    assert torch.equal(outs[0], outs[1])


def test_opcheck(monkeypatch):
    # schema, fake tensor and mutation declarations of the ops torch.compile traces through: kvcache_fwd
    # appends (mutates the caches), kvcache_attn only reads them
    from flashattn.ops.kvcache import kvcache_attn, kvcache_fwd

    monkeypatch.setattr(flashattn_config, "backend", "torch")
    kc, vc = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    q, kn, vn = torch.randn(2, 1, 8, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    seqlens = _i32(10, 50)
    args = (q, kc, vc, kn, vn, None, None, seqlens, 0, None, None, None, None, None, None,
            0.25, True, -1, 0, 0.0, None, True, 0, False)
    torch.library.opcheck(kvcache_fwd.library_op, args)
    mask = torch.rand(2, 64) > 0.3
    args = (q, kc, vc, seqlens, 0, None, None, None, mask, None, None, 0.25, False, -1, -1, 0.0, None, 0,
            False)
    torch.library.opcheck(kvcache_attn.library_op, args)


@pytest.mark.parametrize("append", [True, False], ids=["kvcache_fwd", "kvcache_attn"])
def test_registered_ops_equal_the_eager_path(backend, append):
    from flashattn.ops.registry import through_registered_ops

    c = replace(CASES["decode-page16"], s_new=1 if append else 0, splits=3, mask=0.2 if not append else 0.0)
    eager = run_case(c, torch.float32, check=False)
    with through_registered_ops():
        traced = run_case(c, torch.float32, check=False)
    for a, b in zip(eager, traced, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------
# device indices out of range, unchecked (the default): every index is clamped into range, so the call is the
# call with the clamped values; under the interpreter an access out of bounds would crash instead


def _index_case(name):
    """(bad, clamped): the keyword arguments of a call with out-of-range device indices, and of the same call
    with the values the kernels clamp them to. Append (2 keys, rotary) and 3 splits throughout."""
    g = torch.Generator().manual_seed(3)
    b, h, hk, d, page, max_pages = 2, 8, 2, 32, 16, 5
    base = dict(q=torch.randn(b, 2, h, d, generator=g), k=torch.randn(b, 2, hk, d, generator=g),
                v=torch.randn(b, 2, hk, d, generator=g), causal=True, num_splits=3,
                rotary_cos=torch.rand(80, 8, generator=g), rotary_sin=torch.rand(80, 8, generator=g))
    if name == "pages":
        # pages 10 and 11 of the pool are nobody's: 10**6 clamps to 11 (where sequence 0 appends), -7 to 0
        base.update(k_cache=torch.randn(12, page, hk, d, generator=g),
                    v_cache=torch.randn(12, page, hk, d, generator=g), cache_seqlens=_i32(30, 70))
        table = torch.arange(b * max_pages, dtype=torch.int32).view(b, max_pages)
        bad, good = table.clone(), table.clone()
        bad[0, 1], bad[1, 3], good[0, 1], good[1, 3] = 10**6, -7, 11, 0
        return dict(base, block_table=bad), dict(base, block_table=good)
    base.update(k_cache=torch.randn(4, 80, hk, d, generator=g),
                v_cache=torch.randn(4, 80, hk, d, generator=g))
    if name == "seqlens":  # capacity 80, 2 new keys: into [0, 78]
        return dict(base, cache_seqlens=_i32(200, -5)), dict(base, cache_seqlens=_i32(78, 0))
    if name == "leftpad":  # into [0, cache_seqlens]
        seqlens = _i32(37, 70)
        return (dict(base, cache_seqlens=seqlens, cache_leftpad=_i32(60, -3)),
                dict(base, cache_seqlens=seqlens, cache_leftpad=_i32(37, 0)))
    assert name == "batch-idx"  # into [0, batch_cache)
    seqlens = _i32(37, 70)
    return (dict(base, cache_seqlens=seqlens, cache_batch_idx=_i32(7, -1)),
            dict(base, cache_seqlens=seqlens, cache_batch_idx=_i32(3, 0)))


@pytest.mark.parametrize("name", ["seqlens", "leftpad", "batch-idx", "pages"])
def test_out_of_range_indices_are_clamped(backend, name):
    bad, good = _index_case(name)
    results = []
    for kwargs in (bad, good):
        kwargs = dict(kwargs, k_cache=kwargs["k_cache"].clone(), v_cache=kwargs["v_cache"].clone())
        out, lse = flash_attn_with_kvcache(**kwargs, return_softmax_lse=True)
        results.append((out, lse, kwargs["k_cache"], kwargs["v_cache"]))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_default_call_reads_no_device_value(monkeypatch):
    # the range checks are the only code that reads index values on the host: off unless asked for
    from flashattn import _validate_cache

    def no_check(*args):
        raise AssertionError("the device indices were read on the host")

    monkeypatch.setattr(flashattn_config, "backend", "torch")
    monkeypatch.setattr(_validate_cache, "check_indices", no_check)
    args = _base(16)
    args["cache_seqlens"] = _i32(10, 20)
    for _ in range(2):  # the checked signature's path, then the cached one
        flash_attn_with_kvcache(**args)
    with pytest.raises(AssertionError, match="read on the host"):
        flash_attn_with_kvcache(**args, check_inputs=True)


def test_repeated_signature_is_checked_once(monkeypatch):
    from flashattn import _validate_cache

    calls = []
    check_args = _validate_cache.check_args
    monkeypatch.setattr(_validate_cache, "check_args", lambda *a: calls.append(1) or check_args(*a))
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    args = _base(16)
    for n in (3, 40, 17):  # an int cache_seqlens varies from call to call and is checked on each
        args["cache_seqlens"] = n
        flash_attn_with_kvcache(**args)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="cache_seqlens=65"):
        flash_attn_with_kvcache(**dict(args, cache_seqlens=65))
    flash_attn_with_kvcache(**dict(args, softcap=2.0))  # another option: another signature
    assert len(calls) == 2
