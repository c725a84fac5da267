"""The FP8 forward on the GPU (bf16 out, real sizes): every option against the float64 oracle on the
dequantised inputs with the FP8 tolerance of tests/test_interface_fp8.py, both V layouts, the route asserted.
"""

import dataclasses

import pytest
import torch
from utils import assert_close_to_ref

import flashattn
from flashattn import fp8, reference
from flashattn.backends.triton import attention as launchers
from flashattn.backends.triton import gluon, routes
from flashattn.errors import FlashAttnError

pytestmark = pytest.mark.gpu

FLOOR = 1e-3  # as the CPU tests: bf16's own rounding of |out| <~ 0.1 is below it


def _quantized(shape, granularity="head", seed=0, sign=1, **kw):
    """quantize of N(0, 1) values with each (batch, head) scaled by 2^(sign · (i mod 4)): every head in a
    binade of its own, so that a descale read for the wrong head shows (the descales are powers of two)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, _, h, _ = shape
    scales = (2.0 ** (sign * (torch.arange(b * h, device="cuda") % 4))).view(b, 1, h, 1)
    return fp8.quantize(torch.randn(shape, device="cuda", generator=g) * scales, granularity, **kw)


def _check(out, lse, q8, k8, v8, qd, kd, vd, **options):
    ref, ref_lse = reference.attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=True, **options)
    pt, pt_lse = reference.attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=False, **options)
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref, pt, atol_floor=FLOOR)
    assert_close_to_ref(lse, ref_lse, pt_lse, atol_floor=1e-4, name="lse")


OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(255, 64)),
    "softcap": dict(causal=True, softcap=30.0),
    "alibi-sink": dict(causal=True, alibi=True, sink=True),
}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seq_contiguous", [True, False], ids=["v-seq-major", "v-row-major"])
def test_fp8_forward(name, d, seq_contiguous):
    b, sq, sk, h, hk = 2, 1000, 1037, 8, 2
    opts = dict(OPTIONS[name])
    alibi = torch.rand(h, device="cuda") * 0.1 if opts.pop("alibi", False) else None
    sink = torch.randn(h, device="cuda") if opts.pop("sink", False) else None
    (q8, qd), (k8, kd) = _quantized((b, sq, h, d), seed=1, sign=-1), _quantized((b, sk, hk, d), seed=2)
    v8, vd = _quantized((b, sk, hk, d), seed=3, seq_contiguous=seq_contiguous)
    spec = launchers.spec_of(q8, k8, v8, causal=opts.get("causal", False))
    assert isinstance(routes.forward_route(spec), routes.TritonForward)
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, return_attn_probs=True, q_descale=qd, k_descale=kd,
                                            v_descale=vd, alibi_slopes=alibi, learnable_sink=sink, **opts)
    _check(out, lse, q8, k8, v8, qd, kd, vd, alibi_slopes=alibi, learnable_sink=sink, **opts)


@pytest.mark.parametrize("d, dv", [(16, 16), (16, 32), (32, 16), (40, 40)])
def test_fp8_forward_small_head_dims(d, dv):
    # an 8-bit q·kᵀ needs 32 reduction columns on the GPU: d below 32 is padded to 32, not 16
    b, sq, sk, h, hk = 2, 17, 113, 4, 2
    (q8, qd), (k8, kd) = _quantized((b, sq, h, d), seed=1, sign=-1), _quantized((b, sk, hk, d), seed=2)
    v8, vd = _quantized((b, sk, hk, dv), seed=3)
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, return_attn_probs=True, q_descale=qd, k_descale=kd,
                                            v_descale=vd, causal=True)
    _check(out, lse, q8, k8, v8, qd, kd, vd, causal=True)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_fp8_gqa_per_kv_head_q_descale(granularity):
    b, s, h, hk, d = 2, 777, 16, 4, 128
    x = torch.randn(b, s, h, d, device="cuda")
    q8, qd = fp8.quantize(x.view(b, s, hk, (h // hk) * d), granularity)
    q8 = q8.view(b, s, h, d)
    (k8, kd), (v8, vd) = _quantized((b, s, hk, d), granularity, 4), _quantized((b, s, hk, d), granularity, 5)
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, causal=True, return_attn_probs=True, q_descale=qd,
                                            k_descale=kd, v_descale=vd)
    _check(out, lse, q8, k8, v8, qd, kd, vd, causal=True)


def test_fp8_varlen():
    lens = [0, 300, 1, 1000, 64]
    h, hk, d = 8, 2, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    (q8, qd), (k8, kd), (v8, vd) = (_quantized((1, sum(lens), n, d), "tensor", i)
                                    for i, n in enumerate((h, hk, hk)))
    out, lse, _ = flashattn.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, max(lens), max(lens),
                                                   causal=True, return_attn_probs=True, q_descale=qd,
                                                   k_descale=kd, v_descale=vd)
    for i, n in enumerate(lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if n:
            _check(out[rows][None], lse[:, rows][None], q8[:, rows], k8[:, rows], v8[:, rows], qd, kd, vd,
                   causal=True)


def test_incoherent_processing_cuts_the_error_on_outliers():
    # q and k with 0.1% of entries 10x larger (the FP8 papers' outlier inputs): the rotation spreads them,
    # and the error against the float64 oracle on the original inputs drops (the target: >= 2x)
    g = torch.Generator(device="cuda").manual_seed(6)
    b, s, h, d = 1, 2048, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for _ in range(3))
    for t in (q, k):
        t.copy_(torch.where(torch.rand(t.shape, device="cuda", generator=g) < 1e-3, t * 10, t))
    ref, _ = reference.attention_ref(q.double(), k.double(), v.double())

    def rmse(qq, kk):
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, "tensor") for t in (qq, kk, v))
        out = flashattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        return (out.double() - ref).pow(2).mean().sqrt().item()

    plain = rmse(q, k)
    rotated = rmse(*fp8.rotate_qk(q, k, seed=0))
    assert rotated < plain, (plain, rotated)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_kernels_match_the_torch_backend(granularity, dtype):
    from flashattn import config
    x = torch.randn(2, 4097, 8, 128, device="cuda").to(dtype)
    x8, d = fp8.quantize(x, granularity, seq_contiguous=True)
    with config.use_backend("torch"):
        y8, e = fp8.quantize(x, granularity, seq_contiguous=True)
    assert x8.stride(1) == 1 and torch.equal(x8.view(torch.uint8), y8.view(torch.uint8)) and torch.equal(d, e)
    # with the rotation: the same up to the float32 sums' order, i.e. within one e4m3 step of the exact value
    r8, rd = fp8.quantize(x, granularity, rotate_seed=1)
    exact = x.double() @ fp8.rotation(128, 1).to("cuda").double()
    rd4 = rd.reshape(1, 1, 1, 1) if granularity == "tensor" else rd[:, None, :, None]
    # (the ±1 matrix is exact in every dtype, so only the float32 sums differ from the exact rotation)
    bound = 2.0 ** -4 * exact.abs() * (1 + 2.0 ** -16) + 2.0 ** -10 * rd4
    assert ((fp8.dequantize(r8, rd).double() - exact).abs() <= bound).all()


def _launcher_options(name: str, h: int) -> dict:
    """OPTIONS[name] as the launchers take them: causal given, ALiBi slopes and sink logits for h heads."""
    opts = dict(OPTIONS[name])
    opts.setdefault("causal", False)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(h, device="cuda") * 0.1
    if opts.pop("sink", False):
        opts["learnable_sink"] = torch.randn(h, device="cuda")
    return opts


def _gluon_fp8(q8, k8, v8, qd, kd, vd, fields=None, **options):
    """The Gluon forward's FP8 variant, on its explicit route at any length (the default routes take it
    from 2K tokens, routes.takes_gluon_fp8_forward); fields: some of the route's replaced."""
    spec = launchers.spec_of(q8, k8, v8, **{k: v for k, v in options.items() if k != "cu_seqlens_k"})
    route = dataclasses.replace(routes.gluon_forward_route(spec), **(fields or {}))
    assert isinstance(route, routes.GluonForward)
    return launchers.attention_forward_fp8(q8, k8, v8, qd, kd, vd, out_dtype=torch.bfloat16, route=route,
                                           softmax_scale=q8.shape[-1] ** -0.5, **options)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seq_contiguous", [True, False], ids=["v-seq-major", "v-row-major"])
