"""FP8 (e4m3) attention through flash_attn_func / flash_attn_varlen_func: inference only, against the float64
oracle on the dequantised inputs.

Tolerance (the rule, for FP8): our error against the oracle at most twice that of plain PyTorch computing
the same call at FP8's precision (flashattn.reference.attention_ref_fp8 with upcast=False: float32 q·k of
the dequantised inputs, the softmax numerators rounded to e4m3 as an FP8 P·V product takes them), plus a
floor of 1e-3 (the output's own rounding: 2^-11 relative in fp16 for |out| <= 1). The numerators carry
e4m3's 2^-4 relative rounding, so that baseline error is ~1e-2 of |out|: these tests catch a wrong
descale, head, mask or layout (errors of order |out|), not the last bit.
"""

import dataclasses

import pytest
import torch
from utils import assert_close_to_ref, is_interpreted

import flashattn
from flashattn import fp8, reference
from flashattn.backends.triton import attention as launchers
from flashattn.backends.triton import routes
from flashattn.errors import FlashAttnError
from flashattn.ops import attention_fp8 as fp8_ops
from flashattn.ops.registry import through_registered_ops

FLOOR = 1e-3


def _binades(b, h, sign):
    """(b, 1, h, 1) factors 2^(sign · (i mod 4)), i = the (batch, head)'s index."""
    return (2.0 ** (sign * (torch.arange(b * h) % 4))).view(b, 1, h, 1)


def _inputs(b, sq, sk, h, hk, d, dv=None, *, seed=0, granularity="head", q_per_kv_head=False,
            seq_contiguous=False):
    g = torch.Generator().manual_seed(seed)
    # each (batch, head) in a binade of its own (quantize's descales are powers of two: equal magnitudes
    # would give every head the same descale, and a descale read for the wrong head would not show); q's
    # scales shrink as k's grow, so the scores stay of order one
    q = torch.randn(b, sq, h, d, generator=g) * _binades(b, h, -1)
    k = torch.randn(b, sk, hk, d, generator=g) * _binades(b, hk, 1)
    v = torch.randn(b, sk, hk, dv or d, generator=g) * _binades(b, hk, 1)
    q8, qd = fp8.quantize(q, granularity)
    if q_per_kv_head:  # FlashAttention-3's shape: one q descale per (batch, kv head)
        q8, qd = fp8.quantize(q.view(b, sq, hk, (h // hk) * d), granularity)
        q8 = q8.view(b, sq, h, d)
    k8, kd = fp8.quantize(k, granularity)
    v8, vd = fp8.quantize(v, granularity, seq_contiguous=seq_contiguous)
    return q8, k8, v8, qd, kd, vd


def _check(out, lse, q8, k8, v8, qd, kd, vd, out_dtype, **options):
    ref, ref_lse = reference.attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=True, **options)
    pt, pt_lse = reference.attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=False, out_dtype=out_dtype,
                                             **options)
    assert out.dtype == out_dtype
    assert_close_to_ref(out, ref, pt, atol_floor=FLOOR)
    # the LSE carries no FP8 rounding (float32 scores): the ordinary floor
    assert_close_to_ref(lse, ref_lse, pt_lse, atol_floor=1e-4, name="lse")


def _out_dtype(backend):
    # the interpreter rounds float32 -> bfloat16 wrongly (tests/utils.py backend_dtypes)
    return torch.float16 if is_interpreted(backend) else torch.bfloat16


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(19, 5)),
    "causal-window": dict(causal=True, window_size=(23, -1)),
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi=True),
    "sink": dict(sink=True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(2, 113, 120, 4, 2, 64), (1, 1, 97, 2, 1, 40), (1, 61, 17, 2, 2, 96)],
                         ids=["gqa-113x120-d64", "mqa-1x97-d40", "61x17-d96"])
def test_fp8_forward_matches_the_oracle(backend, name, shape):
    b, sq, sk, h, hk, d = shape
    opts = dict(CASES[name])
    g = torch.Generator().manual_seed(1)
    alibi = torch.rand(h, generator=g) * 0.3 if opts.pop("alibi", False) else None
    sink = torch.randn(h, generator=g) if opts.pop("sink", False) else None
    q8, k8, v8, qd, kd, vd = _inputs(b, sq, sk, h, hk, d)
    out_dtype = _out_dtype(backend)
    with torch.no_grad():
        out, lse, s = flashattn.flash_attn_func(q8, k8, v8, return_attn_probs=True, q_descale=qd,
                                                k_descale=kd, v_descale=vd, out_dtype=out_dtype,
                                                alibi_slopes=alibi, learnable_sink=sink, **opts)
    assert s.numel() == 0
    _check(out, lse, q8, k8, v8, qd, kd, vd, out_dtype, alibi_slopes=alibi, learnable_sink=sink, **opts)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("q_per_kv_head", [False, True])
