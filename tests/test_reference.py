import math

import pytest
import torch
from utils import assert_close_to_ref, make_qkv

from flashattn.reference import attention_ref, attention_ref_varlen, blockwise_attention_ref


def naive_attention(
    q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi=None, sink=None,
    qmask=None, kmask=None, dropout_p=0.0, keep=None,
):
    """Scalar loops straight from design.md, sharing no code with the reference."""
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    lse = torch.zeros(b, h, sq, dtype=torch.float64)
    for bi in range(b):
        q_len = sq if qmask is None else int(qmask[bi].sum())
        k_len = sk if kmask is None else int(kmask[bi].sum())
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sq):
                logits, values = [], []
                for j in range(sk):
                    diag = i + k_len - q_len
                    ok = (not causal or j <= diag) and (window[0] < 0 or j >= diag - window[0])
                    ok = ok and (window[1] < 0 or j <= diag + window[1])
                    ok = ok and (qmask is None or bool(qmask[bi, i]))
                    ok = ok and (kmask is None or bool(kmask[bi, j]))
                    if not ok:
                        continue
                    s = float(q[bi, i, hi] @ k[bi, j, kh]) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        slope = float(alibi[hi] if alibi.dim() == 1 else alibi[bi, hi])
                        s -= slope * abs(diag - j)
                    logits.append(s)
                    values.append((j, v[bi, j, kh]))
                extra = [float(sink[hi])] if sink is not None else []
                if not logits and not extra:
                    lse[bi, hi, i] = math.inf
                    continue
                mx = max(logits + extra)
                z = sum(math.exp(s - mx) for s in logits + extra)
                lse[bi, hi, i] = mx + math.log(z)
                for s, (j, vj) in zip(logits, values, strict=True):
                    p = math.exp(s - mx) / z
                    if keep is not None:
                        p = p / (1 - dropout_p) if keep[bi, hi, i, j] else 0.0
                    out[bi, i, hi] += p * vj
    return out, lse


def test_hand_computed():
    # scores [0, ln 2] -> probs [1/3, 2/3]; out = 3/3 + 12/3 = 5; lse = log 3
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, math.log(2)], dtype=torch.float64).view(1, 2, 1, 1)
    v = torch.tensor([3.0, 6.0], dtype=torch.float64).view(1, 2, 1, 1)
    out, lse = attention_ref(q, k, v, softmax_scale=1.0)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == (1, 1, 1, 1) and lse.shape == (1, 1, 1)
    assert out.item() == pytest.approx(5.0, rel=1e-12)
    assert lse.item() == pytest.approx(math.log(3), rel=1e-12)


def _visibility(sq, sk, **kw):
    # q = 0 -> uniform over visible keys; v = identity reads the probabilities off the output
    q = torch.zeros(1, sq, 1, 4)
    k = torch.randn(1, sk, 1, 4)
    v = torch.eye(sk).view(1, sk, 1, sk)
    out, lse = attention_ref(q, k, v, **kw)
    return (out[0, :, 0] > 0).int(), lse[0, 0]


def test_causal_alignment_design_example():
    vis, _ = _visibility(2, 5, causal=True)
    assert vis.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_causal_more_queries_than_keys():
    vis, lse = _visibility(5, 2, causal=True)
    assert vis.tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    assert torch.isposinf(lse[:3]).all() and torch.isfinite(lse[3:]).all()


def test_window_alignment():
    # query i sees [i + 2 - 1, i + 2 + 0] with sk - sq = 2
    vis, _ = _visibility(3, 5, window_size=(1, 0))
    assert vis.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    vis, _ = _visibility(3, 5, window_size=(-1, 1))
    assert vis.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    vis, _ = _visibility(3, 5, window_size=(0, 5), causal=True)
    assert vis.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]


CASES = [
    dict(),
    dict(causal=True),
    dict(window=(2, 1)),
    dict(window=(1, -1)),
    dict(window=(-1, 0)),
    dict(causal=True, window=(2, -1)),
    dict(softcap=0.7, scale=2.0),
    dict(alibi="h"),
    dict(alibi="bh", causal=True),
    dict(sink=True),
    dict(sink=True, causal=True),
    dict(dropout=0.3),
    dict(padding=True),
    dict(padding=True, causal=True, alibi="h"),
    dict(softcap=1.5, alibi="h", sink=True, window=(3, 0), dropout=0.2),
]


