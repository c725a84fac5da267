"""The torch backend's fused route (ATen's CPU flash-attention kernel, backends/torch/fused.py): which calls
take it, and those calls against the fp64 oracle under the tolerance rule at odd shapes, GQA, 16-bit and
float64 inputs (float32 ones stay chunked), strided inputs and extreme scales; each test asserts the route
its calls took, so that a silent fallback to the chunked route (or the reverse) fails here."""

import math

import pytest
import torch
from torch_backend_checks import fwd_bwd, hold_chunked_route, leaf64, recorded, run_and_check
from utils import assert_close_to_ref, make_qkv

import flashattn.backends.torch.attention as tb
from flashattn import config, flash_attn_func, flash_attn_varlen_func
from flashattn.backends.torch import fused
from flashattn.backends.torch.tiles import Spec
from flashattn.reference import attention_ref

CPU = torch.device("cpu")


def _spec(causal=False, window=(-1, -1), softcap=0.0, dropout_p=0.0):
    return Spec(softmax_scale=1.0, causal=causal, window_size=window, softcap=softcap, dropout_p=dropout_p,
                rng_seed=0, rng_offset=0, cdtype=torch.float32)


@pytest.mark.parametrize("causal,window,sq,sk,kind", [
    (False, (-1, -1), 17, 113, fused.FULL),
    (False, (-1, -1), 113, 17, fused.FULL),
    (True, (-1, -1), 113, 113, fused.CAUSAL),
    (True, (-1, -1), 1, 113, fused.FULL),  # one query, aligned with the last key: it sees every key
    (True, (-1, -1), 17, 113, None),  # the bottom-right diagonal misses key 0 for query 0
    (True, (-1, -1), 113, 17, None),  # rows that see no key
    (False, (-1, 0), 50, 50, fused.CAUSAL),  # causal spelled as a window
    (False, (-1, 96), 113, 17, fused.CAUSAL),  # a diagonal through key 0 for query 0
    (False, (99, -1), 50, 100, fused.FULL),  # the last query's left edge at key 0: hides nothing
    (False, (98, -1), 50, 100, None),
    (False, (-1, 49), 50, 50, fused.FULL),  # the first query's right edge at the last key
    (False, (-1, 48), 50, 50, None),
    (True, (10, -1), 50, 50, None),
    (False, (20, 5), 50, 50, None),
    (True, (-1, -1), 1, 1, fused.FULL),
])
def test_mask_kind(causal, window, sq, sk, kind):
    kw = dict(dtype=torch.bfloat16, device=CPU, alibi=False, sink=False)
    assert fused.mask_kind(_spec(causal, window), sq, sk, 32, 32, **kw) == kind


@pytest.mark.parametrize("change",
                         ["float32", "cuda", "dv", "alibi", "sink", "softcap", "dropout", "no keys"])
def test_mask_kind_keeps_other_calls_chunked(change):
    args = dict(spec=_spec(), sq=17, sk=33, d=32, dv=32, dtype=torch.float16, device=CPU, alibi=False,
                sink=False)
    assert fused.mask_kind(**args) == fused.FULL
    assert fused.mask_kind(**{**args, "dtype": torch.float64}) == fused.FULL
    changed = {"float32": dict(dtype=torch.float32), "cuda": dict(device=torch.device("cuda")),
               "dv": dict(dv=16), "alibi": dict(alibi=True),
               "sink": dict(sink=True), "softcap": dict(spec=_spec(softcap=5.0)),
               "dropout": dict(spec=_spec(dropout_p=0.1)), "no keys": dict(sk=0)}[change]
    assert fused.mask_kind(**{**args, **changed}) is None


@pytest.fixture
def routes(monkeypatch):
    """The names of the route functions the torch backend calls, in order."""
    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    for name in ("forward_fused", "backward_fused"):
        spy(fused, name)
    for name in ("forward_group", "backward_group"):
        spy(tb, name)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 17), (17, 113), (113, 17), (113, 113), (64, 96)])
def test_seqlens(routes, sq, sk, causal, dtype):
    q, k, v = make_qkv(2, sq, sk, 4, 4, 40, dtype)
    kind = fused.mask_kind(_spec(causal), sq, sk, 40, 40, dtype=dtype, device=CPU, alibi=False, sink=False)
    run_and_check(q, k, v, causal=causal)
    expect = ["forward_fused", "backward_fused"] if kind else ["forward_group", "backward_group"]
    assert routes == expect
    # 16-bit calls without a mask, and causal ones whose diagonal runs from key 0, take the fused route
    assert (kind is not None) == (dtype != torch.float32 and (not causal or sq == sk or sq == 1))