@pytest.mark.parametrize("seq_contiguous", [False, True])
def test_descale_granularities_and_v_layouts(backend, granularity, q_per_kv_head, seq_contiguous):
    q8, k8, v8, qd, kd, vd = _inputs(2, 47, 70, 4, 2, 64, dv=32, seed=2, granularity=granularity,
                                     q_per_kv_head=q_per_kv_head, seq_contiguous=seq_contiguous)
    assert (v8.stride(1) == 1) == seq_contiguous
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, causal=True, return_attn_probs=True, q_descale=qd,
                                            k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    _check(out, lse, q8, k8, v8, qd, kd, vd, torch.float32, causal=True)


def test_descales_default_to_one(backend):
    q8, k8, v8, _, _, _ = _inputs(1, 33, 33, 2, 2, 32, seed=3)
    one = torch.ones(1)
    out = flashattn.flash_attn_func(q8, k8, v8, out_dtype=torch.float32)
    ref = flashattn.flash_attn_func(q8, k8, v8, q_descale=one, k_descale=one, v_descale=one,
                                    out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_fp8_varlen_with_per_sequence_descales(backend):
    lens_q, lens_k = [17, 0, 1, 40], [23, 5, 1, 40]
    h, hk, d = 4, 2, 64
    g = torch.Generator().manual_seed(4)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    seqs = []
    for lq, lk in zip(lens_q, lens_k, strict=True):
        q, k, v = (torch.randn(1, n, heads, d, generator=g) for n, heads in ((lq, h), (lk, hk), (lk, hk)))
        seqs.append([fp8.quantize(x, "head") for x in (q, k, v)])
    q8, k8, v8 = (torch.cat([s[i][0][0] for s in seqs]) for i in range(3))
    qd, kd, vd = (torch.cat([s[i][1] for s in seqs]) for i in range(3))  # (batch, heads)
    out, lse, _ = flashattn.flash_attn_varlen_func(
        q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_attn_probs=True,
        q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    for i, s in enumerate(seqs):
        (sq8, sqd), (sk8, skd), (sv8, svd) = s
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        _check(out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0), sq8, sk8, sv8, sqd, skd, svd,
               torch.float32, causal=True)


@pytest.mark.parametrize("kw, gluon", [
    # where the fp8 suite measured the Gluon FP8 variant ahead: from 2K tokens, under a mask from 2K at
    # d >= 128 and from 8K at d = 64
    (dict(), True), (dict(window=(-1, 0)), True), (dict(seqlen_q=1, seqlen_k=2048), True),
    (dict(headdim=256, headdim_v=256, window=(-1, 0)), True), (dict(headdim=64, headdim_v=64), True),
    (dict(headdim=64, headdim_v=64, window=(-1, 0), seqlen_q=8192, seqlen_k=8192), True),
    (dict(seqlen_q=1024, seqlen_k=1024), False), (dict(headdim=64, headdim_v=64, window=(-1, 0)), False),
    (dict(headdim=64, headdim_v=64, window=(100, 100)), False),
    # what its launch does not take: varlen (refused), a float32 output, no TMA, another head dim
    (dict(varlen=True), False), (dict(out_dtype="float32"), False), (dict(out_dtype=""), False),
    (dict(aligned=False), False), (dict(cuda=False), False), (dict(capability=(8, 0)), False),
    (dict(headdim=96, headdim_v=96), False), (dict(seqlen_k=0), False),
], ids=str)
def test_fp8_routes(kw, gluon):
    base = routes.Spec(2, 16, 16, 4096, 4096, 128, 128, dtype="float8_e4m3fn", out_dtype="bfloat16")
    spec = dataclasses.replace(base, **kw)
    assert spec.element_size == 1 and not spec.gluon_features and not spec.tma_ready
    route = routes.forward_route(spec)
    assert isinstance(route, routes.GluonForward if gluon else routes.TritonForward)
    if gluon:  # never the half-diagonal step: its V tiles are K-major
        assert not route.half_diag


def test_fp8_spec_carries_the_output_dtype():
    q8, k8, v8, *_ = _inputs(1, 20, 36, 2, 1, 32, seed=5)
    assert launchers.spec_of(q8, k8, v8).out_dtype == "bfloat16"
    assert launchers.spec_of(q8, k8, v8, out_dtype=torch.float32).out_dtype == "float32"
    assert launchers.spec_of(*(t.half() for t in (q8, k8, v8))).out_dtype == ""


def test_registered_op_matches_eager_and_passes_opcheck(backend):
    q8, k8, v8, qd, kd, vd = _inputs(1, 20, 36, 2, 1, 32, seed=5)
    eager = flashattn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    with through_registered_ops():
        registered = flashattn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                               v_descale=vd)
    torch.testing.assert_close(eager, registered, rtol=0, atol=0)
    args = (q8, k8, v8, qd, kd, vd, None, None, 20, 36, 0.125, True, -1, 0, 0.0, None, None, torch.bfloat16)
    # (opcheck's test_schema multiplies the inputs, which torch cannot do in e4m3 on the CPU)
    torch.library.opcheck(fp8_ops.attn_fwd_fp8.library_op, args, test_utils="test_faketensor")


