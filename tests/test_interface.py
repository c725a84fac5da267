"""Public API (flash_attn 2.x drop-in) against the fp64 oracle, on every backend available here.

Tolerance rule (tests/utils.py): max |ours - oracle| <= 2x (outputs, LSE) / 3x (gradients) the error of plain
PyTorch in the same low precision, plus a tiny floor.  Runs on the ``torch`` backend always and on ``triton``
on CUDA or under ``TRITON_INTERPRET=1`` (big cases are skipped there, see ``conftest.skip_if_too_slow``).
"""

from __future__ import annotations

import math

import pytest
import torch
from utils import (
    DEVICE,
    HAS_CUDA,
    assert_close_to_ref,
    is_interpreted,
    keep_mask,
    make_qkv,
    skip_if_too_slow,
)

from flashattn import config as flashattn_config
from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashattn.reference import attention_ref

# ------------------------------------------------------------------------------------------------ helpers


def run_flash(fn, inputs, dout=None, **kwargs):
    """Forward (with LSE) and, if ``dout`` is given, backward w.r.t. ``inputs``; returns (out, lse, grads)."""
    out, lse, _ = fn(*inputs, return_attn_probs=True, **kwargs)
    grads = None if dout is None else torch.autograd.grad(out, inputs, dout)
    return out, lse, grads


def rounding_floor(ref, dtype):
    """Twice the rounding error of ``dtype`` at the magnitude of ``ref`` (flash_attn's hopper tests' atol)."""
    r = ref.detach().to(dtype)
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item()


def check_against_oracle(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    grads=True,
    wrt=None,
    only_finite=(),
    grad_floor=None,
    attn=None,
    **options,
):
    """``flash_attn_func(q, k, v)`` forward, LSE and (optionally) gradients vs the fp64 oracle.

    ``wrt``: the tensors to differentiate with respect to (default ``(q, k, v)``; pass a packed base tensor to
    check the gradient that reaches it through strided views).  Gradients named in ``only_finite`` are only
    checked for finiteness (see test_extreme_logits).  ``grad_floor="rounding"`` uses :func:`rounding_floor`
    as the gradients' absolute floor (see test_head_dims).  ``attn(q, k, v) -> (out, lse)`` replaces the call
    to flash_attn_func (e.g. a torch.compile'd wrapper).  ``options`` (window_size, softcap, alibi_slopes,
    dropout_p) go to both flash_attn_func and the oracle; with dropout the oracle replays the keep-mask that
    flash_attn_func returns in S_dmask (its sign bits).  Returns ``(out, lse, grads)`` of ours.
    """
    wrt = (q, k, v) if wrt is None else tuple(wrt)
    b, sq, h, d = q.shape
    s_dmask = None
    if attn is None:
        out, lse, s_dmask = flash_attn_func(
            q, k, v, causal=causal, softmax_scale=softmax_scale, return_attn_probs=True, **options
        )
    else:
        out, lse = attn(q, k, v)
    if options.get("dropout_p", 0.0) > 0:
        rounded = (b, h, -(-sq // 128) * 128, -(-k.shape[1] // 128) * 128)
        assert isinstance(s_dmask, torch.Tensor) and s_dmask.shape == rounded and s_dmask.dtype == q.dtype
        options = {**options, "dropout_mask": keep_mask(s_dmask, sq, k.shape[1])}
    assert out.shape == (b, sq, h, v.shape[-1]) and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device

    out_ref, lse_ref = attention_ref(
        q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=True, **options
    )
    out_pt, lse_pt = attention_ref(
        q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=False, **options
    )
    assert_close_to_ref(out, out_ref, out_pt, factor=2.0, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, factor=2.0, name="lse")
    if not grads:
        return out, lse, None

    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, wrt, dout)
    g_ref = torch.autograd.grad(out_ref, wrt, dout.to(out_ref.dtype))
    g_pt = torch.autograd.grad(out_pt, wrt, dout)
    names = ["dq", "dk", "dv"] if len(wrt) == 3 else [f"d{i}" for i in range(len(wrt))]
    for name, x, gx, gr, gp in zip(names, wrt, g, g_ref, g_pt, strict=True):
        assert gx.shape == x.shape, f"{name}: shape {tuple(gx.shape)} != input shape {tuple(x.shape)}"
        assert gx.dtype == x.dtype, f"{name}: dtype {gx.dtype} != input dtype {x.dtype}"
        if name in only_finite:
            assert torch.isfinite(gx).all(), f"{name} not finite"
            continue
        floor = {} if grad_floor is None else {"atol_floor": rounding_floor(gr, gx.dtype)}
        assert_close_to_ref(gx, gr, gp, factor=3.0, name=name, **floor)
    return out, lse, g


def _qkv(b, sq, sk, h, hk, d, dtype, scale=1.0):
    return make_qkv(b, sq, sk, h, hk, d, dtype=dtype, device=DEVICE, scale=scale, requires_grad=True)


# ------------------------------------------------------------------------------------ forward + backward

# (b, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SEQLEN_SHAPES = [
    (2, 1, 1, 2, 2, 64),
    (2, 17, 17, 2, 2, 64),
    (2, 113, 113, 2, 2, 64),
    (2, 17, 113, 2, 2, 64),  # sq < sk
    (2, 113, 17, 2, 2, 64),  # sq > sk: causal rows 0..95 see no key
    (2, 1, 113, 2, 2, 64),  # decode-like
    (2, 113, 1, 2, 2, 64),
    (1, 1023, 1023, 1, 1, 16),  # long, kept cheap
]


