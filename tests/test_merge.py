"""merge_attention_states: exact merge of attention over disjoint key sets, ±inf (empty) parts, the varlen and
many-way forms, autograd, and cascade attention (shared prefix once + per-sequence suffixes == full)."""

from __future__ import annotations

import math

import pytest
import torch
from utils import assert_close_to_ref

from flashattn import config as flashattn_config
from flashattn import flash_attn_func
from flashattn.kvcache import flash_attn_with_kvcache
from flashattn.merge import merge_attention_states
from flashattn.reference import attention_ref


def merge_ref(outs, lses):
    """fp64 logsumexp merge; ±inf parts are empty, a row with no part gets out 0 and lse +inf."""
    lp = torch.stack(lses).double()
    lp = torch.where(torch.isposinf(lp), torch.full_like(lp, -math.inf), lp)
    lse = torch.logsumexp(lp, dim=0)
    empty = torch.isneginf(lse)
    w = torch.exp(lp - torch.where(empty, torch.zeros_like(lse), lse))
    w = w.transpose(-1, -2).unsqueeze(-1)
    out = torch.where(w > 0, w * torch.stack(outs).double(), 0.0).sum(0)  # empty parts may hold NaN
    return out, torch.where(empty, torch.full_like(lse, math.inf), lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [(17,), (5, 30, 41)], ids=["2-way", "4-way"])
def test_merge_of_key_splits_is_full_attention(backend, dtype, splits):
    b, sq, sk, h, hk, d = 2, 3, 60, 4, 2, 32
    q, k, v = (torch.randn(b, n, heads, d).to(dtype) for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    bounds = [0, *splits, sk]
    outs, lses = [], []
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        o, lse, _ = flash_attn_func(q, k[:, a:z], v[:, a:z], return_attn_probs=True)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 2:
        out, lse = merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    else:
        out, lse = merge_attention_states(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False)
    assert_close_to_ref(out, out_ref, out_pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, name="lse")


def test_varlen_layout(backend):
    # varlen results: out (total, h, d), lse (h, total)
    total, h, d = 23, 3, 24
    parts = [(torch.randn(total, h, d), torch.randn(h, total)) for _ in range(3)]
    out, lse = merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    assert out.shape == (total, h, d) and lse.shape == (h, total)
    ref_out, ref_lse = merge_ref([p[0].unsqueeze(0) for p in parts], [p[1].unsqueeze(0) for p in parts])
    torch.testing.assert_close(out.double(), ref_out[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse[0], rtol=0, atol=1e-5)


def test_empty_parts_plus_and_minus_inf(backend):
    b, sq, h, d = 2, 4, 3, 16
    outs = [torch.randn(b, sq, h, d) for _ in range(3)]
    lses = [torch.randn(b, h, sq) for _ in range(3)]
    lses[0][0, 1, 2] = math.inf  # flash_attn's "saw no key"
    lses[1][0, 1, 2] = -math.inf  # a split partial's "saw no key"
    outs[1][0, 2, 1] = float("nan")  # an empty part's output is never read
    lses[1][1, 0, :] = math.inf  # a whole head empty in one part
    for lse in lses:
        lse[1, 2, 3] = math.inf if lse is lses[0] else -math.inf  # every part empty: out 0, lse +inf
    out, lse = merge_attention_states(outs, lses)
    ref_out, ref_lse = merge_ref(outs, lses)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    assert torch.isposinf(lse[1, 2, 3]) and torch.all(out[1, 3, 2] == 0)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)
    # the empty row merged again with a real part yields that part exactly
    out2, lse2 = merge_attention_states(out, lse, outs[2], lses[2].clone().fill_(0.5))
    torch.testing.assert_close(out2[1, 3, 2], outs[2][1, 3, 2], rtol=0, atol=1e-6)


def test_rows_without_keys_from_flash_attn_func(backend):
    # causal with sk < sq: the first rows of the suffix part see nothing (lse +inf); the prefix covers them
    b, sq, h, d = 1, 6, 2, 16
    q, kp, vp = torch.randn(b, sq, h, d), torch.randn(b, 5, h, d), torch.randn(b, 5, h, d)
    ks, vs = torch.randn(b, 3, h, d), torch.randn(b, 3, h, d)
    o_p, l_p, _ = flash_attn_func(q, kp, vp, return_attn_probs=True)
    o_s, l_s, _ = flash_attn_func(q, ks, vs, causal=True, return_attn_probs=True)
    assert torch.isposinf(l_s[:, :, :3]).all()
    out, lse = merge_attention_states(o_p, l_p, o_s, l_s)
    torch.testing.assert_close(out[:, :3], o_p[:, :3], rtol=0, atol=1e-6)
    # both parts empty for those rows: 0 and +inf
    out, lse = merge_attention_states(o_s, l_s, o_s, l_s)
    assert torch.all(out[:, :3] == 0) and torch.isposinf(lse[:, :, :3]).all()


def test_autograd(backend):
    b, sq, h, d = 2, 3, 2, 16
    outs = [torch.randn(b, sq, h, d, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(b, h, sq) for _ in range(3)]
    lses[1][0, 0, 1] = math.inf
    lses[2][1, 1, 2] = -math.inf
    lses = [lse.requires_grad_() for lse in lses]
    dout, dlse = torch.randn(b, sq, h, d), torch.randn(b, h, sq)
    out, lse = merge_attention_states(outs, lses)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), outs + lses)
    ref_out, ref_lse = merge_ref(outs, lses)
    loss_ref = (ref_out * dout.double()).sum() + (ref_lse * dlse.double()).sum()
    ref_grads = torch.autograd.grad(loss_ref, outs + lses)
    for g, r in zip(grads, ref_grads, strict=True):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g.double(), r.double(), rtol=0, atol=1e-5)
    assert grads[4][0, 0, 1] == 0 and grads[5][1, 1, 2] == 0


