"""The Triton kernels on CPU tensors through the Triton interpreter (``TRITON_INTERPRET=1`` at process start).

This is how CI, which has no GPU, tests the kernels themselves: FLASHATTN_BACKEND=triton is forced, a launch
counter proves the kernels really ran (no silent fallback to the torch backend), and the shapes are chosen
to cross the interpreter's tile boundaries (small unequal tiles, see ``flashattn.ops.configs``): tails,
multi-tile sequences (> 128), causal with seqlen_q != seqlen_k both ways, GQA/MQA, odd head dims, strided
inputs.  The interpreter emulates Triton with numpy, slowly and with bf16 computed wrong, so fp16/fp32 only
and small batch/heads.
"""

from __future__ import annotations

import pytest
import torch
from test_interface import check_against_oracle, run_flash
from utils import INTERPRET

from flashattn import config as flashattn_config
from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashattn.reference import attention_ref

pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")

FP16_FP32 = pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "triton")


def _qkv(b, sq, sk, h, hk, d, dtype, scale=1.0):
    def rand(*shape):
        return (torch.randn(*shape) * scale).to(dtype).requires_grad_(True)

    return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)


# ------------------------------------------------------------------------------------ the kernels run


def test_forward_and_backward_launch_triton_kernels(launches):
    q, k, v = _qkv(1, 40, 40, 2, 2, 32, torch.float32)
    out = flash_attn_func(q, k, v, causal=True)
    n_fwd = sum(launches.values())
    assert n_fwd >= 1, "forward launched no Triton kernel: FLASHATTN_BACKEND=triton was not honoured"
    out.backward(torch.randn_like(out))
    assert sum(launches.values()) > n_fwd, "backward launched no Triton kernel"


def test_torch_backend_launches_nothing(launches, monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    q, k, v = _qkv(1, 40, 40, 2, 2, 32, torch.float32)
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    assert sum(launches.values()) == 0, f"torch backend launched Triton kernels: {dict(launches)}"


# ------------------------------------------------------------------------------ forward + backward


# (b, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
MULTI_TILE = [
    (1, 200, 300, 2, 1, 64),  # > 128 both ways, sq < sk, MQA
    (1, 300, 200, 2, 2, 64),  # sq > sk: with causal, rows 0..99 see no key
    (2, 129, 129, 2, 2, 32),  # one past a power of two
]


def _id(s):
    return "b{}-sq{}-sk{}-h{}-hk{}-d{}".format(*s)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", MULTI_TILE, ids=_id)
def test_multi_tile(launches, shape, causal):
    dtype = torch.float16
    q, k, v = _qkv(*shape, dtype)
    out, lse, (dq, _, _) = check_against_oracle(q, k, v, causal=causal)
    assert launches, "no Triton kernel ran"
    sq, sk = shape[1], shape[2]
    if causal and sq > sk:
        n = sq - sk
        assert (out[:, :n] == 0).all() and torch.isposinf(lse[:, :, :n]).all() and (dq[:, :n] == 0).all()


# Sequence lengths around the interpreter tiles (16 and 32 rows/columns) and degenerate ones.
BOUNDARY_SEQLENS = [(31, 33), (32, 32), (33, 31), (16, 48), (48, 16), (1, 33), (33, 1), (17, 113)]


@FP16_FP32
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", BOUNDARY_SEQLENS)
def test_tile_boundaries(sq, sk, causal, dtype):
    check_against_oracle(*_qkv(1, sq, sk, 2, 2, 32, dtype), causal=causal)


@FP16_FP32
@pytest.mark.parametrize("d", [1, 16, 40, 59, 96, 128, 256])
def test_head_dims(d, dtype):
    # d == 1 uses the rounding floor for gradients in low precision: see test_interface.py::test_head_dims.
    floor = "rounding" if d == 1 and dtype != torch.float32 else None
    check_against_oracle(*_qkv(1, 40, 50, 2, 2, d, dtype), causal=True, grad_floor=floor)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 37, 70, 6, 2, 32), (1, 70, 37, 4, 1, 40)], ids=_id)
