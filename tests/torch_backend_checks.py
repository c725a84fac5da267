"""The torch backend's checks against the fp64 oracle (tests/backends/torch/): a call forward and backward
under the tolerance rule, the first-order fp32 bounds of the gradients at extreme logits, and a recorder
of the tensors and matmul FLOPs a call makes; a call's forward and backward through the backend, and the
chunked route held for a test's calls."""

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import assert_close_to_ref

import flashattn.backends.torch.attention as tb
from flashattn.reference import attention_ref


def hold_chunked_route(monkeypatch):
    """Every call of the test on the chunked route (CPU calls without a score option would take ATen's fused
    kernel, backends/torch/fused.py)."""
    from flashattn.backends.torch import fused

    monkeypatch.setattr(fused, "mask_kind", lambda *args, **kwargs: None)


def fwd_bwd(q, k, v, dout, **kw):
    """(out, lse, dq, dk, dv) of the backend's forward and backward."""
    out, lse = tb.attention_forward(q, k, v, **kw)
    return (out, lse) + tb.attention_backward(dout, q, k, v, out, lse, **kw)[:3]


def leaf64(t):
    return t.detach().double().requires_grad_()


def leaf(t):
    return t.detach().clone().requires_grad_()


def run_and_check(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, grads=True):
    """Forward (and backward) of the backend vs the fp64 oracle, baseline = plain PyTorch in q's dtype."""
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kw = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = tb.attention_forward(q, k, v, softmax_scale=scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + v.shape[3:]
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])

    q64, k64, v64 = leaf64(q), leaf64(k), leaf64(v)
    out_ref, lse_ref = attention_ref(q64, k64, v64, softmax_scale=scale, **kw)
    qp, kp, vp = leaf(q), leaf(k), leaf(v)
    out_pt, lse_pt = attention_ref(qp, kp, vp, softmax_scale=scale, upcast=False, **kw)
    assert_close_to_ref(out, out_ref, out_pt, name="out")
    assert_close_to_ref(lse, lse_ref, lse_pt, name="lse")
    # a row that sees no key: exactly 0 out
    dead = torch.isinf(lse_ref).transpose(1, 2)  # (b, sq, h)
    assert (out[dead] == 0).all()
    if not grads:
        return out, lse, None

    dout = torch.randn_like(out)
    dq, dk, dv, dsink = tb.attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, **kw)
    assert dsink is None
    for g_, x in zip((dq, dk, dv), (q, k, v), strict=True):
        assert g_.dtype == x.dtype and g_.shape == x.shape
    g_ref = torch.autograd.grad(out_ref, (q64, k64, v64), dout.double())
    g_pt = torch.autograd.grad(out_pt, (qp, kp, vp), dout)
    for name, g_, gr, gp in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref, g_pt, strict=True):
        assert_close_to_ref(g_, gr, gp, factor=3.0, name=name)
    assert (dq[dead] == 0).all()
    return out, lse, (dq, dk, dv)


def first_order_grad_bounds(q, k, v, dout, lse, scale):
    """fp32 error bounds for (dq, dk, dv) of a FlashAttention backward, non-causal, from fp64 dense terms.

    Two roundings that plain PyTorch does not have dominate once logits are huge: P = exp(s - lse) is
    recomputed from the fp32 LSE (relative error up to eps * |lse|), and dS = P * (dP - D) cancels
    D = rowsum(dO * O) against dP in fp32.  Each bound is eps * (1 + max|lse|) times the magnitude of the
    sum before any cancellation, e.g. dq: scale * sum_j P_ij (|dP_ij| + |D_i|) |K_j|.
    """
    g = q.shape[2] // k.shape[2]
    q, dout, lse = q.double(), dout.double(), lse.double()
    k, v = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    p = torch.exp(torch.einsum("bihd,bjhd->bhij", q, k) * scale - lse.unsqueeze(-1))
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    dp = torch.einsum("bihd,bjhd->bhij", dout, v)
    delta = (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1)
    a = p * (dp.abs() + delta.abs())
    e = 2.0**-24 * (1 + lse.abs().max().item())
    return (
        e * scale * torch.einsum("bhij,bjhd->bihd", a, k.abs()).max().item(),
        e * scale * torch.einsum("bhij,bihd->bjhd", a, q.abs()).max().item(),
        e * torch.einsum("bhij,bihd->bjhd", p, dout.abs()).max().item(),
    )


class Recorder(TorchDispatchMode):
    """Records the largest tensor any op produces and the matmul FLOPs."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            a, b_ = args[0], args[1]
            self.flops += 2 * a.shape[:-1].numel() * b_.shape[-1] * a.shape[-1]
        return out


def recorded(fn):
    rec = Recorder()
    with rec:
        result = fn()
    return rec, result
