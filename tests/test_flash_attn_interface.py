"""flashattn.flash_attn_interface: flash_attn 2.8's private functions with its signatures and return tuples,
against the oracle (and the public functions) on both backends."""

from __future__ import annotations

import inspect

import pytest
import torch
from utils import DEVICE, assert_close_to_ref, keep_mask

from flashattn import flash_attn_interface as fai
from flashattn.errors import FlashAttnError
from flashattn.reference import attention_ref, attention_ref_varlen

DT = torch.float16

# flash_attn 2.8.4's parameter lists (flash_attn/flash_attn_interface.py), in order, with their defaults
SIGNATURES = {
    "_flash_attn_forward": ("q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
                            "alibi_slopes return_softmax", {}),
    "_flash_attn_varlen_forward": (
        "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale causal "
        "window_size_left window_size_right softcap alibi_slopes return_softmax block_table leftpad_k "
        "seqused_k zero_tensors num_splits",
        dict(window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
             block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False, num_splits=0)),
    "_flash_attn_backward": ("dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal "
                             "window_size_left window_size_right softcap alibi_slopes deterministic "
                             "rng_state", dict(rng_state=None)),
    "_flash_attn_varlen_backward": (
        "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
        "softmax_scale causal window_size_left window_size_right softcap alibi_slopes deterministic "
        "rng_state zero_tensors", dict(rng_state=None, zero_tensors=False)),
    "_get_block_size_n": ("device head_dim is_dropout is_causal", {}),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_flash_attns(name):
    # ring-flash-attn reads them with inspect.getfullargspec and calls with every name as a keyword
    names, defaults = SIGNATURES[name]
    spec = inspect.getfullargspec(getattr(fai, name))
    assert spec.args == names.split()
    got = dict(zip(spec.args[len(spec.args) - len(spec.defaults or ()):], spec.defaults or (), strict=True))
    assert got == defaults
    assert inspect.isfunction(getattr(fai, name))


def _qkv(b=1, sq=37, sk=45, h=2, hk=1, d=32, grad=False):
    return tuple(torch.randn(b, s, n, d, device=DEVICE, dtype=DT).requires_grad_(grad)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def test_forward_tuple_matches_the_public_function(backend):
    q, k, v = _qkv()
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, 0.2, True, 7, 0, 0.0, None, False)
    want, want_lse, _ = fai.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True, window_size=(7, 0),
                                            return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert s_dmask.shape == (0,) and s_dmask.dtype == DT
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64
    assert not out.requires_grad


def test_window_size_keyword_spelling(backend):
    q, k, v = _qkv()
    a = fai._flash_attn_forward(q, k, v, 0.0, 0.2, False, 5, 3, 0.0, None, False)[0]
    b = fai._flash_attn_forward(q, k, v, 0.0, 0.2, False, None, None, 0.0, None, False, window_size=(5, 3))[0]
    assert torch.equal(a, b)


def _oracle_grads(q, k, v, dout, **kw):
    qd, kd, vd = (x.detach().requires_grad_(True) for x in (q, k, v))
    grads = []
    for upcast in (True, False):
        out, _ = attention_ref(qd, kd, vd, upcast=upcast, **kw)
        grads.append(torch.autograd.grad(out, (qd, kd, vd), dout.to(out.dtype)))
    return grads


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_backward_writes_into_strided_buffers(backend, dropout_p):
    # ring-flash-attn hands in slices of larger buffers (dq_buffer[:, :seqlen]): written in place, the rest
    # untouched; with dropout the forward's rng_state and S_dmask describe the same mask
    q, k, v = _qkv()
    kw = dict(causal=True, softmax_scale=0.25, window_size=(-1, 0))
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, dropout_p, 0.25, True, -1, -1, 0.0, None,
                                                           True)
    dout = torch.randn_like(out)
    bufs = [torch.full((x.shape[0], x.shape[1] + 5, *x.shape[2:]), 7.0, device=DEVICE, dtype=DT)
            for x in (q, k, v)]
    views = [b[:, : x.shape[1]] for b, x in zip(bufs, (q, k, v), strict=True)]
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, *views, dropout_p, 0.25, True, -1, -1, 0.0,
                                         None, False, rng_state)
    ref_kw = dict(kw)
    if dropout_p:
        ref_kw.update(dropout_p=dropout_p, dropout_mask=keep_mask(s_dmask, q.shape[1], k.shape[1]))
        out_ref, _ = attention_ref(q, k, v, upcast=True, **ref_kw)
        out_pt, _ = attention_ref(q, k, v, upcast=False, **ref_kw)
        assert_close_to_ref(out, out_ref, out_pt, name="out")
    g_ref, g_pt = _oracle_grads(q, k, v, dout, **ref_kw)
    for name, g, r, p, buf, x in zip("qkv", views, g_ref, g_pt, bufs, (q, k, v), strict=True):
        assert_close_to_ref(g, r, p, factor=3.0, name=f"d{name}")
        assert (buf[:, x.shape[1]:] == 7.0).all(), f"d{name} written past its view"
    want_d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    assert softmax_d.shape == (1, 2, 128) and softmax_d.dtype == torch.float32
    torch.testing.assert_close(softmax_d[:, :, :37], want_d)
    assert (softmax_d[:, :, 37:] == 0).all()