def _shape_id(s):
    return "b{}-sq{}-sk{}-h{}-hk{}-d{}".format(*s)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SEQLEN_SHAPES, ids=_shape_id)
def test_seqlens(backend, dtype, shape, causal):
    skip_if_too_slow(backend, shape[0], shape[3], shape[1], shape[2], shape[5])
    check_against_oracle(*_qkv(*shape, dtype), causal=causal)


GQA_SHAPES = [
    (2, 37, 53, 6, 2, 32),  # GQA, sq < sk
    (2, 53, 37, 6, 3, 32),  # GQA, sq > sk
    (2, 64, 64, 4, 1, 64),  # MQA
    (1, 29, 71, 8, 1, 40),  # MQA, odd d
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GQA_SHAPES, ids=_shape_id)
def test_gqa_mqa(backend, dtype, shape, causal):
    skip_if_too_slow(backend, shape[0], shape[3], shape[1], shape[2], shape[5])
    q, k, v = _qkv(*shape, dtype)
    _, _, (dq, dk, dv) = check_against_oracle(q, k, v, causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape  # summed over each group, not per query head


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [1, 40, 59, 64, 96, 128, 192, 256])
def test_head_dims(backend, dtype, d, causal):
    # d == 1: plain PyTorch's gradient is then little more than one final rounding, while FlashAttention's
    # D = rowsum(dO * O) uses the output rounded to the input dtype, which adds an error of about one unit
    # in the last place; across seeds the ratio reaches 4x for dq/dk.  There the floor is the dtype's
    # rounding error at the gradient's magnitude (as flash_attn's own hopper tests do), not a fixed 1e-5.
    floor = "rounding" if d == 1 and dtype != torch.float32 else None
    check_against_oracle(*_qkv(1, 33, 47, 2, 2, d, dtype), causal=causal, grad_floor=floor)


@pytest.mark.parametrize("softmax_scale", [0.5, 2.0])
def test_explicit_softmax_scale(backend, dtype, softmax_scale):
    check_against_oracle(*_qkv(2, 17, 29, 2, 2, 32, dtype), causal=True, softmax_scale=softmax_scale)


