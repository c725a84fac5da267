"""Training features in the Triton kernels, against the fp64 oracle with the tolerance rule.

Runs the kernels through the public API: under TRITON_INTERPRET=1 on the CPU (small fp16 shapes that still
cross tile, diagonal and window edges with the interpreter's 32x16 tiles), or on CUDA. The torch backend has
its own feature tests (test_torch_backend_features.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from utils import assert_close_to_ref, keep_mask

import flashattn
from flashattn import config as flashattn_config
from flashattn.reference import attention_ref

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEV = "cuda" if ON_GPU else "cpu"
DT = torch.bfloat16 if ON_GPU else torch.float16


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    torch.manual_seed(0)


def _inputs(b, sq, sk, h, hk, d, dv=None):
    mk = lambda *s: torch.randn(*s, device=DEV, dtype=DT, requires_grad=True)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, dv or d)


def _check(q, k, v, sink=None, dropout_mask=None, **kw):
    """Forward, LSE and every gradient (sink included) against the oracle; returns our outputs."""
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sink, **kw)
    if dropout_mask is None and kw.get("dropout_p", 0) > 0:
        dropout_mask = keep_mask(s_dmask, q.shape[1], k.shape[1])
    ref_kw = dict(kw, learnable_sink=sink, dropout_mask=dropout_mask)
    ref_kw.pop("deterministic", None)
    ref, lse_ref = attention_ref(q, k, v, **ref_kw)
    pt, lse_pt = attention_ref(q, k, v, upcast=False, **ref_kw)
    assert_close_to_ref(out, ref, pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, name="lse")
    leaves = [q, k, v] + ([sink] if sink is not None else [])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    grads_ref = torch.autograd.grad(ref, leaves, dout.double())
    grads_pt = torch.autograd.grad(pt, leaves, dout)
    for name, g, r, p in zip(["dq", "dk", "dv", "dsink"], grads, grads_ref, grads_pt, strict=False):
        assert_close_to_ref(g, r, p, factor=3.0, name=name)
    return out, lse, s_dmask, grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(8, 4), (5, -1), (-1, 3), (0, 0)])
@pytest.mark.parametrize("sq, sk", [(45, 45), (37, 53), (53, 37)])
def test_window(window, causal, sq, sk):
    _check(*_inputs(1, sq, sk, 2, 1, 16), causal=causal, window_size=window)


def test_window_rows_that_see_no_key():
    # sq > sk with a window that ends before key 0 for the first rows: out 0, lse +inf, zero gradients
    q, k, v = _inputs(1, 50, 20, 2, 2, 16)
    out, lse, _, grads = _check(q, k, v, causal=True, window_size=(2, -1))
    assert torch.isinf(lse[:, :, :30]).all() and (out[:, :30] == 0).all() and (grads[0][:, :30] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(causal):
    _check(*_inputs(2, 41, 57, 2, 1, 32), causal=causal, softcap=2.0)


@pytest.mark.parametrize("shape", ["h", "bh"])
def test_alibi(shape):
    q, k, v = _inputs(2, 41, 57, 4, 2, 16)
    slopes = torch.rand(4, device=DEV) if shape == "h" else torch.rand(2, 4, device=DEV)
    _check(q, k, v, causal=True, alibi_slopes=slopes)


@pytest.mark.parametrize("causal", [False, True])
def test_learnable_sink(causal):
    q, k, v = _inputs(2, 37, 45, 4, 2, 16)
    sink = torch.randn(4, device=DEV, requires_grad=True)
    _check(q, k, v, sink=sink, causal=causal)


def test_sink_on_rows_that_see_no_key():
    q, k, v = _inputs(1, 40, 20, 2, 2, 16)
    sink = torch.randn(2, device=DEV, requires_grad=True)
    out, lse, _, _ = _check(q, k, v, sink=sink, causal=True)
    assert (out[:, :20] == 0).all()
    torch.testing.assert_close(lse[0, :, :20], sink.detach()[:, None].expand(2, 20).float())


@pytest.mark.parametrize("d, dv", [(32, 16), (24, 40)])
def test_value_head_dim_differs(d, dv):
    out, *_ = _check(*_inputs(1, 37, 45, 4, 2, d, dv), causal=True)
    assert out.shape[-1] == dv


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_replays_against_the_oracle(causal):
    # the returned keep mask rebuilds the dropped probabilities; forward and gradients match the oracle
    _check(*_inputs(2, 37, 53, 4, 2, 16), causal=causal, dropout_p=0.3)


def test_dropout_is_reproducible_and_seeded():
    q, k, v = _inputs(1, 40, 40, 2, 2, 16)
    dout = torch.randn(1, 40, 2, 16, device=DEV, dtype=DT)

    def run(seed):
        torch.manual_seed(seed)
        out = flashattn.flash_attn_func(q, k, v, dropout_p=0.5)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_dropout_kept_fraction():
    p = 0.25
    q, k, v = _inputs(2, 64, 64, 2, 2, 16)
    _, _, s_dmask = flashattn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    mask = keep_mask(s_dmask, 64, 64)
    n = mask.numel()
    kept = mask.float().mean().item()
    # binomial: 6 standard deviations
    assert abs(kept - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5, kept


def test_dropout_inside_activation_checkpointing():
    # checkpoint replays the forward with torch's RNG state restored, so the mask (and the gradients) repeat
    from torch.utils.checkpoint import checkpoint

    q, k, v = _inputs(1, 40, 40, 2, 2, 16)
    fn = lambda q, k, v: flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True) * 2.0  # noqa: E731
    torch.manual_seed(7)
    plain = torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))
    torch.manual_seed(7)
    ckpt = torch.autograd.grad(checkpoint(fn, q, k, v, use_reentrant=False).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt, strict=True))


def test_everything_at_once():
    # every feature in one call against the oracle, and bitwise the same on a replay with the same seed
    q, k, v = _inputs(2, 41, 47, 4, 2, 24, 16)
    sink = torch.randn(4, device=DEV, requires_grad=True)
    kw = dict(causal=True, window_size=(9, -1), softcap=3.0, alibi_slopes=torch.rand(4, device=DEV),
              dropout_p=0.2, deterministic=True)
    torch.manual_seed(3)
    _check(q, k, v, sink=sink, **kw)
    dout = torch.randn(2, 41, 4, 16, device=DEV, dtype=DT)

    def run():
        torch.manual_seed(3)
        out = flashattn.flash_attn_func(q, k, v, learnable_sink=sink, **kw)
        return (out,) + torch.autograd.grad(out, (q, k, v, sink), dout)

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _varlen(lengths_q, lengths_k, h=4, hk=2, d=16):
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device=DEV)  # noqa: E731
    mk = lambda n, heads: torch.randn(n, heads, d, device=DEV, dtype=DT, requires_grad=True)  # noqa: E731
    return mk(sum(lengths_q), h), mk(sum(lengths_k), hk), mk(sum(lengths_k), hk), cu(lengths_q), cu(lengths_k)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_each_sequence_alone(causal):
    # zero-length and length-1 sequences, sq != sk both ways, window + softcap + ALiBi on top
    lq, lk = [5, 0, 37, 1, 20], [9, 3, 30, 0, 20]
    q, k, v, cu_q, cu_k = _varlen(lq, lk)
    slopes = torch.rand(4, device=DEV)
    kw = dict(causal=causal, window_size=(6, -1), softcap=4.0, alibi_slopes=slopes)
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                   return_attn_probs=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert lse.shape == (4, sum(lq))
    for i in range(len(lq)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lq[i] == 0:
            continue
        if lk[i] == 0:
            assert (out[qs] == 0).all() and torch.isinf(lse[:, qs]).all() and (grads[0][qs] == 0).all()
            continue
        qi, ki, vi = (t[s][None].detach().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        ref, _ = attention_ref(qi, ki, vi, **kw)
        pt, _ = attention_ref(qi, ki, vi, upcast=False, **kw)
        assert_close_to_ref(out[qs][None], ref, pt, name=f"out[{i}]")
        refg = torch.autograd.grad(ref, (qi, ki, vi), dout[qs][None].double())
        ptg = torch.autograd.grad(pt, (qi, ki, vi), dout[qs][None])
        for name, g, s, r, p in zip("qkv", grads, (qs, ks, ks), refg, ptg, strict=True):
            assert_close_to_ref(g[s][None], r, p, factor=3.0, name=f"d{name}[{i}]")


def test_varlen_packed_variants_match():
    lq = [7, 30, 12]
    q, k, v, cu, _ = _varlen(lq, lq, h=2, hk=2)
    qkv = torch.stack([q, k, v], dim=1).detach()
    a = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True)
    b = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 30, causal=True)
    c = flashattn.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 30, 30, causal=True)
    assert torch.equal(a, b) and torch.equal(a, c)