def _varlen(lens_q, lens_k, h=2, hk=1, d=32):
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
          for n in (lens_q, lens_k)]
    q = torch.randn(sum(lens_q), h, d, device=DEVICE, dtype=DT)
    k, v = (torch.randn(sum(lens_k), hk, d, device=DEVICE, dtype=DT) for _ in range(2))
    return q, k, v, *cu


def test_varlen_forward_backward(backend):
    lens_q, lens_k = [5, 0, 33], [17, 4, 40]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k)
    out, lse, s_dmask, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 33, 40, 0.0, 0.25, True)
    assert lse.shape == (2, 38) and s_dmask.shape == (0,)
    ref, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, softmax_scale=0.25)
    pt, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, softmax_scale=0.25, upcast=False)
    assert_close_to_ref(out, ref, pt, name="out")
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 33, 40, 0.0,
                                                0.25, True, -1, -1, 0.0, None, False)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    g_ref, g_pt = (
        torch.autograd.grad(attention_ref_varlen(*leaves, cu_q, cu_k, causal=True, softmax_scale=0.25,
                                                 upcast=u)[0], leaves, dout.to(torch.float64 if u else DT))
        for u in (True, False))
    for name, g, r, p in zip("qkv", (dq, dk, dv), g_ref, g_pt, strict=True):
        assert_close_to_ref(g, r, p, factor=3.0, name=f"d{name}")
    # flash_attn's varlen softmax_d: (nheads, total_q + 128 * batch), sequence b's rows from cu_q[b] + 128 b
    assert softmax_d.shape == (2, 38 + 3 * 128)
    d = (dout.float() * out.float()).sum(-1).t()
    torch.testing.assert_close(softmax_d[:, :5], d[:, :5])
    torch.testing.assert_close(softmax_d[:, 5 + 256 : 38 + 256], d[:, 5:])


def test_varlen_zero_tensors_and_uncovered_rows(backend):
    # q and k have 3 rows past cu_seqlens[-1]: zero_tensors gives them out 0 and lse -inf, and zero
    # gradients; without it the given dq keeps what it held there
    q, k, v, cu_q, cu_k = _varlen([6, 4], [5, 9])
    pad = lambda x: torch.cat([x, torch.randn(3, *x.shape[1:], device=DEVICE, dtype=DT)])  # noqa: E731
    q, k, v = pad(q), pad(k), pad(v)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 6, 9, 0.0, 0.3, False,
                                                    zero_tensors=True)
    assert (out[10:] == 0).all() and torch.isneginf(lse[:, 10:]).all() and torch.isfinite(lse[:, :10]).all()
    dout = torch.randn_like(out)
    grads = [torch.full_like(x, 5.0) for x in (q, k, v)]
    args = (cu_q, cu_k, 6, 9, 0.0, 0.3, False, -1, -1, 0.0, None, False)
    fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, *args)
    assert (grads[0][10:] == 5.0).all() and (grads[1][14:] == 5.0).all()
    fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, *args, zero_tensors=True)
    assert (grads[0][10:] == 0).all() and (grads[2][14:] == 0).all()