def test_float64_is_exact(routes):
    q, k, v = make_qkv(1, 50, 70, 2, 1, 8, torch.float64)
    kw = dict(softmax_scale=0.4, causal=False)
    dout = torch.randn_like(q)
    out, lse, *grads = fwd_bwd(q, k, v, dout, **kw)
    assert lse.dtype == torch.float64
    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out_ref, lse_ref = attention_ref(q64, k64, v64, **kw)
    grads_ref = torch.autograd.grad(out_ref, (q64, k64, v64), dout)
    for got, want in zip((out, lse, *grads), (out_ref, lse_ref, *grads_ref), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    assert routes == ["forward_fused", "backward_fused"]


@pytest.mark.parametrize("sq,sk,window", [(113, 17, (-1, 96)), (50, 100, (99, -1)), (50, 50, (-1, 49)),
                                           (40, 40, (-1, 0))])
def test_windows_that_take_the_route(routes, sq, sk, window):
    # bands the fused kernel computes: a diagonal through key 0 for query 0 (sq > sk here: ATen's top-left
    # causal mask with more queries than keys), and left or right edges past every key
    q, k, v = make_qkv(1, sq, sk, 4, 4, 32, torch.bfloat16)
    run_and_check(q, k, v, window_size=window)
    assert routes == ["forward_fused", "backward_fused"]


@pytest.mark.parametrize("d", [40, 59, 96, 192, 256])
def test_head_dims(routes, d):
    q, k, v = make_qkv(1, 65, 65, 4, 4, d, torch.float16)
    run_and_check(q, k, v, causal=True)
    assert routes == ["forward_fused", "backward_fused"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(8, 2), (8, 1), (3, 3)])
def test_gqa_mqa(routes, h, hk, causal):
    # without a mask the group's query rows stacked, under a causal one k and v repeated (fused._layout)
    q, k, v = make_qkv(2, 70, 70, h, hk, 32, torch.bfloat16)
    run_and_check(q, k, v, causal=causal)
    assert routes == ["forward_fused", "backward_fused"]


@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_1023(routes, causal):
    q, k, v = make_qkv(1, 1023, 1023, 2, 2, 32, torch.float16)
    run_and_check(q, k, v, causal=causal)
    assert routes == ["forward_fused", "backward_fused"]


def test_strided_inputs(routes):
    q, k, v = make_qkv(2, 37, 90, 4, 2, 48, torch.float16, layout="strided")
    assert not q.is_contiguous()
    out, lse, _ = run_and_check(q, k, v)
    out_c, lse_c = tb.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                        softmax_scale=48**-0.5, causal=False)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert routes == ["forward_fused", "backward_fused", "forward_fused"]


@pytest.mark.parametrize("layout", ["seqlen-contiguous v", "stride-0 batch"])
def test_other_strides(routes, layout):
    # ATen's kernel reads a row's head dim as contiguous: a V laid out seqlen-contiguous (the FP8 path's
    # layout, dequantised) is copied first, or its outputs are wrong (the torch backend's fuzz found it);
    # a batch broadcast with stride 0 is read in place
    if layout == "seqlen-contiguous v":
        # the fuzz's case (an FP8 call's dequantised V): one head, (b, h, d, s) in memory
        q, k, v = make_qkv(1, 16, 16, 1, 1, 32, torch.float16)
        v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        assert v.stride(1) == 1 and v.stride(3) != 1
    else:
        q, k, v = make_qkv(3, 20, 40, 4, 2, 16, torch.float16)
        k, v = (x[:1].expand(3, -1, -1, -1) for x in (k, v))
    run_and_check(q, k, v)
    assert routes == ["forward_fused", "backward_fused"]


@pytest.mark.parametrize("seed", range(3))
def test_extreme_scale_fp16(routes, seed):
    # softmax_scale 30 on N(0, 1) inputs: logits of standard deviation ~120, nearly one-hot rows
    torch.manual_seed(seed)
    q, k, v = make_qkv(1, 90, 75, 2, 2, 16, torch.float16)
    out, lse, grads = run_and_check(q, k, v, softmax_scale=30.0)
    for t in (out, lse, *grads):
        assert torch.isfinite(t).all()
    assert routes == ["forward_fused", "backward_fused"]