@pytest.mark.parametrize("sq, causal", [(1, False), (2, True)], ids=["decode", "verify-causal"])
def test_cascade_shared_prefix(backend, sq, causal):
    # prefix shared by the batch, attended once (its k/v broadcast over the batch, no copy), suffixes per
    # sequence in a paged cache; merged == full attention over prefix + suffix
    b, h, hk, d, n_prefix = 3, 8, 2, 32, 40
    q = torch.randn(b, sq, h, d)
    kp, vp = torch.randn(1, n_prefix, hk, d), torch.randn(1, n_prefix, hk, d)
    seqlens = torch.tensor([5, 17, 30], dtype=torch.int32)
    k_suf, v_suf = torch.randn(b, 32, hk, d), torch.randn(b, 32, hk, d)
    page = 16
    pool_k = k_suf.reshape(-1, page, hk, d).flip(0).contiguous()  # pages in reverse order
    pool_v = v_suf.reshape(-1, page, hk, d).flip(0).contiguous()
    n_pages = pool_k.shape[0]
    table = (n_pages - 1 - torch.arange(n_pages)).view(b, -1).to(torch.int32)

    kp_b, vp_b = kp.expand(b, -1, -1, -1), vp.expand(b, -1, -1, -1)
    o_p, l_p, _ = flash_attn_func(q, kp_b, vp_b, return_attn_probs=True)
    o_s, l_s = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens, block_table=table,
                                       causal=causal, return_softmax_lse=True)
    out, lse = merge_attention_states(o_p, l_p, o_s, l_s)
    for i in range(b):
        n = int(seqlens[i])
        k_full = torch.cat((kp[0], k_suf[i, :n]))[None]
        v_full = torch.cat((vp[0], v_suf[i, :n]))[None]
        ref = attention_ref(q[i : i + 1], k_full, v_full, causal=causal)
        pt = attention_ref(q[i : i + 1], k_full, v_full, causal=causal, upcast=False)
        assert_close_to_ref(out[i : i + 1], ref[0], pt[0], name=f"out[{i}]")
        assert_close_to_ref(lse[i : i + 1], ref[1], pt[1], name=f"lse[{i}]")


def _parts(d_b=8, lse_dtype=torch.float32, lse_shape=(1, 3, 2), out_dtype=torch.float32):
    return (torch.randn(1, 2, 3, 8, dtype=out_dtype), torch.randn(lse_shape).to(lse_dtype),
            torch.randn(1, 2, 3, d_b, dtype=out_dtype), torch.randn(lse_shape))


BAD = {
    "count": (lambda: ([torch.randn(1, 2, 3, 8)], [torch.randn(1, 3, 2)] * 2), ValueError,
              r"as many outputs as LSEs"),
    "shape": (lambda: _parts(d_b=4), ValueError, r"out\[1\] is \(1, 2, 3, 4\) .* the parts must match"),
    "lse-dtype": (lambda: _parts(lse_dtype=torch.float16), TypeError,
                  r"lse\[0\] has dtype torch.float16; expected torch.float32"),
    "lse-shape": (lambda: _parts(lse_shape=(1, 2, 3)), ValueError,
                  r"lse\[0\] has shape \(1, 2, 3\); expected \(1, 3, 2\) = \(batch, nheads, seqlen_q\)"),
    "out-dtype": (lambda: _parts(out_dtype=torch.float64), TypeError, r"out\[0\] has dtype torch.float64"),
    "missing-b": (lambda: _parts()[:2], TypeError, r"needs out_a, lse_a, out_b, lse_b"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(name):
    make, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        merge_attention_states(*make())


def test_opcheck(monkeypatch):
    from flashattn.merge import merge_states

    monkeypatch.setattr(flashattn_config, "backend", "torch")
    outs = [torch.randn(2, 3, 4, 16, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(2, 4, 3, requires_grad=True) for _ in range(3)]
    torch.library.opcheck(merge_states.library_op, (outs, lses))