def _case(case, sq, sk, h, hk, d=3, dv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = 2
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.float64, dv=dv, generator=g)
    naive_kw = dict(
        causal=case.get("causal", False), scale=case.get("scale"), window=case.get("window", (-1, -1)),
        softcap=case.get("softcap", 0.0),
    )
    ref_kw = dict(
        causal=naive_kw["causal"], softmax_scale=naive_kw["scale"], window_size=naive_kw["window"],
        softcap=naive_kw["softcap"],
    )
    if "alibi" in case:
        shape = (h,) if case["alibi"] == "h" else (b, h)
        naive_kw["alibi"] = ref_kw["alibi_slopes"] = torch.rand(*shape, generator=g)
    if case.get("sink"):
        naive_kw["sink"] = ref_kw["learnable_sink"] = torch.randn(h, generator=g, dtype=torch.float64)
    if "dropout" in case:
        keep = torch.rand(b, h, sq, sk, generator=g) > case["dropout"]
        naive_kw.update(dropout_p=case["dropout"], keep=keep)
        ref_kw.update(dropout_p=case["dropout"], dropout_mask=keep)
    if case.get("padding"):
        qmask = torch.arange(sq).view(1, -1) < torch.tensor([[sq], [max(sq - 2, 1)]])
        kmask = torch.arange(sk).view(1, -1) < torch.tensor([[max(sk - 3, 1)], [sk]])
        naive_kw.update(qmask=qmask, kmask=kmask)
        ref_kw.update(query_padding_mask=qmask, key_padding_mask=kmask)
    return (q, k, v), naive_kw, ref_kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("sq,sk,h,hk", [(4, 6, 4, 2), (6, 3, 2, 2), (5, 5, 3, 1)])
