"""Training features of the torch backend against the fp64 oracle: dropout (replayed with the shared
keep-mask), learnable sinks (and their gradient), dv != d, the varlen layout, and all of them combined.

Chunks are shrunk to 32 so that small shapes still cross chunk boundaries.  Tolerance: tests/utils.py's rule
(2x / 3x the plain-PyTorch low-precision error of the same computation, plus a tiny floor).
"""

import math

import pytest
import torch
from torch_backend_checks import fwd_bwd, hold_chunked_route
from utils import assert_close_to_ref, make_qkv

import flashattn.backends.torch.attention as tb
from flashattn.backends.torch import tiles as tb_tiles
from flashattn.bert_padding import pad_input, unpad_input
from flashattn.dropout import dropout_keep_mask
from flashattn.reference import attention_ref, attention_ref_varlen


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(tb_tiles, "_MIN_CHUNK", 32)
    monkeypatch.setattr(tb_tiles, "_MAX_CHUNK", 32)
    # the chunked route for every call, plain ones included (the fused route: test_fused.py)
    hold_chunked_route(monkeypatch)


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _lengths(cu):
    return [b - a for a, b in zip(cu.tolist(), cu.tolist()[1:], strict=False)]


def _keep_mask(q, k, kw, cu, max_seqlen):
    """The keep-mask a forward with these arguments uses, in the oracle's layout."""
    p = kw.get("dropout_p", 0.0)
    if p == 0.0:
        return None
    seed, offset, h = kw.get("rng_seed", 0), kw.get("rng_offset", 0), q.shape[-2]
    if cu is None:
        return dropout_keep_mask(seed, offset, q.shape[0], h, q.shape[1], k.shape[1], p)
    lq, lk = _lengths(cu[0]), _lengths(cu[1])
    return dropout_keep_mask(
        seed, offset, len(lq), h, max(lq), max(lk), p, max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1]
    )


def run_case(q, k, v, *, sink=None, cu=None, max_seqlen=None, grads=True, **kw):
    """Forward and backward of the backend vs the fp64 oracle; returns (out, lse, (dq, dk, dv, dsink))."""
    kw.setdefault("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    kw.setdefault("causal", False)
    call = dict(kw, learnable_sink=sink)
    if cu is not None:
        call.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
        if max_seqlen is not None:
            call.update(max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1])
        else:
            max_seqlen = (max(_lengths(cu[0])), max(_lengths(cu[1])))
    out, lse = tb.attention_forward(q, k, v, **call)
    assert out.dtype == q.dtype and out.shape == q.shape[:-1] + v.shape[-1:]
    h = q.shape[-2]
    assert lse.dtype == torch.float32
    assert lse.shape == ((h, q.shape[0]) if cu is not None else (q.shape[0], h, q.shape[1]))

    ref_kw = {n: x for n, x in kw.items() if n not in ("rng_seed", "rng_offset")}
    ref_kw["dropout_mask"] = _keep_mask(q, k, kw, cu, max_seqlen)

    def oracle(q_, k_, v_, s_, **extra):
        if cu is None:
            return attention_ref(q_, k_, v_, learnable_sink=s_, **ref_kw, **extra)
        return attention_ref_varlen(q_, k_, v_, cu[0], cu[1], learnable_sink=s_, **ref_kw, **extra)

    leaves64 = [_leaf(t, torch.float64) for t in (q, k, v, sink)]
    leaves_pt = [_leaf(t) for t in (q, k, v, sink)]
    out_ref, lse_ref = oracle(*leaves64)
    out_pt, lse_pt = oracle(*leaves_pt, upcast=False)
    assert_close_to_ref(out, out_ref, out_pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, name="lse")
    if not grads:
        return out, lse, None

    dout = torch.randn_like(out)
    res = tb.attention_backward(dout, q, k, v, out, lse, **call)
    for g_, x in zip(res[:3], (q, k, v), strict=True):
        assert g_.dtype == x.dtype and g_.shape == x.shape
    n = 3 if sink is None else 4
    assert (res[3] is None) == (sink is None)
    g_ref = torch.autograd.grad(out_ref, leaves64[:n], dout.double())
    g_pt = torch.autograd.grad(out_pt, leaves_pt[:n], dout)
    for name, g_, gr, gp in zip(("dq", "dk", "dv", "dsink"), res[:n], g_ref, g_pt, strict=False):
        assert_close_to_ref(g_, gr, gp, factor=3.0, name=name)
    if sink is not None:
        assert res[3].dtype == torch.float32 and res[3].shape == sink.shape
    return out, lse, res


