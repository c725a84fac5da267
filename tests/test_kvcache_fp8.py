"""An FP8 (e4m3) KV cache: flash_attn_with_kvcache and DecodePlan.run with k_descale / v_descale (CPU: the
torch backend and the Triton kernel under the interpreter).

The oracle is fp64 attention on the dequantised cache as the call leaves it (x_fp8 · descale), so what is
measured is the kernel's own rounding; the yardstick (tests/utils.py's tolerance rule) is plain PyTorch doing
the same in q's dtype: the fp8 cache dequantised to q's dtype, then attention in q's dtype. The new keys and
values must land in the cache quantised exactly as torch quantises them (x / descale in fp32, clamped to
±448, rounded to nearest e4m3), compared byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from test_kvcache import Case, from_paged, masked_ref, rope_ref, rotary_tables, to_paged
from utils import HAS_CUDA, INTERPRET, assert_close_to_ref, max_abs_err

from flashattn import DecodePlan
from flashattn import config as flashattn_config
from flashattn.fp8 import FP8, FP8_MAX, quantize
from flashattn.kernels.triton.decode import _to_cache
from flashattn.kvcache import flash_attn_with_kvcache
from flashattn.reference import attention_ref

HAS_TRITON = HAS_CUDA or INTERPRET


def _bytes(t):
    return t.view(torch.uint8)  # torch.equal has no e4m3 kernel; equal bytes are equal values (and signs)


def rope32(x, cos, sin, positions, interleaved):
    """x (b, s, hk, d) rotated in fp32 with the kernels' formula (x_a c - x_b s, x_b c + x_a s): the new keys
    as both backends compute them before quantising, so their e4m3 bytes can be compared exactly."""
    rd = 2 * cos.shape[1]
    c = cos.float()[positions].unsqueeze(2)
    s = sin.float()[positions].unsqueeze(2)
    xf = x.float()
    xr, rest = xf[..., :rd], xf[..., rd:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def quantize_rows(x, descale):
    """x (b, s, hk, d) as an FP8 cache stores it with a (b, hk) descale: torch's own clamp and cast."""
    return (x.float() / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_batch(descale, b, hk):
    """A call's descale, (1,) or (b, hk), as (b, hk)."""
    return descale.expand(b, hk) if descale.dim() == 1 else descale


def make_inputs(c: Case, dtype, granularity: str, seed: int = 0, scale_new: float = 1.0):
    """The inputs of a call on an fp8 cache quantised from a random 16-bit one (granularity "tensor" or
    "head"), plus what the checks need: the 16-bit cache itself, the cache rows and lengths."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    b_cache = c.b_cache or c.b
    # each (cache row, KV head) in a binade of its own (quantize's descales are powers of two): a descale
    # read for the wrong row or head scales the result
    spread = 2.0 ** (torch.arange(b_cache * c.hk) % 5 - 2).view(b_cache, 1, c.hk, 1)
    k0 = (randn(b_cache, c.cap, c.hk, c.d) * spread).to(dtype)
    v0 = (randn(b_cache, c.cap, c.hk, c.d) / spread).to(dtype)
    kc8, kd_cache = quantize(k0, granularity)
    vc8, vd_cache = quantize(v0, granularity)
    idx = torch.tensor(c.batch_idx, dtype=torch.int32) if c.batch_idx is not None else None
    rows = idx.long() if idx is not None else torch.arange(c.b)
    if isinstance(c.seqlens, list):
        seqlens = torch.tensor(c.seqlens, dtype=torch.int32)
        starts = seqlens.long()
    else:
        seqlens = c.seqlens
        starts = torch.full((c.b,), c.cap if c.seqlens is None else c.seqlens, dtype=torch.long)
    a = dict(
        q=randn(c.b, c.sq, c.h, c.d),
        # the new keys and values in their cache row's binades
        k=(randn(c.b, c.s_new, c.hk, c.d) * spread[rows] * scale_new).to(dtype) if c.s_new else None,
        v=(randn(c.b, c.s_new, c.hk, c.d) / spread[rows] * scale_new).to(dtype) if c.s_new else None,
        cache_seqlens=seqlens, cache_batch_idx=idx,
        cache_leftpad=torch.tensor(c.leftpad, dtype=torch.int32) if c.leftpad is not None else None,
        k_descale=kd_cache[rows] if granularity == "head" else kd_cache,
        v_descale=vd_cache[rows] if granularity == "head" else vd_cache,
    )
    a["rotary_cos"], a["rotary_sin"] = rotary_tables(c.cap, c.rotary, dtype, g) if c.rotary else (None, None)
    a["alibi_slopes"] = torch.rand(c.b, c.h, generator=g) * 0.3 if c.alibi else None
    a["key_padding_mask"] = torch.rand(c.b, c.cap, generator=g) >= c.mask if c.mask else None
    if c.page is None:
        a.update(k_cache=kc8, v_cache=vc8, block_table=None)
        caches16 = (k0.clone(), v0.clone(), None)
    else:
        a["k_cache"], a["block_table"] = to_paged(kc8, c.page, g)
        a["v_cache"] = a["k_cache"].clone()
        a["v_cache"][a["block_table"].long().flatten()] = vc8.reshape(-1, c.page, c.hk, c.d)
        k16, v16 = a["k_cache"].to(dtype), a["v_cache"].to(dtype)
        k16[a["block_table"].long().flatten()] = k0.reshape(-1, c.page, c.hk, c.d)
        v16[a["block_table"].long().flatten()] = v0.reshape(-1, c.page, c.hk, c.d)
        caches16 = (k16, v16, a["block_table"])
    return a, dict(rows=rows, starts=starts, k0=k0, v0=v0, caches16=caches16)


def call(c: Case, a: dict, dtype, **overrides):
    """flash_attn_with_kvcache, or a DecodePlan's run (c.via == "plan"), on the arguments a; returns
    (out, lse)."""
    a = {**a, **overrides}
    if c.via == "plan":
        plan = DecodePlan(c.b, c.h, c.hk, c.d, page_size=c.page, max_seqlen_k=c.cap, dtype=dtype,
                          cache_dtype=a["k_cache"].dtype, device="cpu", seqlen_q=c.sq, causal=c.causal,
                          window_size=c.window, softcap=c.softcap, rotary_interleaved=c.interleaved,
                          num_splits=c.splits)
        return plan.run(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"], k=a["k"],
                        v=a["v"], rotary_cos=a["rotary_cos"], rotary_sin=a["rotary_sin"],
                        cache_leftpad=a["cache_leftpad"], cache_batch_idx=a["cache_batch_idx"],
                        alibi_slopes=a["alibi_slopes"], key_padding_mask=a["key_padding_mask"],
                        k_descale=a["k_descale"], v_descale=a["v_descale"], return_softmax_lse=True)
    return flash_attn_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], rotary_cos=a["rotary_cos"],
        rotary_sin=a["rotary_sin"], cache_seqlens=a["cache_seqlens"], cache_batch_idx=a["cache_batch_idx"],
        cache_leftpad=a["cache_leftpad"], block_table=a["block_table"], causal=c.causal, window_size=c.window,
        softcap=c.softcap, rotary_interleaved=c.interleaved, alibi_slopes=a["alibi_slopes"],
        num_splits=c.splits, return_softmax_lse=True, key_padding_mask=a["key_padding_mask"],
        k_descale=a["k_descale"], v_descale=a["v_descale"])


def cache_after(a, rows):
    """The (b, capacity, hk, d) caches of q's batch entries, as the call left them."""
    if a["block_table"] is None:
        return a["k_cache"][rows], a["v_cache"][rows]
    return from_paged(a["k_cache"], a["block_table"]), from_paged(a["v_cache"], a["block_table"])


def expected_cache(c: Case, a, kc8_before, vc8_before, rows, starts):
    """The fp8 caches of q's batch entries after the append: the rows before, with the (rotated) new keys and
    values quantised at starts[i] + j."""
    k_exp, v_exp = kc8_before.clone(), vc8_before.clone()
    if c.s_new:
        b, hk = c.b, c.hk
        kd, vd = per_batch(a["k_descale"], b, hk), per_batch(a["v_descale"], b, hk)
        pos = starts.view(-1, 1) + torch.arange(c.s_new)
        k_new = rope32(a["k"], a["rotary_cos"], a["rotary_sin"], pos, c.interleaved) if c.rotary else a["k"]
        k_q, v_q = quantize_rows(k_new, kd), quantize_rows(a["v"], vd)
        for i in range(b):
            k_exp[i, pos[i]] = k_q[i]
            v_exp[i, pos[i]] = v_q[i]
    return k_exp, v_exp


def rotated_q(c: Case, a, starts):
    """q as the call rotates it (at its own positions when causal or windowed, else at cache_seqlens)."""
    if not c.rotary:
        return a["q"]
    per_row = c.causal or tuple(c.window) != (-1, -1)
    positions = starts.view(-1, 1) + torch.arange(c.sq) * per_row
    return rope_ref(a["q"], a["rotary_cos"], a["rotary_sin"], positions, c.interleaved)


def oracle(c: Case, a, k_real, v_real, starts, dtype):
    """(out_ref, lse_ref) in fp64 and (out_pt, lse_pt) in q's dtype on the real-valued caches k_real / v_real
    (b, capacity, hk, d), fp64; q rotated as the call rotates it."""
    q_ro = rotated_q(c, a, starts)
    out_ref = torch.zeros(c.b, c.sq, c.h, c.d, dtype=torch.float64)
    out_pt = torch.zeros(c.b, c.sq, c.h, c.d, dtype=dtype)
    lse_ref = torch.full((c.b, c.h, c.sq), math.inf, dtype=torch.float64)
    lse_pt = torch.full((c.b, c.h, c.sq), math.inf)
    leftpad, keep, slopes = a["cache_leftpad"], a["key_padding_mask"], a["alibi_slopes"]
    for i in range(c.b):
        lo = int(leftpad[i]) if leftpad is not None else 0
        end = int(starts[i]) + c.s_new
        if end <= lo:
            continue
        slope = None if slopes is None else slopes[i]
        ks, vs = k_real[i, lo:end], v_real[i, lo:end]
        for upcast, o_dst, l_dst in ((True, out_ref, lse_ref), (False, out_pt, lse_pt)):
            # the yardstick dequantises into q's dtype, as a plain PyTorch fp8 cache would
            kk, vv = (ks, vs) if upcast else (ks.to(dtype), vs.to(dtype))
            if keep is not None:
                o, l_ = masked_ref(q_ro[i], kk, vv, keep[i, lo:end], lo, end - c.sq, causal=c.causal,
                                   window=c.window, softcap=c.softcap, slopes=slope, upcast=upcast)
                o_dst[i], l_dst[i] = o, l_
                continue
            o, l_ = attention_ref(q_ro[i : i + 1], kk[None], vv[None], causal=c.causal, window_size=c.window,
                                  softcap=c.softcap, alibi_slopes=slope, upcast=upcast)
            o_dst[i], l_dst[i] = o[0], l_[0]
    return out_ref, lse_ref, out_pt, lse_pt


def dequantized(k8, descale, hk):
    """(b, n, hk, d) e4m3 rows times their descales, in fp64."""
    return k8.double() * per_batch(descale, k8.shape[0], hk).double()[:, None, :, None]


def run_fp8_case(c: Case, dtype, granularity: str):
    a, info = make_inputs(c, dtype, granularity)
    rows, starts = info["rows"], info["starts"]
    k_before, v_before = cache_after(a, rows)
    k_before, v_before = k_before.clone(), v_before.clone()
    out, lse = call(c, a, dtype)
    assert out.dtype == dtype
    k_after, v_after = cache_after(a, rows)
    k_exp, v_exp = expected_cache(c, a, k_before, v_before, rows, starts)
    assert torch.equal(_bytes(k_after), _bytes(k_exp)), "k cache after append"
    assert torch.equal(_bytes(v_after), _bytes(v_exp)), "v cache after append"
    k_real, v_real = dequantized(k_after, a["k_descale"], c.hk), dequantized(v_after, a["v_descale"], c.hk)
    out_ref, lse_ref, out_pt, lse_pt = oracle(c, a, k_real, v_real, starts, dtype)
    assert_close_to_ref(out, out_ref, out_pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, name="lse")
    return out, lse, a


# name -> (case, descale granularity)
FP8_CASES = {
    "decode-tensor": (Case(), "tensor"),
    "decode-head-page16": (Case(page=16), "head"),
    "decode-splits1": (Case(splits=1, page=16), "head"),
    "append-rotary-causal-sq3": (Case(sq=3, s_new=3, rotary=32, causal=True), "head"),
    "append-neox-paged-splits3": (Case(sq=2, s_new=2, rotary=16, interleaved=False, page=16, splits=3),
                                  "tensor"),
    "gqa8-window-splits": (Case(h=8, hk=1, sq=2, s_new=2, window=(10, 3), seqlens=[40, 70], splits=3,
                                page=16), "head"),
    "batch-idx": (Case(b_cache=4, batch_idx=[3, 1], s_new=2, sq=2, causal=True, rotary=32), "head"),
    "softcap-leftpad": (Case(softcap=2.0, causal=True, sq=2, s_new=2, leftpad=[5, 0], seqlens=[20, 30]),
                        "head"),
    "alibi-mask": (Case(alibi=True, mask=0.3, causal=True, sq=2, s_new=2, page=16), "tensor"),
    # more new keys than a key tile: the append is shared by the programs of a sequence, and the mixed tiles
    # read the new keys quantised from registers
    "append-two-tiles": (Case(b=1, sq=40, s_new=40, h=2, hk=2, cap=96, seqlens=[10], causal=True, page=16,
                              rotary=16, splits=2), "head"),
    "plan-append-rotary-splits": (Case(sq=3, s_new=3, rotary=32, causal=True, splits=3, page=16, via="plan"),
                                  "head"),
    "plan-decode-tensor": (Case(via="plan"), "tensor"),
}


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_cache_cases(backend, dtype, name):
    c, granularity = FP8_CASES[name]
    run_fp8_case(c, dtype, granularity)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("name", ["append-neox-paged-splits3", "batch-idx"])
def test_fp8_cache_fp32_q(backend, dtype, name):
    # fp32 q (the CPU path): the yardstick is fp32, so the descale folding must be exact to fp32 rounding
    c, granularity = FP8_CASES[name]
    run_fp8_case(c, dtype, granularity)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the Triton kernels (CUDA or TRITON_INTERPRET=1)")
def test_backends_agree():
    # the same bytes appended, and the same output up to fp32 rounding (both attend in fp32 here)
    c, granularity = replace(FP8_CASES["append-neox-paged-splits3"][0], rotary=32, interleaved=True), "head"
    results = []
    for name in ("torch", "triton"):
        a, _ = make_inputs(c, torch.float32, granularity)
        with flashattn_config.use_backend(name):
            results.append((*call(c, a, torch.float32), a["k_cache"], a["v_cache"]))
    (out_t, lse_t, kc_t, vc_t), (out_k, lse_k, kc_k, vc_k) = results
    assert torch.equal(_bytes(kc_t), _bytes(kc_k)) and torch.equal(_bytes(vc_t), _bytes(vc_k))
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse_k, lse_t, rtol=0, atol=1e-5)


