"""flashattn.layers.rotary: flash_attn's apply_rotary_emb / apply_rotary_emb_qkv_ / apply_rotary_emb_kv_
against a float64 per-token rotation, under the tolerance rule (the baseline: the same rotation in the input
dtype, as flash_attn's apply_rotary_emb_torch computes it)."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close_to_ref

from flashattn.errors import FlashAttnError
from flashattn.layers.rotary import apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_


def tables(seqlen_ro, rotary_dim, dtype=torch.float32):
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.outer(torch.arange(seqlen_ro, dtype=torch.float64), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_ref(x, cos, sin, positions, interleaved, dtype=torch.float64):
    """x (..., tokens, nheads, headdim) with one position per token (-1: unrotated), in dtype."""
    half = cos.shape[1]
    rd = 2 * half
    seen = (positions >= 0) & (positions < cos.shape[0])
    idx = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(seen[..., None], cos.to(dtype)[idx], 1.0).unsqueeze(-2)
    s = torch.where(seen[..., None], sin.to(dtype)[idx], 0.0).unsqueeze(-2)
    xr = x[..., :rd].to(dtype)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), -1)
    return torch.cat((rot, x[..., rd:].to(dtype)), -1)


def check(got, x, cos, sin, positions, interleaved, name="out"):
    ref = rotate_ref(x, cos, sin, positions, interleaved)
    pt = rotate_ref(x, cos, sin, positions, interleaved, dtype=x.dtype)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_close_to_ref(got, ref, pt, name=name)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_padded(interleaved, dtype, offsets):
    b, s, h, d, rd = 3, 17, 2, 40, 24
    x = torch.randn(b, s, h, d, dtype=dtype)
    cos, sin = tables(40, rd, dtype)
    seqlen_offsets = {"zero": 0, "int": 5, "tensor": torch.tensor([0, 9, 30], dtype=torch.int32)}[offsets]
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=seqlen_offsets)
    off = seqlen_offsets.view(-1, 1).long() if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    positions = torch.arange(s).view(1, -1) + off  # the tensor offset 30 runs past seqlen_ro: unrotated there
    check(out, x, cos, sin, positions.expand(b, s), interleaved)


def test_varlen_and_rows_past_the_sequences():
    lens = [4, 0, 9]
    cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32)
    x = torch.randn(15, 2, 32)  # two rows past cu_seqlens[-1]: left as they are
    cos, sin = tables(20, 32)
    offsets = torch.tensor([3, 1, 10], dtype=torch.int64)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=9, seqlen_offsets=offsets)
    positions = torch.cat([torch.arange(n) + int(o) for n, o in zip(lens, offsets, strict=True)]
                          + [torch.full((2,), -1)])
    check(out, x, cos, sin, positions, False)
    assert torch.equal(out[13:], x[13:])


def test_inplace_and_gradient():
    x = torch.randn(2, 11, 3, 16, dtype=torch.float64)
    cos, sin = tables(11, 16)
    leaf = x.clone().requires_grad_(True)
    y = leaf * 1.0  # a non-leaf, rotated in place
    out = apply_rotary_emb(y, cos, sin, inplace=True)
    assert out is y
    g = torch.randn_like(x)
    (grad,) = torch.autograd.grad(out, leaf, g)
    # the rotation is orthogonal: its gradient is the inverse rotation, i.e. by the negated sines
    positions = torch.arange(11).view(1, -1).expand(2, 11)
    want = rotate_ref(g, cos, -sin, positions, False)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["qkv", "gqa"])
def test_qkv_inplace_with_own_k_tables(layout):
    b, s, d = 2, 13, 32
    cos, sin = tables(20, 16)
    cos_k, sin_k = tables(20, 16)
    cos_k, sin_k = cos_k * 0.5, sin_k * 0.5  # XPos-like: k's own tables
    if layout == "qkv":
        qkv = torch.randn(b, s, 3, 4, d)
        q, k, v = qkv[:, :, 0].clone(), qkv[:, :, 1].clone(), qkv[:, :, 2].clone()
        kw = {}
    else:
        qkv = torch.randn(b, s, 4 + 2 * 2, d)
        q, k, v = qkv[:, :, :4].clone(), qkv[:, :, 4:6].clone(), qkv[:, :, 6:].clone()
        kw = dict(num_heads_q=4)
    leaf = qkv.clone().requires_grad_(True)
    work = leaf * 1.0
    out = apply_rotary_emb_qkv_(work, cos, sin, cos_k, sin_k, seqlen_offsets=2, **kw)
    assert out is work
    positions = (torch.arange(s) + 2).view(1, -1).expand(b, s)
    if layout == "qkv":
        got_q, got_k, got_v = out[:, :, 0], out[:, :, 1], out[:, :, 2]
    else:
        got_q, got_k, got_v = out[:, :, :4], out[:, :, 4:6], out[:, :, 6:]
    check(got_q, q, cos, sin, positions, False, "q")
    check(got_k, k, cos_k, sin_k, positions, False, "k")
    assert torch.equal(got_v, v)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, leaf, g)
    gq, gk = (g[:, :, 0], g[:, :, 1]) if layout == "qkv" else (g[:, :, :4], g[:, :, 4:6])
    dq, dk = (grad[:, :, 0], grad[:, :, 1]) if layout == "qkv" else (grad[:, :, :4], grad[:, :, 4:6])
    torch.testing.assert_close(dq, rotate_ref(gq, cos, -sin, positions, False).float())
    torch.testing.assert_close(dk, rotate_ref(gk, cos_k, -sin_k, positions, False).float())


def test_kv_inplace():
    kv = torch.randn(2, 9, 2, 2, 16)
    k, v = kv[:, :, 0].clone(), kv[:, :, 1].clone()
    cos, sin = tables(9, 8)
    out = apply_rotary_emb_kv_(kv, cos, sin, interleaved=True)
    assert out is kv
    check(kv[:, :, 0], k, cos, sin, torch.arange(9).view(1, -1).expand(2, 9), True, "k")
    assert torch.equal(kv[:, :, 1], v)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, c, s: apply_rotary_emb(x[0], c, s), r"\bx\b"),
        (lambda x, c, s: apply_rotary_emb(x, torch.cat([c, c], 1), torch.cat([s, s], 1)), "rotary_dim"),
        (lambda x, c, s: apply_rotary_emb(x, c, s[:3]), r"\bsin\b"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=8), "seqlen_offsets.*8"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=torch.zeros(3, dtype=torch.int32)),
         "seqlen_offsets"),
        (lambda x, c, s: apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)),
         "max_seqlen"),
        (lambda x, c, s: apply_rotary_emb_qkv_(x.unsqueeze(2).expand(-1, -1, 5, -1, -1), c, s), r"\bqkv\b"),
        (lambda x, c, s: apply_rotary_emb_qkv_(x, c, s), "num_heads_q"),
    ],
)
def test_errors(call, match):
    x = torch.randn(2, 10, 4, 16)
    cos, sin = tables(12, 16)
    with pytest.raises(FlashAttnError, match=match):
        call(x, cos, sin)

def _qkv_and_tables():
    gen = torch.Generator().manual_seed(0)
    ang = torch.rand(4, 4, generator=gen)
    return torch.randn(1, 4, 3, 1, 8, generator=gen), ang.cos(), ang.sin()


def test_rejected_qkv_rotary_leaves_qkv_unchanged():
    # every part is checked before any is rotated (a case the fuzz found)
    qkv, cos, sin = _qkv_and_tables()
    before = qkv.clone()
    with pytest.raises(FlashAttnError):
        apply_rotary_emb_qkv_(qkv, cos, sin, cos, sin[:3])  # sin_k of 3 rows, cos_k of 4
    assert torch.equal(qkv, before)


def test_qkv_rotary_errors_name_the_k_tables():
    qkv, cos, sin = _qkv_and_tables()
    with pytest.raises(FlashAttnError, match="sin_k"):
        apply_rotary_emb_qkv_(qkv, cos, sin, cos, sin[:3])