def test_empty_inputs():
    q8, k8, v8, qd, kd, vd = _inputs(1, 0, 9, 2, 2, 32)
    out = flashattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.shape == (1, 0, 2, 32)
    q8, k8, v8, qd, kd, vd = _inputs(1, 5, 0, 2, 2, 32)
    out, lse, _ = flashattn.flash_attn_func(q8, k8, v8, return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and (out == 0).all() and torch.isinf(lse).all()


def _bad(**changes):
    q8, k8, v8, qd, kd, vd = _inputs(2, 8, 8, 4, 2, 16)
    args = dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)
    args.update(changes)
    return lambda: flashattn.flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("call, message", [
    (_bad(k=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)), r"float8_e4m3fn q, k and v.*torch.bfloat16"),
    (_bad(q=torch.zeros(2, 8, 4, 16, dtype=torch.bfloat16), k=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16),
          v=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)), r"an FP8 call .* takes torch.float8_e4m3fn"),
    (_bad(dropout_p=0.1), "dropout_p is 0.1; FP8 attention is inference only"),
    (_bad(k_descale=torch.ones(2, 4)), r"k_descale has shape \(2, 4\); expected \(1,\) or \(2, 2\)"),
    (_bad(q_descale=torch.ones(3, 4)),
     r"q_descale has shape \(3, 4\); expected \(1,\) or \(2, 2\) or \(2, 4\)"),
    (_bad(v_descale=torch.ones(1, dtype=torch.float64)), "v_descale must be a float32 tensor"),
    (_bad(v_descale=2.0), "v_descale must be a float32 tensor .* got float"),
    (_bad(out_dtype=torch.float8_e4m3fn), "out_dtype is torch.float8_e4m3fn; expected one of"),
    # neither the last nor the seqlen dim contiguous
    (_bad(v=torch.zeros(2, 2, 8, 32).to(torch.float8_e4m3fn)[..., ::2].permute(0, 2, 1, 3)),
     "v must have a contiguous last dimension"),
])
def test_bad_fp8_arguments(call, message):
    with pytest.raises(FlashAttnError, match=message):
        call()


def test_fp8_needs_no_gradient():
    q8, k8, v8, qd, kd, vd = _inputs(1, 8, 8, 2, 2, 16)
    q8.requires_grad_(True)
    with pytest.raises(FlashAttnError, match="FP8 attention has no backward"):
        flashattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    with torch.no_grad():
        out = flashattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.shape == (1, 8, 2, 16)


def test_sixteen_bit_calls_refuse_another_out_dtype():
    q = torch.zeros(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(FlashAttnError, match="a 16-bit call returns q's dtype"):
        flashattn.flash_attn_func(q, q, q, out_dtype=torch.float32)


def test_fp8_varlen_reads_paged_keys(backend):
    # e4m3 page pools (pages of 16, shuffled): the same bits as the packed keys of those pages
    lens_q, lens_k, page, hk, d = [5, 0, 17], [40, 3, 17], 16, 2, 32
    g = torch.Generator().manual_seed(7)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
                  for ls in (lens_q, lens_k))
    table = torch.randperm(9, generator=g).to(torch.int32).view(3, 3)  # 3 pages of 16 per sequence
    pools = [fp8.quantize(torch.randn(1, 9 * page, hk, d, generator=g), "tensor") for _ in range(2)]
    (k_pool, kd), (v_pool, vd) = ((x.view(9, page, hk, d), ds) for x, ds in pools)
    q8, qd = fp8.quantize(torch.randn(1, sum(lens_q), 4, d, generator=g), "tensor")
    packed = [torch.cat([pool[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens_k)])
              for pool in (k_pool, v_pool)]
    args = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    paged_out = flashattn.flash_attn_varlen_func(q8[0], k_pool, v_pool, cu_q, cu_k, 17, 40,
                                                 block_table=table, **args)
    packed_out = flashattn.flash_attn_varlen_func(q8[0], *packed, cu_q, cu_k, 17, 40, **args)
    torch.testing.assert_close(paged_out, packed_out, rtol=0, atol=0)
    with pytest.raises(FlashAttnError, match=r"takes torch.float8_e4m3fn q, k and v .* torch.bfloat16"):
        flashattn.flash_attn_varlen_func(q8[0], k_pool.to(torch.bfloat16), v_pool, cu_q, cu_k, 17, 40,
                                         block_table=table, **args)