def test_varlen_seqused_k(backend):
    # sequence b attends to the first seqused_k[b] keys of its cu_seqlens_k range
    q, k, v, cu_q, cu_k = _varlen([3, 4], [10, 12])
    used = torch.tensor([6, 12], dtype=torch.int32, device=DEVICE)
    out = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False, seqused_k=used)[0]
    keep = torch.cat([torch.arange(0, 6), torch.arange(10, 22)]).to(DEVICE)
    cu_used = torch.tensor([0, 6, 18], dtype=torch.int32, device=DEVICE)
    want = fai.flash_attn_varlen_func(q, k[keep], v[keep], cu_q, cu_used, 4, 12, softmax_scale=0.3)
    assert torch.equal(out, want)
    with pytest.raises(FlashAttnError, match="seqused_k"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False, seqused_k=used + 1)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_leftpad_k(backend, causal):
    # flash_attn's leftpad_k: sequence b's keys are rows cu_seqlens_k[b] + leftpad_k[b] up to the end of its
    # range, or up to cu_seqlens_k[b] + seqused_k[b]; the causal diagonal sits at the end of those keys
    q, k, v, cu_q, cu_k = _varlen([3, 4, 2], [10, 12, 5])
    i32 = dict(dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([4, 0, 5], **i32)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, causal,
                                                    leftpad_k=pad)
    keep = torch.cat([torch.arange(4, 10), torch.arange(10, 22)]).to(DEVICE)  # the last sequence: no keys
    cu_kept = torch.tensor([0, 6, 18, 18], **i32)
    want, want_lse, _ = fai.flash_attn_varlen_func(q, k[keep], v[keep], cu_q, cu_kept, 4, 12,
                                                   softmax_scale=0.3, causal=causal, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, pt = (attention_ref_varlen(q, k[keep], v[keep], cu_q, cu_kept, softmax_scale=0.3, causal=causal,
                                    upcast=u)[0] for u in (True, False))
    assert_close_to_ref(out, ref, pt)
    used = torch.tensor([9, 12, 5], **i32)
    out = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, causal, leftpad_k=pad,
                                         seqused_k=used)[0]
    keep = torch.cat([torch.arange(4, 9), torch.arange(10, 22)]).to(DEVICE)
    want = fai.flash_attn_varlen_func(q, k[keep], v[keep], cu_q, torch.tensor([0, 5, 17, 17], **i32), 4, 12,
                                      softmax_scale=0.3, causal=causal)
    assert torch.equal(out, want)
    # the extension's entry point passes it on
    got = fai.flash_attn_gpu.varlen_fwd(q, k, v, None, cu_q, cu_k, used, pad, None, None, 4, 12, 0.0, 0.3,
                                        False, causal, -1, -1, 0.0, False, None)[0]
    assert torch.equal(got, out)


def test_varlen_leftpad_k_errors(backend):
    q, k, v, cu_q, cu_k = _varlen([3, 4], [10, 12])
    i32 = dict(dtype=torch.int32, device=DEVICE)
    with pytest.raises(FlashAttnError, match=r"leftpad_k\[1\] is 13; expected 0 <= leftpad_k\[b\] <= the "
                                             r"sequence's keys, 12"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False,
                                       leftpad_k=torch.tensor([0, 13], **i32))
    with pytest.raises(FlashAttnError, match=r"leftpad_k\[0\] is 7; expected 0 <= leftpad_k\[b\] <= "
                                             r"seqused_k\[b\], 6"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False,
                                       leftpad_k=torch.tensor([7, 0], **i32),
                                       seqused_k=torch.tensor([6, 12], **i32))
    with pytest.raises(FlashAttnError, match=r"leftpad_k\[0\] is -1"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False,
                                       leftpad_k=torch.tensor([-1, 0], **i32))
    with pytest.raises(FlashAttnError, match=r"leftpad_k has shape \(3,\); expected \(2,\) = \(batch,\)"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False,
                                       leftpad_k=torch.zeros(3, **i32))