def test_gqa_mqa(shape, causal):
    q, k, v = _qkv(*shape, torch.float16)
    _, _, (_, dk, dv) = check_against_oracle(q, k, v, causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape


@FP16_FP32
def test_fully_masked_rows(dtype):
    q, k, v = _qkv(2, 70, 20, 2, 2, 32, dtype)
    out, lse, (dq, dk, dv) = check_against_oracle(q, k, v, causal=True)
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert (out[:, :50] == 0).all() and torch.isposinf(lse[:, :, :50]).all() and (dq[:, :50] == 0).all()
    assert torch.isfinite(lse[:, :, 50:]).all()


# ---------------------------------------------------------------------------------- layouts and packing


@pytest.mark.parametrize("layout", ["qkvpacked_views", "transposed", "padded_headdim"])
def test_strided_inputs(layout):
    b, s, h, d = 1, 45, 2, 40
    dtype = torch.float16

    def leaf(*shape):
        return torch.randn(*shape).to(dtype).requires_grad_(True)

    if layout == "qkvpacked_views":
        base = leaf(b, s, 3, h, d)
        q, k, v = base.unbind(2)
        wrt = (base,)
    elif layout == "transposed":
        bases = [leaf(b, h, s, d) for _ in range(3)]
        q, k, v = (x.transpose(1, 2) for x in bases)
        wrt = bases
    else:
        bases = [leaf(b, s, h, d + 24) for _ in range(3)]
        q, k, v = (x[..., 8 : 8 + d] for x in bases)
        wrt = bases
    check_against_oracle(q, k, v, causal=True, wrt=wrt)


def test_packed_equal_unpacked():
    qkv = torch.randn(1, 37, 3, 2, 32).to(torch.float16).requires_grad_(True)
    dout = torch.randn(1, 37, 2, 32).to(torch.float16)
    out_p, lse_p, (dqkv_p,) = run_flash(flash_attn_qkvpacked_func, (qkv,), dout, causal=True)
    out_u, lse_u, _ = flash_attn_func(*qkv.unbind(2), causal=True, return_attn_probs=True)
    (dqkv_u,) = torch.autograd.grad(out_u, (qkv,), dout)
    assert torch.equal(out_p, out_u) and torch.equal(lse_p, lse_u) and torch.equal(dqkv_p, dqkv_u)

    q = torch.randn(1, 29, 4, 32).to(torch.float16).requires_grad_(True)
    kv = torch.randn(1, 41, 2, 2, 32).to(torch.float16).requires_grad_(True)
    dout = torch.randn(1, 29, 4, 32).to(torch.float16)
    out_p, lse_p, (dq_p, dkv_p) = run_flash(flash_attn_kvpacked_func, (q, kv), dout, causal=True)
    out_u, lse_u, _ = flash_attn_func(q, *kv.unbind(2), causal=True, return_attn_probs=True)
    dq_u, dkv_u = torch.autograd.grad(out_u, (q, kv), dout)
    assert torch.equal(out_p, out_u) and torch.equal(lse_p, lse_u)
    assert torch.equal(dq_p, dq_u) and torch.equal(dkv_p, dkv_u)


# ----------------------------------------------------------------------------------- numerics, misc


@FP16_FP32
def test_extreme_logits(dtype):
    """softmax_scale=30 on inputs x100 (logits ~1e6): finite, and matching the oracle where a baseline exists
    (fp32; plain fp16 PyTorch overflows).  Gradients: see tests/test_interface.py::test_extreme_logits."""
    q, k, v = _qkv(1, 67, 67, 2, 2, 32, dtype, scale=100.0)
    if dtype == torch.float32:
        # gradients finite only: P recomputed from an fp32 LSE of ~2e6 (see test_extreme_logits)
        out, lse, _ = check_against_oracle(q, k, v, causal=True, softmax_scale=30.0,
                                           only_finite=("dq", "dk", "dv"))
    else:
        dout = torch.randn(1, 67, 2, 32).to(dtype)
        out, lse, grads = run_flash(flash_attn_func, (q, k, v), dout, causal=True, softmax_scale=30.0)
        _, lse_ref = attention_ref(q, k, v, causal=True, softmax_scale=30.0, upcast=True)
        rel = ((lse.double() - lse_ref).abs() / lse_ref.abs().clamp_min(1.0)).max().item()
        assert rel < 1e-5, f"lse relative error {rel:.3g}"
        assert all(torch.isfinite(g).all() for g in grads)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_bitwise_deterministic(deterministic):
    q, k, v = _qkv(1, 100, 100, 4, 2, 32, torch.float16)
    dout = torch.randn(1, 100, 4, 32).to(torch.float16)
    (o1, l1, g1), (o2, l2, g2) = (
        run_flash(flash_attn_func, (q, k, v), dout, causal=True, deterministic=deterministic)
        for _ in range(2)
    )
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert all(torch.equal(a, c) for a, c in zip(g1, g2, strict=True))


def test_return_attn_probs():
    q, k, v = _qkv(2, 24, 24, 4, 4, 32, torch.float16)
    out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (2, 24, 4, 32) and out.dtype == torch.float16
    assert lse.shape == (2, 4, 24) and lse.dtype == torch.float32
    assert s_dmask is None or isinstance(s_dmask, torch.Tensor)


def test_backward_takes_a_sliced_lse():
    # the kernels read the LSE and D with one pair of strides: a view of a larger LSE (a context-parallel
    # caller's slice) must give the gradients a contiguous one gives, and never be written out of its bounds
    from flashattn.backends.triton import attention

    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16) for _ in range(3))
    kw = dict(softmax_scale=32 ** -0.5, causal=True)
    out, lse = attention.attention_forward(q, k, v, **kw)
    wide = torch.full((1, 2, 64), float("nan"))
    wide[:, :, 10:50] = lse
    dout = torch.randn_like(out)
    want = attention.attention_backward(dout, q, k, v, out, lse, **kw)[:3]
    got = attention.attention_backward(dout, q, k, v, out, wide[:, :, 10:50], **kw)[:3]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.isnan(wide[:, :, :10]).all() and torch.isnan(wide[:, :, 50:]).all()