def test_append_clamps_to_the_e4m3_range(backend):
    # new keys far past the cache's range (descale from the old keys): clamped to ±448, never inf or NaN
    c = Case(s_new=2, sq=2, causal=True, page=16)
    a, info = make_inputs(c, torch.float16, "head", scale_new=1000.0)
    out, _ = call(c, a, torch.float16)
    k_after, _ = cache_after(a, info["rows"])
    new = torch.stack([k_after[i, int(s) : int(s) + 2] for i, s in enumerate(info["starts"])]).float()
    assert torch.isfinite(new).all() and new.abs().max() == FP8_MAX
    assert torch.isfinite(out).all()


def test_q_scale_does_not_change_the_result(backend):
    # q · 2^s with softmax_scale · 2^-s is the same call exactly: the Triton kernel's fp16 dots take q
    # scaled by a power of two into fp16's range and fold the inverse into the score scale, the torch
    # backend attends in fp32; a scale folded in twice or not at all changes bits. q on a grid of 2^-4
    # with at most 7 mantissa bits: exact at every s. (A bf16 q past fp16's range: the GPU test.)
    c = Case(seqlens=[37, 70], page=16, splits=3)
    a, _ = make_inputs(c, torch.float16, "head")
    q = (a["q"].float() * 16).round().clamp(-64, 64) / 16
    scale = c.d ** -0.5
    results = []
    for s in (0, 12, -8):
        results.append(flash_attn_with_kvcache(
            (q * 2.0**s).to(torch.float16), a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"],
            block_table=a["block_table"], softmax_scale=scale * 2.0**-s, num_splits=c.splits,
            return_softmax_lse=True, k_descale=a["k_descale"], v_descale=a["v_descale"]))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@triton.jit