def test_matches_naive_loops(case, sq, sk, h, hk):
    (q, k, v), naive_kw, ref_kw = _case(case, sq, sk, h, hk)
    out_n, lse_n = naive_attention(q, k, v, **naive_kw)
    out, lse = attention_ref(q, k, v, **ref_kw)
    torch.testing.assert_close(out, out_n, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_n, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_n", [1, 3, 64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_blockwise_equals_dense(case, block_n):
    (q, k, v), _, ref_kw = _case(case, 7, 11, 4, 2, d=5, dv=6, seed=1)
    out, lse = attention_ref(q, k, v, **ref_kw)
    out_b, lse_b = blockwise_attention_ref(q, k, v, block_n=block_n, **ref_kw)
    assert out_b.dtype == torch.float64
    torch.testing.assert_close(out_b, out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse_b, lse, rtol=1e-12, atol=1e-13)


def test_blockwise_long_causal_gqa():
    q, k, v = make_qkv(1, 130, 200, 4, 1, 16, torch.float32, dv=8)
    out, lse = attention_ref(q, k, v, causal=True, window_size=(50, -1))
    out_b, lse_b = blockwise_attention_ref(q, k, v, causal=True, window_size=(50, -1), block_n=32)
    torch.testing.assert_close(out_b, out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse_b, lse, rtol=1e-12, atol=1e-13)


def test_padding_equals_per_sequence():
    b, s, h = 3, 9, 2
    q, k, v = make_qkv(b, s, s, h, h, 4, torch.float64)
    lens_q, lens_k = [9, 4, 6], [7, 9, 2]
    qmask = torch.arange(s).view(1, -1) < torch.tensor(lens_q).view(-1, 1)
    kmask = torch.arange(s).view(1, -1) < torch.tensor(lens_k).view(-1, 1)
    out, lse = attention_ref(q, k, v, causal=True, query_padding_mask=qmask, key_padding_mask=kmask)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        o1, l1 = attention_ref(q[i : i + 1, :lq], k[i : i + 1, :lk], v[i : i + 1, :lk], causal=True)
        torch.testing.assert_close(out[i : i + 1, :lq], o1)
        torch.testing.assert_close(lse[i : i + 1, :, :lq], l1)
        assert (out[i, lq:] == 0).all() and torch.isposinf(lse[i, :, lq:]).all()


@pytest.mark.parametrize("sink", [False, True])
def test_zero_keys(sink):
    # seqlen_k = 0: every row sees nothing (out 0, lse +inf or the sink), in both references
    q = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    k = torch.randn(1, 0, 2, 4, dtype=torch.float64)
    sink_t = torch.tensor([0.5, -1.0], dtype=torch.float64) if sink else None
    for fn in (attention_ref, blockwise_attention_ref):
        out, lse = fn(q, k, k[..., :3], learnable_sink=sink_t)
        assert out.shape == (1, 3, 2, 3) and (out == 0).all()
        expected = sink_t.view(1, 2, 1).expand(1, 2, 3) if sink else torch.full((1, 2, 3), math.inf)
        torch.testing.assert_close(lse, expected.double())


def test_varlen_equals_padding_masks():
    lens_q, lens_k, s, h = [9, 0, 4, 6, 1], [7, 3, 9, 0, 1], 9, 4
    b = len(lens_q)
    q, k, v = make_qkv(b, s, s, h, 2, 8, torch.float64, dv=5)
    qmask = torch.arange(s).view(1, -1) < torch.tensor(lens_q).view(-1, 1)
    kmask = torch.arange(s).view(1, -1) < torch.tensor(lens_k).view(-1, 1)
    keep = torch.rand(b, h, s, s) > 0.3
    kw = dict(causal=True, window_size=(3, -1), softcap=2.0, alibi_slopes=torch.rand(b, h),
              learnable_sink=torch.randn(h), dropout_p=0.3, dropout_mask=keep)
    out, lse = attention_ref(q, k, v, query_padding_mask=qmask, key_padding_mask=kmask, **kw)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    # two spare tokens past cu_seqlens_q[-1]: out 0, lse +inf
    qv = torch.cat([q[qmask], torch.randn(2, h, 8, dtype=torch.float64)])
    out_v, lse_v = attention_ref_varlen(qv, k[kmask], v[kmask], cu_q, cu_k, **kw)
    assert out_v.shape == (sum(lens_q) + 2, h, 5) and lse_v.shape == (h, sum(lens_q) + 2)
    torch.testing.assert_close(out_v[:-2], out[qmask])
    torch.testing.assert_close(lse_v[:, :-2], lse.transpose(0, 1)[:, qmask])
    assert (out_v[-2:] == 0).all() and torch.isposinf(lse_v[:, -2:]).all()
    out_lp, lse_lp = attention_ref_varlen(qv.float(), k[kmask].float(), v[kmask].float(), cu_q, cu_k,
                                          upcast=False, **kw)
    assert out_lp.dtype == torch.float32 and lse_lp.dtype == torch.float32


def test_gqa_equals_repeated_kv():
    q, k, v = make_qkv(2, 5, 7, 6, 2, 4, torch.float64)
    out, lse = attention_ref(q, k, v, causal=True)
    # head i reads kv head i // 3
    k_rep = k[:, :, [0, 0, 0, 1, 1, 1]]
    v_rep = v[:, :, [0, 0, 0, 1, 1, 1]]
    out_r, lse_r = attention_ref(q, k_rep, v_rep, causal=True)
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(lse, lse_r)


@pytest.mark.parametrize("sink", [False, True])
def test_fully_masked_rows(sink):
    q, k, v = make_qkv(1, 6, 3, 2, 1, 4, torch.float64, requires_grad=True)
    sink_t = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True) if sink else None
    for fn in (attention_ref, blockwise_attention_ref):
        out, lse = fn(q, k, v, causal=True, learnable_sink=sink_t)
        # rows 0..2 see no key (j <= i - 3)
        assert (out[:, :3] == 0).all() and torch.isfinite(out).all()
        if sink:
            torch.testing.assert_close(lse[0, :, :3], sink_t.detach().view(2, 1).expand(2, 3))
        else:
            assert torch.isposinf(lse[:, :, :3]).all()
        assert torch.isfinite(lse[:, :, 3:]).all()
        inputs = (q, k, v) + ((sink_t,) if sink else ())
        grads = torch.autograd.grad(out.sum() + lse[:, :, 3:].sum(), inputs)
        for g_ in grads:
            assert torch.isfinite(g_).all()
        assert (grads[0][:, :3] == 0).all()


def test_all_keys_masked_no_nan():
    q, k, v = make_qkv(1, 3, 4, 1, 1, 2, torch.float64, requires_grad=True)
    kmask = torch.zeros(1, 4, dtype=torch.bool)
    out, lse = attention_ref(q, k, v, key_padding_mask=kmask)
    assert (out == 0).all() and torch.isposinf(lse).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all((g_ == 0).all() for g_ in grads)