LOW = [torch.float16, torch.float32]
IDS = ["fp16", "fp32"]


# -- dropout ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(45, 70), (70, 33), (1, 40)])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_replays_the_mask(p, sq, sk, causal, dtype):
    q, k, v = make_qkv(2, sq, sk, 4, 2, 32, dtype)
    run_case(q, k, v, causal=causal, dropout_p=p, rng_seed=1234, rng_offset=2**33 + 17)


def test_dropout_zero_is_no_dropout():
    q, k, v = make_qkv(2, 40, 50, 2, 2, 16)
    base = tb.attention_forward(q, k, v, softmax_scale=0.25, causal=True)
    zero = tb.attention_forward(q, k, v, softmax_scale=0.25, causal=True, dropout_p=0.0, rng_seed=9)
    assert all(torch.equal(a, b) for a, b in zip(base, zero, strict=True))


def test_dropout_determinism_and_seeds():
    q, k, v = make_qkv(2, 50, 60, 4, 2, 16)
    dout = torch.randn(2, 50, 4, 16)
    kw = dict(softmax_scale=0.25, causal=False, dropout_p=0.3, rng_seed=7, rng_offset=0)
    first, again = fwd_bwd(q, k, v, dout, **kw), fwd_bwd(q, k, v, dout, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    for change in (dict(rng_seed=8), dict(rng_offset=4 * 50 * 60)):
        other = fwd_bwd(q, k, v, dout, **dict(kw, **change))
        assert torch.equal(first[1], other[1])  # lse is the un-dropped one
        for a, b in zip(first[:1] + first[2:], other[:1] + other[2:], strict=True):
            assert not torch.equal(a, b)


def test_dropout_expectation():
    # E[out] over masks is the un-dropped output: the average of 64 seeds is within a few standard errors
    q, k, v = make_qkv(1, 8, 16, 1, 1, 8, torch.float64)
    plain, _ = tb.attention_forward(q, k, v, softmax_scale=0.5, causal=False)
    outs = torch.stack([
        tb.attention_forward(q, k, v, softmax_scale=0.5, causal=False, dropout_p=0.4, rng_seed=s)[0]
        for s in range(64)
    ])
    err = (outs.mean(0) - plain).abs()
    assert (err <= 6 * outs.std(0) / 8 + 1e-12).all()


# -- learnable sink -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("sink_scale", [1.0, 8.0])
def test_sink(sink_scale, dtype):
    # causal with sq > sk: the first rows see no key, so they hold only the sink (out 0, lse = sink)
    q, k, v = make_qkv(2, 70, 40, 4, 2, 32, dtype)
    sink = torch.randn(4) * sink_scale
    out, lse, (dq, *_) = run_case(q, k, v, causal=True, sink=sink)
    assert torch.equal(lse[:, :, :30], sink.view(1, 4, 1).expand(2, 4, 30))
    assert (out[:, :30] == 0).all() and (dq[:, :30] == 0).all()


def test_sink_gradient_formula():
    # d loss / d sink_h = -sum_rows exp(sink_h - lse) * rowsum(dO * O), checked in fp64 against autograd
    q, k, v = make_qkv(2, 37, 29, 3, 1, 8, torch.float64)
    sink = torch.randn(3, dtype=torch.float64)
    out, lse = tb.attention_forward(q, k, v, softmax_scale=0.3, causal=False, learnable_sink=sink)
    dout = torch.randn_like(out)
    dsink = tb.attention_backward(dout, q, k, v, out, lse, softmax_scale=0.3, causal=False,
                                  learnable_sink=sink)[3]
    s = sink.clone().requires_grad_()
    out_ref, _ = attention_ref(q, k, v, softmax_scale=0.3, learnable_sink=s)
    (g,) = torch.autograd.grad(out_ref, s, dout)
    formula = -(torch.exp(sink.view(1, 3, 1) - lse) * (dout * out).sum(-1).transpose(1, 2)).sum((0, 2))
    torch.testing.assert_close(dsink, g, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(formula, g, rtol=1e-10, atol=1e-12)


def test_minus_inf_sink_is_no_sink():
    q, k, v = make_qkv(1, 30, 20, 2, 2, 8)
    kw = dict(softmax_scale=0.3, causal=True)
    plain = tb.attention_forward(q, k, v, **kw)
    sunk = tb.attention_forward(q, k, v, learnable_sink=torch.full((2,), -math.inf), **kw)
    assert torch.equal(plain[0], sunk[0]) and torch.equal(plain[1], sunk[1])


# -- dv != d ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("d,dv", [(40, 24), (16, 72), (64, 1)])
def test_value_head_dim(d, dv, dtype):
    q, k, v = make_qkv(2, 45, 66, 4, 1, d, dtype, dv=dv)
    run_case(q, k, v, causal=True, dropout_p=0.2, rng_seed=3)


# -- everything together, padded ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("sq,sk", [(66, 90), (90, 47)])
def test_all_features_padded(sq, sk, dtype):
    b, h = 2, 6
    q, k, v = make_qkv(b, sq, sk, h, 2, 40, dtype, dv=24, layout="strided")
    run_case(
        q, k, v, causal=True, window_size=(25, -1), softcap=3.0, alibi_slopes=torch.rand(b, h) * 0.2,
        dropout_p=0.25, rng_seed=11, rng_offset=5, sink=torch.randn(h),
    )


# -- varlen -------------------------------------------------------------------------------------------------


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def make_varlen(lens_q, lens_k, h, hk, d, dtype=torch.float32, dv=None):
    q, k, v = make_qkv(1, sum(lens_q), sum(lens_k), h, hk, d, dtype, dv=dv)
    return q[0], k[0], v[0], (_cu(lens_q), _cu(lens_k))


# zero-length and length-1 sequences, chunk tails, sq > sk and sq < sk in one batch
LENS_Q = [3, 0, 40, 1, 17, 70, 5]
LENS_K = [5, 7, 0, 1, 33, 50, 0]


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal, dtype):
    q, k, v, cu = make_varlen(LENS_Q, LENS_K, 4, 2, 32, dtype)
    out, lse, _ = run_case(q, k, v, cu=cu, causal=causal)
    # the sequence with no keys: out 0, lse +inf
    assert (out[3:43] == 0).all() and torch.isposinf(lse[:, 3:43]).all()


def test_varlen_equals_padded_per_sequence():
    # without dropout a varlen call is exactly the padded calls on each sequence alone, bit for bit
    q, k, v, cu = make_varlen(LENS_Q, LENS_K, 4, 2, 24, dv=16)
    slopes, sink = torch.rand(len(LENS_Q), 4), torch.randn(4)
    kw = dict(softmax_scale=0.2, causal=True, window_size=(9, 3), softcap=2.0, learnable_sink=sink)
    vkw = dict(kw, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], alibi_slopes=slopes)
    out, lse = tb.attention_forward(q, k, v, **vkw)
    dout = torch.randn_like(out)
    grads = tb.attention_backward(dout, q, k, v, out, lse, **vkw)
    dsink = torch.zeros(4)
    cq, ck = cu[0].tolist(), cu[1].tolist()
    for b in range(len(LENS_Q)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = [x[s].unsqueeze(0) for x, s in ((q, qs), (k, ks), (v, ks))]
        o, lse_b = tb.attention_forward(*one, alibi_slopes=slopes[b], **kw)
        assert torch.equal(out[qs], o[0]) and torch.equal(lse[:, qs], lse_b[0])
        g = tb.attention_backward(dout[qs].unsqueeze(0), *one, o, lse_b, alibi_slopes=slopes[b], **kw)
        for full, part, s in zip(grads[:3], g[:3], (qs, ks, ks), strict=True):
            assert torch.equal(full[s], part[0])
        dsink += g[3]
    torch.testing.assert_close(grads[3], dsink, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_varlen_all_features(dtype):
    b, h = len(LENS_Q), 6
    q, k, v, cu = make_varlen(LENS_Q, LENS_K, h, 3, 40, dtype, dv=24)
    run_case(
        q, k, v, cu=cu, max_seqlen=(75, 52), causal=True, window_size=(20, -1), softcap=3.0,
        alibi_slopes=torch.rand(b, h) * 0.2, dropout_p=0.2, rng_seed=5, rng_offset=99, sink=torch.randn(h),
    )


def test_varlen_dropout_counters_follow_max_seqlen():
    # the mask of a sequence depends on its batch index and on the max_seqlen strides, not on its neighbours
    q, k, v, cu = make_varlen([20, 30], [25, 35], 2, 2, 8)
    kw = dict(softmax_scale=0.3, causal=False, dropout_p=0.5, rng_seed=1)
    kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    a, _ = tb.attention_forward(q, k, v, max_seqlen_q=30, max_seqlen_k=35, **kw)
    b, _ = tb.attention_forward(q, k, v, max_seqlen_q=64, max_seqlen_k=64, **kw)
    assert not torch.equal(a, b)
    run_case(q, k, v, cu=cu, max_seqlen=(64, 64), dropout_p=0.5, rng_seed=1)


def test_varlen_matches_padded_batch_through_bert_padding():
    # unpad a right/left padded batch, run varlen, pad back: the padded oracle with padding masks agrees
    b, s, h = 3, 50, 2
    qmask = torch.arange(s).view(1, -1) < torch.tensor([50, 13, 0]).view(-1, 1)
    kmask = torch.arange(s).view(1, -1) >= torch.tensor([0, 20, 44]).view(-1, 1)  # left padding
    q, k, v = make_qkv(b, s, s, h, h, 16, torch.float64)
    qu, qi, cu_q, mq, _ = unpad_input(q, qmask)
    ku, _, cu_k, mk, _ = unpad_input(k, kmask)
    vu, *_ = unpad_input(v, kmask)
    out_u, _ = tb.attention_forward(qu, ku, vu, softmax_scale=0.25, causal=True, cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    # the oracle aligns rows left: it needs each sequence's real keys first, so compare per sequence
    out = pad_input(out_u, qi, b, s)
    for bi in range(b):
        kb = k[bi][kmask[bi]].unsqueeze(0)
        vb = v[bi][kmask[bi]].unsqueeze(0)
        ref, _ = attention_ref(q[bi][qmask[bi]].unsqueeze(0), kb, vb, softmax_scale=0.25, causal=True)
        torch.testing.assert_close(out[bi][qmask[bi]], ref[0], rtol=1e-12, atol=1e-12)
    assert (out[~qmask] == 0).all()


def test_varlen_empty_batch_and_tail_tokens():
    # tokens past cu_seqlens_q[-1] are untouched: out 0, lse +inf, zero gradients
    q, k, v, cu = make_varlen([0, 0], [0, 4], 2, 1, 8)
    q = torch.randn(3, 2, 8)
    out, lse = tb.attention_forward(q, k, v, softmax_scale=0.3, causal=False, cu_seqlens_q=cu[0],
                                    cu_seqlens_k=cu[1])
    assert (out == 0).all() and torch.isposinf(lse).all() and lse.shape == (2, 3)
    grads = tb.attention_backward(torch.randn_like(out), q, k, v, out, lse, softmax_scale=0.3, causal=False,
                                  cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    assert all((g == 0).all() for g in grads[:3])


def test_varlen_argument_errors():
    q, k, v, cu = make_varlen([4, 5], [6, 7], 2, 1, 8)
    kw = dict(softmax_scale=0.3, causal=False)
    with pytest.raises(ValueError, match="3-D"):
        tb.attention_forward(q.unsqueeze(0), k, v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], **kw)
    with pytest.raises(ValueError, match="both"):
        tb.attention_forward(q, k, v, cu_seqlens_q=cu[0], **kw)
    with pytest.raises(ValueError, match="batch \\+ 1"):
        tb.attention_forward(q, k, v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1][:2], **kw)
    with pytest.raises(ValueError, match="non-decreasing"):
        tb.attention_forward(q, k, v, cu_seqlens_q=torch.tensor([0, 5, 4], dtype=torch.int32),
                             cu_seqlens_k=cu[1], **kw)
    with pytest.raises(ValueError, match="non-decreasing"):
        tb.attention_forward(q, k, v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1] + 1, **kw)
    with pytest.raises(ValueError, match="max_seqlen"):
        tb.attention_forward(q, k, v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=4, **kw)
    with pytest.raises(ValueError, match="alibi_slopes"):
        tb.attention_forward(q, k, v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], alibi_slopes=torch.ones(3, 2),
                             **kw)


def test_feature_argument_errors():
    q, k, v = make_qkv(1, 4, 4, 4, 2, 8)
    kw = dict(softmax_scale=0.3, causal=False)
    with pytest.raises(ValueError, match="learnable_sink"):
        tb.attention_forward(q, k, v, learnable_sink=torch.zeros(2), **kw)
    with pytest.raises(ValueError, match="dropout_p"):
        tb.attention_forward(q, k, v, dropout_p=1.0, **kw)
    with pytest.raises(ValueError, match="head dim"):
        tb.attention_forward(q, k, v[:, :3], **kw)