def test_gluon_fp8_forward(name, d, seq_contiguous):
    # seqlen_k 1037: not a multiple of 16, so V goes through kmajor_v's padded copy; 1024 keys read in place
    b, sq, h, hk = 2, 1000, 8, 2
    sk = 1024 if seq_contiguous else 1037
    opts = _launcher_options(name, h)
    (q8, qd), (k8, kd) = _quantized((b, sq, h, d), seed=1, sign=-1), _quantized((b, sk, hk, d), seed=2)
    v8, vd = _quantized((b, sk, hk, d), seed=3, seq_contiguous=seq_contiguous)
    out, lse = _gluon_fp8(q8, k8, v8, qd, kd, vd, **opts)
    _check(out, lse, q8, k8, v8, qd, kd, vd, **opts)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq, sk", [(1000, 1024), (1, 1024), (64, 100), (1000, 63)])
def test_gluon_fp8_qk_ahead(name, d, sq, sk):
    # each next key tile's QK^T issued before this one's softmax (the route's qk_ahead, 128-row tiles of 64
    # keys): one key step, two, and many, with every score option
    from flashattn import config
    b, h, hk = 2, 8, 2
    opts = _launcher_options(name, h)
    (q8, qd), (k8, kd) = _quantized((b, sq, h, d), seed=1, sign=-1), _quantized((b, sk, hk, d), seed=2)
    v8, vd = _quantized((b, sk, hk, d), seed=3)
    with config.use_tiles("fwd_ws=128,64,4,2"):
        out, lse = _gluon_fp8(q8, k8, v8, qd, kd, vd, fields=dict(qk_ahead=True), **opts)
    _check(out, lse, q8, k8, v8, qd, kd, vd, **opts)