def test_gradcheck_all_features():
    g = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(1, 4, 5, 2, 1, 3, torch.float64, dv=2, requires_grad=True, generator=g)
    slopes = torch.rand(2, generator=g)
    sink = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sink):
        out, lse = attention_ref(
            q, k, v, causal=True, window_size=(2, -1), softcap=1.3, alibi_slopes=slopes, learnable_sink=sink
        )
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, sink))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reorder_ops", [False, True])
def test_low_precision_baseline(dtype, reorder_ops):
    q, k, v = make_qkv(2, 33, 47, 4, 2, 16, dtype, dv=8)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    out_pt, lse_pt = attention_ref(q, k, v, causal=True, upcast=False, reorder_ops=reorder_ops)
    assert out_pt.dtype == dtype and lse_pt.dtype == torch.float32
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out_pt.double(), out_ref, atol=tol, rtol=0)
    torch.testing.assert_close(lse_pt.double(), lse_ref, atol=tol, rtol=0)


def test_upcast_false_gradients_flow():
    q, k, v = make_qkv(1, 5, 3, 2, 2, 4, torch.float16, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True, upcast=False)
    grads = torch.autograd.grad(out.float().sum() + lse[torch.isfinite(lse)].sum(), (q, k, v))
    assert all(torch.isfinite(g_).all() and g_.dtype == torch.float16 for g_ in grads)


def test_argument_errors():
    q, k, v = make_qkv(1, 3, 3, 4, 3, 8)
    with pytest.raises(ValueError, match="multiple of nheads_k"):
        attention_ref(q, k, v)
    q, k, v = make_qkv(1, 3, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_ref(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention_ref(q, k, v, alibi_slopes=torch.ones(3))


# -- the helpers in tests/utils.py


def test_assert_close_to_ref_rule():
    ref = torch.tensor([1.0, 2.0, math.inf], dtype=torch.float64)
    pt = torch.tensor([1.1, 2.0, math.inf])
    assert_close_to_ref(torch.tensor([1.15, 2.0, math.inf]), ref, pt)
    with pytest.raises(AssertionError, match="max err"):
        assert_close_to_ref(torch.tensor([1.3, 2.0, math.inf]), ref, pt)
    with pytest.raises(AssertionError, match="inf"):
        assert_close_to_ref(torch.tensor([1.0, 2.0, 5.0]), ref, pt)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_ref(torch.tensor([math.nan, 2.0, math.inf]), ref, pt)


def test_make_qkv_strided():
    q, k, v = make_qkv(2, 5, 5, 3, 3, 8, layout="strided")
    assert not q.is_contiguous() and q.stride(-1) == 1 and q.shape == (2, 5, 3, 8)
    q, k, v = make_qkv(2, 5, 7, 4, 2, 8, dv=6, layout="strided")
    assert q.shape == (2, 5, 4, 8) and k.shape == (2, 7, 2, 8) and v.shape == (2, 7, 2, 6)
    assert all(not t.is_contiguous() and t.stride(-1) == 1 for t in (q, k, v))


@pytest.mark.parametrize("q_scales", ["tensor", "head", "kv-head"])
def test_fp8_scores_equal_the_dequantised_product(q_scales):
    # the FP8 baseline's q·k (torch._scaled_mm per batch and head, sizes padded to 16): on the CPU its
    # accumulation is float32, so it equals the float32 product of the dequantised values but for rounding;
    # odd lengths and head dim, GQA, every descale layout
    from flashattn.reference import dequantize_fp8, fp8_scores

    g = torch.Generator().manual_seed(0)
    b, sq, sk, h, hk, d = 2, 37, 21, 6, 2, 59
    q8 = (torch.randn(b, sq, h, d, generator=g) * 4).to(torch.float8_e4m3fn)
    k8 = (torch.randn(b, sk, hk, d, generator=g) * 4).to(torch.float8_e4m3fn)
    heads = {"tensor": None, "head": h, "kv-head": hk}[q_scales]
    qd = torch.rand(1, generator=g) + 0.5 if heads is None else torch.rand(b, heads, generator=g) + 0.5
    kd = torch.rand(b, hk, generator=g) + 0.5
    q, k = dequantize_fp8(q8, qd, torch.float32), dequantize_fp8(k8, kd, torch.float32)
    expected = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(h // hk, dim=2))
    got = fp8_scores(q8, k8, qd, kd)
    assert got.shape == (b, h, sq, sk) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