def _quantize_kernel(X, DESCALE, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _to_cache(tl.load(X + offs), tl.load(DESCALE), tl.float8e4nv, True))


@pytest.mark.skipif(not HAS_TRITON, reason="needs the Triton kernels (CUDA or TRITON_INTERPRET=1)")
def test_kernel_rounding_equals_torch():
    # the kernel's quantisation of new keys against torch's: every e4m3 value, every midpoint between two
    # (ties to even), values next to them, subnormals, zeros of both signs, values past ±448
    import flashattn.backends.triton.entry  # noqa: F401 - under the interpreter: its FP8 casts, as the GPU's
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([codes, mids, mids * (1 + 2**-20), mids * (1 - 2**-20),
                   torch.randn(1500, generator=g) * 100, torch.randn(1000, generator=g) * 1e-2,
                   torch.tensor([-0.0, 500.0, -1e4, 2**-10, 2**-11, 1e-30, 3e38, -3e38, 464.0, 463.9])])
    x = torch.cat([x, torch.zeros((1 << (len(x) - 1).bit_length()) - len(x))])
    device = "cuda" if HAS_CUDA else "cpu"
    for descale in (1.0, 0.37, 3.0):
        y = torch.empty(len(x), dtype=FP8, device=device)
        _quantize_kernel[(1,)](x.to(device), torch.tensor([descale], device=device), y, N=len(x))
        want = (x / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        bad = (_bytes(y.cpu()) != _bytes(want)).nonzero().flatten()
        assert len(bad) == 0, [(x[i].item(), y[i].item(), want[i].item()) for i in bad[:5]]


# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 relative, or 2^-10 · descale below
# e4m3's smallest normal; 2^-10 more relative covers the fp16 rounding of the 16-bit cache's new keys and the
# fp32 rounding of the scales (quantize's x · (1 / descale), the kernel's x / descale)
E4M3_REL, E4M3_ABS = 2.0**-4 + 2.0**-10, 2.0**-10


@pytest.mark.parametrize("name", ["decode-head-page16", "append-rotary-causal-sq3", "gqa8-window-splits"])
def test_fp8_cache_against_the_16bit_cache(backend, name, capsys):
    """The fp8 cache's output against the fp16 cache's on the same data (the fp8 cache quantised from it, the
    new keys appended to both).

    The e4m3 bound, per cached value: within E4M3_REL · |x| + E4M3_ABS · descale of the 16-bit value. Over
    attention no useful worst-case bound follows (a score error of M moves a probability by a factor up to
    exp(2M)), so the outputs are held to the exact effect of the rounding instead: the fp64 oracle on the
    dequantised cache against the one on the 16-bit cache, plus each call's own rounding (the tolerance
    rule: 2x plain PyTorch's error, plus 1e-5). Against the oracle on the 16-bit data, the fp8 call is within
    2x the error plain PyTorch makes with the same fp8 cache (dequantised to fp16, attention in fp16): the
    bench harness's check of an fp8-cache provider.
    """
    c, granularity = FP8_CASES[name]
    dtype = torch.float16
    a, info = make_inputs(c, dtype, granularity)
    starts = info["starts"]
    a16 = dict(a, k_descale=None, v_descale=None, k_cache=info["caches16"][0], v_cache=info["caches16"][1])
    out8, _ = call(c, a, dtype)
    out16, _ = call(c, a16, dtype)
    (k16, v16), (k8, v8) = cache_after(a16, info["rows"]), cache_after(a, info["rows"])
    kd, vd = per_batch(a["k_descale"], c.b, c.hk).double(), per_batch(a["v_descale"], c.b, c.hk).double()
    k_real, v_real = dequantized(k8, a["k_descale"], c.hk), dequantized(v8, a["v_descale"], c.hk)
    for real, x16, descale in ((k_real, k16, kd), (v_real, v16, vd)):
        bound = E4M3_REL * x16.double().abs() + E4M3_ABS * descale[:, None, :, None]
        assert ((real - x16.double()).abs() <= bound).all()

    ref16, _, pt16, _ = oracle(c, a, k16.double(), v16.double(), starts, dtype)
    ref8, _, pt8, _ = oracle(c, a, k_real, v_real, starts, dtype)
    effect = max_abs_err(ref8, ref16)
    rounding = 2 * max_abs_err(pt8, ref8) + 2 * max_abs_err(pt16, ref16) + 2e-5
    err = max_abs_err(out8, out16)
    with capsys.disabled():
        errs = [max_abs_err(o, ref16) for o in (out8, out16, pt8)]
        print(f"\n[{name}] max|out(fp8 cache) - out(fp16 cache)| = {err:.3g} (e4m3's exact effect "
              f"{effect:.3g}, rounding allowance {rounding:.3g}); against the fp64 oracle on the 16-bit "
              f"data: fp8 cache {errs[0]:.3g}, fp16 cache {errs[1]:.3g}, plain PyTorch on the fp8 cache "
              f"{errs[2]:.3g}")
    assert err <= effect + rounding
    assert_close_to_ref(out8, ref16, pt8, name="out (fp8 cache, against the 16-bit data)")


# --------------------------------------------------------------------------------------------------------
# bad input: the message names the argument, the value and what was expected (torch backend: the checks are
# shared)


def _base(page=None, fp8=True):
    """Valid arguments: q (2, 1, 4, 16) fp32 against an fp8 cache of 2 kv heads, 64 keys per sequence."""
    b, cap = 2, 64
    shape = (b, cap, 2, 16) if page is None else (b * cap // page, page, 2, 16)
    dtype = FP8 if fp8 else torch.float32
    args = dict(q=torch.randn(b, 1, 4, 16), k_cache=torch.randn(shape).to(dtype),
                v_cache=torch.randn(shape).to(dtype), cache_seqlens=3)
    if page is not None:
        args["block_table"] = torch.arange(shape[0], dtype=torch.int32).view(b, -1)
    if fp8:
        args.update(k_descale=torch.rand(1) + 0.5, v_descale=torch.rand(b, 2) + 0.5)
    return args


def _with(page=None, fp8=True, **changes):
    def make():
        args = _base(page, fp8)
        for key, value in changes.items():
            if value is None:
                args.pop(key)
            else:
                args[key] = value(args) if callable(value) else value
        return args

    return make


BAD = {
    "no-k-descale": (_with(k_descale=None), ValueError,
                     r"k_descale is None but the cache is torch.float8_e4m3fn: an FP8 cache needs k_descale "
                     r"and v_descale, float32 \(1,\) or \(2, 2\)"),
    "no-v-descale-paged": (_with(16, v_descale=None), ValueError, r"v_descale is None but the cache is"),
    "descale-16bit-cache": (_with(fp8=False, k_descale=torch.ones(1)), ValueError,
                            r"k_descale is given but the cache has dtype torch.float32; descales go with an "
                            r"FP8 cache \(torch.float8_e4m3fn\) only"),
    "descale-dtype": (_with(k_descale=torch.ones(1, dtype=torch.float16)), TypeError,
                      r"k_descale must be a float32 tensor of shape \(1,\) or \(2, 2\) = \(batch, "
                      r"nheads_k\), got dtype torch.float16"),
    "descale-not-a-tensor": (_with(v_descale=0.5), TypeError,
                             r"v_descale must be a float32 tensor .* got float"),
    "descale-shape": (_with(k_descale=torch.ones(2)), ValueError,
                      r"k_descale has shape \(2,\); expected \(1,\) \(per tensor\) or \(2, 2\) = \(batch, "
                      r"nheads_k\) \(per sequence and KV head\)"),
    "descale-per-cache-row": (_with(k_cache=torch.randn(3, 64, 2, 16).to(FP8),
                                    v_cache=torch.randn(3, 64, 2, 16).to(FP8), k_descale=torch.ones(3, 2),
                                    cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32)), ValueError,
                              r"k_descale has shape \(3, 2\); expected \(1,\) .* or \(2, 2\) = \(batch, "
                              r"nheads_k\)"),
    "descale-device": (_with(v_descale=torch.ones(1, device="meta")), ValueError,
                       r"v_descale is on meta but q is on cpu"),
    "mixed-cache-dtypes": (_with(v_cache=lambda a: a["v_cache"].float()), TypeError,
                           r"v_cache has dtype torch.float32 but k_cache torch.float8_e4m3fn; an FP8 cache "
                           r"holds both"),
    "e5m2-cache": (_with(k_cache=lambda a: a["k_cache"].float().to(torch.float8_e5m2)), TypeError,
                   r"k_cache has dtype torch.float8_e5m2; an FP8 cache is torch.float8_e4m3fn \(e4m3\)"),
    "16bit-cache-other-dtype": (_with(fp8=False, k_cache=lambda a: a["k_cache"].half()), TypeError,
                                r"k_cache has dtype torch.float16 but q has torch.float32; they must share a "
                                r"dtype \(or the cache be torch.float8_e4m3fn"),
    "new-keys-fp8": (_with(k=torch.randn(2, 1, 2, 16).to(FP8), v=torch.randn(2, 1, 2, 16).to(FP8)), TypeError,
                     r"k has dtype torch.float8_e4m3fn; expected one of"),
    "cache-strided": (_with(k_cache=lambda a: torch.randn(2, 64, 2, 32).to(FP8)[..., ::2]), ValueError,
                      r"k_cache must have a contiguous last dimension"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(monkeypatch, name):
    make, exc, match = BAD[name]
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**make())


def test_bad_plans(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    with pytest.raises(ValueError, match=r"cache_dtype=torch.float8_e5m2; expected None or torch.float32 "
                                         r"\(q's dtype\), or torch.float8_e4m3fn"):
        DecodePlan(2, 4, 2, 16, max_seqlen_k=64, dtype=torch.float32, cache_dtype=torch.float8_e5m2)
    a = _base()
    plan16 = DecodePlan(2, 4, 2, 16, max_seqlen_k=64, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"k_cache has dtype torch.float8_e4m3fn; the plan expects "
                                         r"cache_dtype torch.float32"):
        plan16.run(a["q"], a["k_cache"], a["v_cache"], 3, k_descale=a["k_descale"], v_descale=a["v_descale"])
    plan8 = plan16.replan(cache_dtype=FP8)
    assert "cache_dtype=torch.float8_e4m3fn" in repr(plan8)
    with pytest.raises(ValueError, match=r"v_descale is None but the cache is"):
        plan8.run(a["q"], a["k_cache"], a["v_cache"], 3, k_descale=a["k_descale"])


# --------------------------------------------------------------------------------------------------------
# the prepared launches: a 16-bit and an fp8 call of the same shapes never share one


def test_signatures_keep_16bit_and_fp8_apart(backend):
    from flashattn import kvcache

    c = Case(b=1, h=4, hk=2, cap=48, seqlens=[30], page=16, splits=2)  # small: 11 calls
    dtype = torch.float16

    def fresh(granularity):
        a, info = make_inputs(c, dtype, granularity)
        k16, v16, _ = info["caches16"]
        return a, dict(a, k_descale=None, v_descale=None, k_cache=k16, v_cache=v16)

    # each kind alone, from an empty signature cache: the results to get back when they alternate
    want = {}
    for kind in ("16", "tensor", "head"):
        kvcache._calls.clear()
        a8, a16 = fresh("head" if kind == "16" else kind)
        want[kind] = call(c, a16 if kind == "16" else a8, dtype)[0]
    kvcache._calls.clear()
    for i, kind in enumerate(("16", "tensor", "16", "head", "tensor")):
        a8, a16 = fresh("head" if kind == "16" else kind)
        out, _ = call(c, a16 if kind == "16" else a8, dtype)
        assert torch.equal(out, want[kind]), (i, kind)
        # one launch per signature: 16-bit, per tensor, per head
        assert len(kvcache._calls) == (1, 2, 2, 3, 3)[i]
    # a plan keeps its own launches per signature the same way
    plan = DecodePlan(c.b, c.h, c.hk, c.d, page_size=c.page, max_seqlen_k=c.cap, dtype=dtype, cache_dtype=FP8,
                      device="cpu", num_splits=c.splits)
    for kind in ("tensor", "head", "tensor"):
        a8, _ = fresh(kind)
        out = plan.run(a8["q"], a8["k_cache"], a8["v_cache"], a8["cache_seqlens"], a8["block_table"],
                       k=a8["k"], v=a8["v"], k_descale=a8["k_descale"], v_descale=a8["v_descale"])
        assert torch.equal(out, want[kind])
    assert len(plan._launches) == 2


def test_registered_ops_equal_the_eager_path(backend):
    # what torch.compile traces: kvcache_fwd / kvcache_attn with the descales as tensor arguments
    from flashattn.ops.registry import through_registered_ops

    for c in (Case(page=16, splits=2), Case(s_new=0, page=16, splits=2)):
        a, _ = make_inputs(c, torch.float16, "head")
        eager = call(c, a, torch.float16)
        a, _ = make_inputs(c, torch.float16, "head")
        with through_registered_ops():
            traced = call(c, a, torch.float16)
        for x, y in zip(eager, traced, strict=True):
            assert torch.equal(x, y)


def test_opcheck_fp8(monkeypatch):
    # schema, fake tensors and the mutation declaration with an fp8 cache and descales
    from flashattn.ops.kvcache import kvcache_attn, kvcache_fwd

    monkeypatch.setattr(flashattn_config, "backend", "torch")
    a = _base()
    kn, vn = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([10, 50], dtype=torch.int32)
    args = (a["q"], a["k_cache"], a["v_cache"], kn, vn, None, None, seqlens, 0, None, None, None, None,
            a["k_descale"], a["v_descale"], 0.25, True, -1, 0, 0.0, None, True, 0, False)
    # not test_schema: it compares the inputs before and after by arithmetic torch lacks for e4m3; the schema
    # (mutations included) is dtype-blind and test_kvcache.py's opcheck checks it
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(kvcache_fwd.library_op, args, test_utils=utils)
    args = (a["q"], a["k_cache"], a["v_cache"], seqlens, 0, None, None, None, None, a["k_descale"],
            a["v_descale"], 0.25, False, -1, -1, 0.0, None, 0, False)
    torch.library.opcheck(kvcache_attn.library_op, args, test_utils=utils)


def test_torch_compile_fullgraph(monkeypatch):
    # dynamo traces an fp8-cache call through the registered op without a graph break (torch backend: the op
    # bodies are what the other tests check; here it is the registration)
    import torch._dynamo

    monkeypatch.setattr(flashattn_config, "backend", "torch")
    a = _base(16)
    kn, vn = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([10, 50], dtype=torch.int32)

    def step(q, kc, vc, kn, vn, seqlens, bt, kd, vd):
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=bt, causal=True,
                                      k_descale=kd, v_descale=vd)
        return out * 2

    inputs = (a["q"], a["k_cache"], a["v_cache"], kn, vn, seqlens, a["block_table"], a["k_descale"],
              a["v_descale"])
    kc2, vc2 = a["k_cache"].clone(), a["v_cache"].clone()
    eager = step(*inputs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(a["q"], kc2, vc2, *inputs[3:])
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # the in-place append happened under compile too, quantised alike
    assert torch.equal(_bytes(kc2), _bytes(a["k_cache"])) and torch.equal(_bytes(vc2), _bytes(a["v_cache"]))