def test_gluon_fp8_three_consumer_warpgroups():
    from flashattn import config
    (q8, qd), (k8, kd), (v8, vd) = (_quantized((2, 777, 4, 64), seed=i, sign=-1 if i == 0 else 1)
                                    for i in range(3))
    with config.use_tiles("fwd_ws=192,128,4,3"):
        out, lse = _gluon_fp8(q8, k8, v8, qd, kd, vd, causal=True)
    _check(out, lse, q8, k8, v8, qd, kd, vd, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq_contiguous", [True, False], ids=["v-seq-major", "v-row-major"])
def test_fp8_default_route_takes_the_gluon_variant_from_2k(monkeypatch, causal, seq_contiguous):
    # the public call at 2100 tokens, d = 128: the default route is the Gluon FP8 variant (asserted by a spy
    # on its launcher), V of either layout, against the oracle
    calls = []
    real = gluon.forward
    monkeypatch.setattr(gluon, "forward", lambda *a, **k: (calls.append(a[2].shape), real(*a, **k))[1])
    b, s, h, hk, d = 1, 2100, 4, 2, 128
    (q8, qd), (k8, kd) = _quantized((b, s, h, d), seed=1, sign=-1), _quantized((b, s, hk, d), seed=2)
    v8, vd = _quantized((b, s, hk, d), seed=3, seq_contiguous=seq_contiguous)
    assert isinstance(routes.forward_route(launchers.spec_of(q8, k8, v8, causal=causal)), routes.GluonForward)
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, causal=causal, return_attn_probs=True, q_descale=qd,
                                            k_descale=kd, v_descale=vd)
    assert calls, "the Gluon FP8 forward did not run"
    _check(out, lse, q8, k8, v8, qd, kd, vd, causal=causal)


def test_gluon_fp8_refuses_varlen():
    # its varlen launch stopped on an illegal instruction on the H200 (likely cause: a sequence's first key is
    # the start of its K-major V tiles' innermost dim, which TMA needs 16-byte aligned, as the varlen
    # backward's stats copy showed): refused with a clear error until fixed
    cu = torch.tensor([0, 300, 1365], dtype=torch.int32, device="cuda")
    (q8, qd), (k8, kd), (v8, vd) = (_quantized((1, 1365, n, 128), "tensor", i)
                                    for i, n in enumerate((8, 2, 2)))
    with pytest.raises(FlashAttnError, match="the Gluon FP8 forward takes the padded layout only"):
        _gluon_fp8(q8[0], k8[0], v8[0], qd, kd, vd, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   max_seqlen_q=1065, max_seqlen_k=1065)


def test_fp8_varlen_paged_prefill():
    # e4m3 page pools gathered on the GPU (torch's indexing and where on e4m3): the packed call's bits
    lens, page, hk, d = [300, 1, 1000], 64, 2, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    table = torch.randperm(48, device="cuda").to(torch.int32).view(3, 16)
    (k_pool, kd), (v_pool, vd) = (_quantized((1, 48 * page, hk, d), "tensor", i) for i in (1, 2))
    k_pool, v_pool = (x.view(48, page, hk, d) for x in (k_pool, v_pool))
    q8, qd = _quantized((1, sum(lens), 8, d), "tensor", 3)
    packed = [torch.cat([pool[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)])
              for pool in (k_pool, v_pool)]
    args = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    paged_out = flashattn.flash_attn_varlen_func(q8[0], k_pool, v_pool, cu, cu, 1000, 1000, block_table=table,
                                                 **args)
    packed_out = flashattn.flash_attn_varlen_func(q8[0], *packed, cu, cu, 1000, 1000, **args)
    torch.testing.assert_close(paged_out, packed_out, rtol=0, atol=0)