def test_fused_and_chunked_routes_agree(routes, monkeypatch):
    # float64 on both routes: the same values to float64's rounding
    q, k, v = make_qkv(2, 70, 70, 4, 4, 32, torch.float64)
    kw = dict(softmax_scale=0.2, causal=True)
    dout = torch.randn_like(q)
    on_fused = fwd_bwd(q, k, v, dout, **kw)
    hold_chunked_route(monkeypatch)
    for a, b in zip(on_fused, fwd_bwd(q, k, v, dout, **kw), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert routes == ["forward_fused", "backward_fused", "forward_group", "backward_group"]


@pytest.mark.parametrize("causal,hk", [(True, 4), (True, 2), (False, 2)])
def test_makes_no_n_by_n_tensor(routes, causal, hk):
    # the fused kernel's own buffers are per thread and per block (inside ATen); the route itself makes
    # O(N d) tensors: q, k, v in the compute dtype (GQA: k and v repeated to h heads, or q stacked), the
    # outputs
    n, h, d = 4096, 4, 16
    q, k, v = make_qkv(1, n, n, h, hk, d, torch.float16)
    kw = dict(softmax_scale=0.25, causal=causal)
    fwd, (out, lse) = recorded(lambda: tb.attention_forward(q, k, v, **kw))
    bwd, _ = recorded(lambda: tb.attention_backward(torch.randn_like(out), q, k, v, out, lse, **kw))
    bound = n * h * d  # q in the compute dtype
    assert max(fwd.max_numel, bwd.max_numel) <= bound and bound * 32 <= n * n
    assert routes == ["forward_fused", "backward_fused"]


def test_gqa_without_a_mask_stacks_the_group(routes):
    # decode-shaped MQA: the group's query rows go through one call against k and v as they are (no copy of
    # them per query head, which would be the largest tensor here), and match the oracle
    n, h, d = 4096, 8, 16
    q, k, v = make_qkv(1, 1, n, h, 1, d, torch.float16)
    run_and_check(q, k, v, causal=True)
    fwd, (out, lse) = recorded(lambda: tb.attention_forward(q, k, v, softmax_scale=0.25, causal=True))
    bwd, _ = recorded(lambda: tb.attention_backward(torch.randn_like(out), q, k, v, out, lse,
                                                    softmax_scale=0.25, causal=True))
    assert max(fwd.max_numel, bwd.max_numel) <= n * d  # k's float32 copy, not h copies of it
    assert routes == ["forward_fused", "backward_fused"] * 2


def test_varlen_mixes_the_routes(routes):
    # per sequence: (5, 5) and (40, 40) causal on the fused route, (17, 30) causal on the chunked one (its
    # diagonal misses key 0), an empty one skipped, (1, 9) fused (one query sees every key)
    lens_q, lens_k = [5, 40, 0, 17, 1], [5, 40, 3, 30, 9]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
                  for ls in (lens_q, lens_k))
    h, hk, d = 4, 4, 24
    q = torch.randn(sum(lens_q), h, d, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hk, d, dtype=torch.float16, requires_grad=True) for _ in range(2))
    with config.use_backend("torch"):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert routes == ["forward_fused", "forward_fused", "forward_group", "forward_fused",
                      "backward_fused", "backward_fused", "backward_group", "backward_fused"]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in (0, 1, 3, 4):  # sequence 2 has no query
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        one = [leaf64(x[s].unsqueeze(0)) for x, s in ((q, qs), (k, ks), (v, ks))]
        ref, _ = attention_ref(*one, causal=True)
        pt = [x[s].detach().unsqueeze(0).requires_grad_() for x, s in ((q, qs), (k, ks), (v, ks))]
        out_pt, _ = attention_ref(*pt, causal=True, upcast=False)
        assert_close_to_ref(out[qs].unsqueeze(0), ref, out_pt, name=f"out of sequence {i}")
        g_ref = torch.autograd.grad(ref, one, dout[qs].unsqueeze(0).double())
        g_pt = torch.autograd.grad(out_pt, pt, dout[qs].unsqueeze(0))
        for name, g_, gr, gp, s in zip(("dq", "dk", "dv"), grads, g_ref, g_pt, (qs, ks, ks), strict=True):
            assert_close_to_ref(g_[s].unsqueeze(0), gr, gp, factor=3.0, name=f"{name} of sequence {i}")


def test_public_call_takes_the_route(routes):
    # the public function on CPU tensors: a plain causal call fused both ways, a softcap call chunked
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 50, 50, 2, 2, 32, torch.bfloat16))
    with config.use_backend("torch"):
        flash_attn_func(q, k, v, causal=True).sum().backward()
        assert routes == ["forward_fused", "backward_fused"]
        routes.clear()
        flash_attn_func(q, k, v, causal=True, softcap=5.0).sum().backward()
        assert routes == ["forward_group", "backward_group"]
    assert math.isfinite(q.grad.sum().item())