def test_errors_flash_attn_code_expects(backend):
    q, k, v, cu_q, cu_k = _varlen([3, 4], [10, 12])
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 12, 0.0, 0.3, False, num_splits=2)
    # as flash_attn's varlen forward: left padding of paged keys is refused
    pages = k.view(2, 11, *k.shape[1:])
    table = torch.arange(2, dtype=torch.int32, device=DEVICE).view(2, 1)
    with pytest.raises(RuntimeError, match="leftpad_k with block_table"):
        fai._flash_attn_varlen_forward(q, pages, pages, cu_q, cu_k, 4, 12, 0.0, 0.3, False, block_table=table,
                                       leftpad_k=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    qp, kp, vp = _qkv()
    out, lse, _, _ = fai._flash_attn_forward(qp, kp, vp, 0.0, 0.2, False, -1, -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match="softmax_lse"):
        fai._flash_attn_backward(out, qp, kp, vp, out, lse[:, :, 1:], None, None, None, 0.0, 0.2, False, -1,
                                 -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match=r"\bdk\b"):
        fai._flash_attn_backward(out, qp, kp, vp, out, lse, None, torch.empty_like(qp), None, 0.0, 0.2, False,
                                 -1, -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match="rng_state"):
        fai._flash_attn_backward(out, qp, kp, vp, out, lse, None, None, None, 0.1, 0.2, False, -1, -1, 0.0,
                                 None, False)


def test_block_size_n_is_flash_attns():
    # sm80 / sm90 values, what S_dmask's tiles follow
    want = {32: (128, 128), 40: (128, 64), 64: (128, 64), 96: (64, 64), 111: (64, 32), 128: (64, 32),
            160: (64, 64), 256: (64, 64)}
    for d, (plain, dropout) in want.items():
        assert fai._get_block_size_n("cpu", d, False, False) == plain
        assert fai._get_block_size_n("cpu", d, True, True) == dropout
    assert fai.USE_TRITON_ROCM is False and fai.round_multiple(129, 128) == 256


def test_extension_entry_points(backend):
    # flash_attn_gpu (the flash_attn_2_cuda module's functions), positional, returning lists; the generator
    # slot must be None (flash_attn's test_flash_attn_generator_arg_must_be_none)
    q, k, v = _qkv()
    gpu = fai.flash_attn_gpu
    out_buf = torch.empty_like(q)
    out, lse, s_dmask, rng = gpu.fwd(q, k, v, out_buf, None, 0.0, 0.2, True, -1, -1, 0.0, False, None)
    assert out is out_buf and torch.equal(out, fai._flash_attn_forward(q, k, v, 0.0, 0.2, True, -1, -1, 0.0,
                                                                        None, False)[0])
    dq, dk, dv, softmax_d = gpu.bwd(out, q, k, v, out, lse, None, None, None, None, 0.0, 0.2, True, -1, -1,
                                    0.0, False, None, rng)
    assert dq.shape == q.shape and dk.shape == k.shape and softmax_d.shape == (1, 2, 128)
    qv, kv_, vv, cu_q, cu_k = _varlen([3, 5], [4, 6])
    out_v = gpu.varlen_fwd(qv, kv_, vv, None, cu_q, cu_k, None, None, None, None, 5, 6, 0.0, 0.3, False, True,
                           -1, -1, 0.0, False, None, 0)[0]
    grads = gpu.varlen_bwd(out_v, qv, kv_, vv, out_v, torch.zeros(2, 8), None, None, None, cu_q, cu_k, None,
                           5, 6, 0.0, 0.3, False, True, -1, -1, 0.0, False, None, None)
    assert [g.shape for g in grads[:3]] == [qv.shape, kv_.shape, vv.shape]
    bad = torch.empty(1)
    for call in (lambda: gpu.fwd(q, k, v, None, None, 0.0, 0.2, True, -1, -1, 0.0, False, bad),
                 lambda: gpu.bwd(q, q, k, v, q, lse, None, None, None, None, 0.0, 0.2, True, -1, -1, 0.0,
                                 False, bad, None)):
        with pytest.raises(RuntimeError, match=r"generator` argument is no longer supported"):
            call()