@pytest.mark.dtypes(torch.float16, torch.float32)
def test_default_softmax_scale_is_inv_sqrt_d(backend, dtype):
    d = 16  # 1/sqrt(d) = 0.25, far from 1 and from any other plausible default
    q, k, v = _qkv(1, 19, 23, 2, 2, d, dtype)
    out = flash_attn_func(q, k, v)
    out_ref, _ = attention_ref(q, k, v, softmax_scale=1.0 / math.sqrt(d), upcast=True)
    out_pt, _ = attention_ref(q, k, v, softmax_scale=1.0 / math.sqrt(d), upcast=False)
    assert_close_to_ref(out, out_ref, out_pt, factor=2.0, name="out(default scale)")


# ------------------------------------------------------------------------------- rows that see no key


@pytest.mark.parametrize("sq, sk", [(5, 2), (113, 17), (130, 3)])
def test_fully_masked_rows(backend, dtype, sq, sk):
    """causal with sq > sk: query rows i < sq - sk see no key -> out 0, lse +inf, dq 0, and never NaN."""
    q, k, v = _qkv(2, sq, sk, 2, 2, 32, dtype)
    # With 2-3 keys, each key's dk sums over 1-3 query rows: plain PyTorch's dk is then about one rounding
    # and FlashAttention's D = rowsum(dO * O) (O rounded to the input dtype) adds ~1 ulp more; across seeds
    # that ratio reaches 5x.  Those two cases use the rounding floor for gradients (see test_head_dims).
    floor = "rounding" if sk <= 3 and dtype != torch.float32 else None
    out, lse, (dq, dk, dv) = check_against_oracle(q, k, v, causal=True, grad_floor=floor)
    n = sq - sk
    for name, t in [("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)]:
        assert not torch.isnan(t).any(), f"{name} has NaN"
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (out[:, :n] == 0).all(), "out of fully masked rows must be exactly 0"
    assert torch.isposinf(lse[:, :, :n]).all(), "lse of fully masked rows must be +inf"
    assert torch.isfinite(lse[:, :, n:]).all(), "rows that see a key have finite lse"
    assert (dq[:, :n] == 0).all(), "dq of fully masked rows must be exactly 0"


# --------------------------------------------------------------------------------------- strided inputs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["qkvpacked_views", "kvpacked_views", "transposed", "padded_headdim"])
def test_strided_inputs(backend, dtype, layout, causal):
    """Inputs with only a contiguous last dim; gradients must reach the underlying buffer."""
    b, sq, sk, h, hk, d = 2, 45, 45, 4, 4, 40
    if is_interpreted(backend):
        b, h, hk = 1, 2, 2

    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_(True)

    if layout == "qkvpacked_views":
        base = leaf(b, sq, 3, h, d)
        q, k, v = base.unbind(2)
        wrt = (base,)
    elif layout == "kvpacked_views":  # q a slice of a wider buffer, k/v slices of a packed kv (GQA)
        hk, sk = h // 2, 61
        qb, kvb = leaf(b, sq, h + 1, d), leaf(b, sk, 2, hk, d)
        q, (k, v) = qb[:, :, 1:], kvb.unbind(2)
        wrt = (qb, kvb)
    elif layout == "transposed":  # allocated (b, h, s, d), viewed as (b, s, h, d)
        qb, kb, vb = leaf(b, h, sq, d), leaf(b, hk, sk, d), leaf(b, hk, sk, d)
        q, k, v = (x.transpose(1, 2) for x in (qb, kb, vb))
        wrt = (qb, kb, vb)
    else:  # row stride larger than headdim
        qb, kb, vb = leaf(b, sq, h, d + 24), leaf(b, sk, hk, d + 8), leaf(b, sk, hk, d + 8)
        q, k, v = qb[..., :d], kb[..., :d], vb[..., 8:]
        wrt = (qb, kb, vb)
    for x in (q, k, v):
        assert x.stride(-1) == 1 and not x.is_contiguous()
    check_against_oracle(q, k, v, causal=causal, wrt=wrt)


# ------------------------------------------------------------------------------------------ packed forms


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_equals_unpacked(backend, dtype, causal):
    b, h = (1, 2) if is_interpreted(backend) else (2, 4)
    qkv = torch.randn(b, 37, 3, h, 32, device=DEVICE).to(dtype).requires_grad_(True)
    dout = torch.randn(b, 37, h, 32, device=DEVICE).to(dtype)
    out_p, lse_p, (dqkv_p,) = run_flash(flash_attn_qkvpacked_func, (qkv,), dout, causal=causal)

    def unpacked(qkv):
        return flash_attn_func(*qkv.unbind(2), causal=causal, return_attn_probs=True)

    out_u, lse_u, _ = unpacked(qkv)
    (dqkv_u,) = torch.autograd.grad(out_u, (qkv,), dout)
    assert torch.equal(out_p, out_u) and torch.equal(lse_p, lse_u) and torch.equal(dqkv_p, dqkv_u)
    # and it is right, not just consistent
    check_against_oracle(*qkv.unbind(2), causal=causal, wrt=(qkv,))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvpacked_equals_unpacked(backend, dtype, causal):
    b = 1 if is_interpreted(backend) else 2
    q = torch.randn(b, 29, 6, 48, device=DEVICE).to(dtype).requires_grad_(True)
    kv = torch.randn(b, 41, 2, 2, 48, device=DEVICE).to(dtype).requires_grad_(True)  # GQA 6 -> 2
    dout = torch.randn(b, 29, 6, 48, device=DEVICE).to(dtype)
    out_p, lse_p, (dq_p, dkv_p) = run_flash(flash_attn_kvpacked_func, (q, kv), dout, causal=causal)
    out_u, lse_u, _ = flash_attn_func(q, *kv.unbind(2), causal=causal, return_attn_probs=True)
    dq_u, dkv_u = torch.autograd.grad(out_u, (q, kv), dout)
    assert torch.equal(out_p, out_u) and torch.equal(lse_p, lse_u)
    assert torch.equal(dq_p, dq_u) and torch.equal(dkv_p, dkv_u)
    assert dkv_p.shape == kv.shape and dkv_p.dtype == kv.dtype
    check_against_oracle(q, *kv.unbind(2), causal=causal, wrt=(q, kv))


# ------------------------------------------------------------------------------------------ large logits


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_extreme_logits(backend, dtype, causal):
    """softmax_scale=30 on inputs x100: logits ~1e6 must not overflow the online softmax."""
    q, k, v = _qkv(2, 67, 67, 2, 2, 32, dtype, scale=100.0)
    if dtype == torch.float16:
        # Plain fp16 PyTorch overflows here (q @ k^T > 65504), so there is no fp16 baseline to compare with:
        # require finite results whose LSE matches the fp64 oracle to fp32 precision of ~1e6-sized numbers.
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, softmax_scale=30.0, return_attn_probs=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        _, lse_ref = attention_ref(q, k, v, causal=causal, softmax_scale=30.0, upcast=True)
        rel = ((lse.double() - lse_ref).abs() / lse_ref.abs().clamp_min(1.0)).max().item()
        assert rel < 1e-5, f"lse relative error {rel:.3g}"
        return
    # The softmax is one-hot here (score gaps ~1e5), so the true dq and dk are exactly 0, and so are plain
    # PyTorch's whenever its own rounding keeps the softmax one-hot (its backward subtracts sum(p * dP) = dP
    # exactly): a zero baseline.  FlashAttention's backward uses D = rowsum(dO * O), equal to dP only up to
    # rounding, and scale 30 times k ~100 turns that into dq, dk ~1 -- ~1e-6 of the gradient scale, rounding
    # and not an implementation error, yet infinitely many times a zero baseline.  dq, dk: finite only.
    # dv = P^T dO needs P, which a FlashAttention backward recomputes as exp(s - lse) from a stored fp32 LSE:
    # at |scores| ~2e6 the fp32 spacing is 0.125-0.25, so the recomputed exponent carries errors of that size
    # (tens of percent in P) that plain PyTorch's one-pass softmax does not have. The chunked torch backend
    # happens to reuse bitwise the same scores and passes; the Triton kernels recompute them with another
    # tiling. dv: finite only as well; out and lse: the full rule.
    only_finite = ("dq", "dk", "dv")
    out, lse, _ = check_against_oracle(q, k, v, causal=causal, softmax_scale=30.0, only_finite=only_finite)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ------------------------------------------------------------------------------------ return_attn_probs


@pytest.mark.parametrize("packing", ["none", "qkv", "kv"])
def test_return_attn_probs(backend, packing):
    b, s, h, d = 2, 24, 4, 32
    dtype = torch.float16
    x = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=dtype)
    if packing == "qkv":
        fn, args = flash_attn_qkvpacked_func, (x,)
    elif packing == "kv":
        fn, args = flash_attn_kvpacked_func, (x[:, :, 0], x[:, :, 1:])
    else:
        fn, args = flash_attn_func, tuple(x.unbind(2))

    out_only = fn(*args)
    assert isinstance(out_only, torch.Tensor)
    assert out_only.shape == (b, s, h, d) and out_only.dtype == dtype

    res = fn(*args, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, s_dmask = res
    assert torch.equal(out, out_only)
    assert out.shape == (b, s, h, d) and out.dtype == dtype and out.device.type == DEVICE
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32 and lse.device.type == DEVICE
    # flash_attn's S_dmask without dropout: an empty tensor in q's dtype
    assert s_dmask.shape == (0,) and s_dmask.dtype == dtype and s_dmask.device.type == DEVICE
    _, lse_ref = attention_ref(*x.unbind(2), upcast=True)
    assert (lse.double() - lse_ref).abs().max().item() < 1e-2  # natural log, not base 2


# ---------------------------------------------------------------------------------------------- grads


@pytest.mark.parametrize("shape", [(2, 31, 31, 4, 4, 32), (2, 31, 45, 4, 2, 32)], ids=_shape_id)
def test_grad_dtypes_and_accumulation(backend, dtype, shape):
    """``.backward()`` fills ``.grad`` of leaves in the input dtype/shape and accumulates like any op."""
    q, k, v = _qkv(*shape, dtype)
    dout = torch.randn(shape[0], shape[1], shape[3], shape[5], device=DEVICE).to(dtype)
    flash_attn_func(q, k, v, causal=True).backward(dout)
    first = [x.grad.clone() for x in (q, k, v)]
    for x, g in zip((q, k, v), first, strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape and g.device == x.device
        assert torch.isfinite(g).all()
    flash_attn_func(q, k, v, causal=True).backward(dout)
    for x, g in zip((q, k, v), first, strict=True):
        torch.testing.assert_close(x.grad, 2 * g)


def test_inputs_not_modified(backend):
    q, k, v = _qkv(2, 40, 50, 4, 2, 32, torch.float16)
    before = [x.detach().clone() for x in (q, k, v)]
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    for x, x0 in zip((q, k, v), before, strict=True):
        assert torch.equal(x.detach(), x0)


# -------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bitwise_deterministic(backend, deterministic, causal):
    """Two runs give bitwise-identical out, lse and grads (the default design is deterministic too)."""
    if is_interpreted(backend):
        shape, dtype = (1, 64, 64, 2, 1, 32), torch.float16  # more in test_triton_interpret.py
    elif HAS_CUDA:
        shape, dtype = (2, 1024, 1024, 8, 2, 64), torch.bfloat16  # many tiles writing each dk/dv
    else:
        shape, dtype = (2, 160, 160, 4, 2, 32), torch.float16
    q, k, v = _qkv(*shape, dtype)
    dout = torch.randn(shape[0], shape[1], shape[3], shape[5], device=DEVICE).to(dtype)
    runs = [
        run_flash(flash_attn_func, (q, k, v), dout, causal=causal, deterministic=deterministic)
        for _ in range(2)
    ]
    (o1, l1, g1), (o2, l2, g2) = runs
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for name, a, c in zip(["dq", "dk", "dv"], g1, g2, strict=True):
        assert torch.equal(a, c), f"{name} differs between runs: max diff {(a - c).abs().max().item()}"


# ------------------------------------------------------------------------------------ backend selection


@pytest.mark.skipif(HAS_CUDA, reason="CPU default-backend check")
def test_cpu_default_backend(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", None)
    check_against_oracle(*_qkv(1, 21, 21, 2, 2, 16, torch.float32), causal=True)


# ----------------------------------------------------------------------------------------- training features

# name -> options for flash_attn_func and the oracle ("alibi" tensors are built in the test)
FEATURES = {
    "window-left": {"window_size": (8, 0)},
    "window-both": {"window_size": (3, 5)},
    "softcap": {"softcap": 5.0},
    "alibi-h": {"alibi_slopes": "h"},
    "alibi-bh": {"alibi_slopes": "bh"},
    "dropout": {"dropout_p": 0.17},
    "all": {"window_size": (16, 4), "softcap": 8.0, "alibi_slopes": "h", "dropout_p": 0.1},
}


def _feature_options(name, b, h):
    opts = dict(FEATURES[name])
    if "alibi_slopes" in opts:
        shape = (h,) if opts["alibi_slopes"] == "h" else (b, h)
        opts["alibi_slopes"] = torch.rand(*shape, device=DEVICE, dtype=torch.float32)
    return opts


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(45, 61), (61, 45)])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_training_features(backend, dtype, feature, sq, sk, causal):
    """window / softcap / ALiBi / dropout through the public API vs the oracle (dropout: replayed mask)."""
    b, h, hk, d = (1, 2, 1, 32) if is_interpreted(backend) else (2, 4, 2, 32)
    check_against_oracle(*_qkv(b, sq, sk, h, hk, d, dtype), causal=causal, **_feature_options(feature, b, h))


@pytest.mark.parametrize("feature", ["window-both", "softcap", "alibi-bh", "dropout"])
@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed_functions_forward_features(backend, packing, feature):
    """The packed entry points hand every option on: same result as flash_attn_func on the same views."""
    b, s, h, d = (1, 33, 2, 32) if is_interpreted(backend) else (2, 33, 4, 32)
    x = torch.randn(b, s, 3, h, d, device=DEVICE, dtype=torch.float16).requires_grad_(True)
    opts = _feature_options(feature, b, h)
    dout = torch.randn(b, s, h, d, device=DEVICE, dtype=torch.float16)
    torch.manual_seed(1)
    if packing == "qkv":
        out_p, lse_p, mask_p = flash_attn_qkvpacked_func(x, causal=True, return_attn_probs=True, **opts)
    else:
        out_p, lse_p, mask_p = flash_attn_kvpacked_func(
            x[:, :, 0], x[:, :, 1:], causal=True, return_attn_probs=True, **opts
        )
    (g_p,) = torch.autograd.grad(out_p, (x,), dout)
    torch.manual_seed(1)
    out_u, lse_u, mask_u = flash_attn_func(*x.unbind(2), causal=True, return_attn_probs=True, **opts)
    (g_u,) = torch.autograd.grad(out_u, (x,), dout)
    assert torch.equal(out_p, out_u) and torch.equal(lse_p, lse_u) and torch.equal(g_p, g_u)
    assert (mask_p is None) == (mask_u is None) and (mask_p is None or torch.equal(mask_p, mask_u))
    # and the options really did something
    plain = flash_attn_func(*x.unbind(2), causal=True)
    assert not torch.equal(out_u, plain), f"{feature} had no effect"


def test_dropout_repeatable_with_manual_seed(backend):
    q, k, v = _qkv(2, 40, 40, 4, 4, 32, torch.float16)
    torch.manual_seed(123)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(123)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    c = flash_attn_func(q, k, v, dropout_p=0.3)  # the generator moved on: a new mask
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_headdim_v_differs(backend, dtype, causal):
    """v may have its own head dim (d_qk = 48, d_v = 24 here); out takes v's."""
    q, k, _ = _qkv(2, 37, 50, 4, 2, 48, dtype)
    v = torch.randn(2, 50, 2, 24, device=DEVICE).to(dtype).requires_grad_(True)
    out, _, _ = check_against_oracle(q, k, v, causal=causal)
    assert out.shape == (2, 37, 4, 24)
