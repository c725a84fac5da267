"""What the Gluon GPU tests (test_gluon_*_gpu.py) share: route variants, random bf16 inputs on the GPU, the
features' options, and the checks of a padded and a packed (varlen) call (the spies on the launchers:
conftest.py)."""

from __future__ import annotations

import dataclasses

import torch
from test_interface import check_against_oracle
from utils import assert_close_to_ref

from flashattn import flash_attn_varlen_func
from flashattn.backends.triton import attention, routes
from flashattn.reference import attention_ref


def vary_routes(monkeypatch, forward=None, backward=None) -> None:
    """Every call of the test on its default routes with some fields replaced (forward / backward: dicts),
    the launchers' signature caches emptied so that no default-route entry serves it."""
    monkeypatch.setattr(attention, "_forward_cache", {})
    monkeypatch.setattr(attention, "_backward_cache", {})
    for name, fields in (("forward_route", forward), ("backward_route", backward)):
        if fields:
            real = getattr(routes, name)
            monkeypatch.setattr(routes, name, lambda spec, real=real, fields=fields: dataclasses.replace(
                real(spec), **fields))


def takes_gluon_backward(d: int, dv: int | None = None, deterministic: bool = False) -> bool:
    """Whether a 16-bit call at head dims (d, dv) runs a Gluon backward (written out, not asked of routes):
    attn_bwd.py at d 33..128 (tiles 64 or 128 wide) beside dv <= d, attn_bwd_keys.py at d 129..192 beside
    dv 33..128, attn_bwd_dsplit.py at Q/K width 256 (d 129..256) beside dv padded to 128 or 256; a
    deterministic call at d 33..128 only at d = dv = 64 or 128 (attn_bwd.py's fixed-order variant), above
    128 wherever the wide kernels take it (both have one)."""
    dv = dv or d
    if deterministic and d <= 128:
        return d in (64, 128) and dv == d
    if d <= 128:
        return 32 < d and dv <= d
    if d <= 192 and 32 < dv <= 128:
        return True
    dv_width = 128 if 64 < dv <= 128 else 256 if 128 < dv <= 256 else dv
    width = 192 if d <= 192 and dv_width <= 128 else 256  # O is staged in Q's buffer
    return (width, dv_width) in ((192, 128), (256, 128), (256, 256))


def assert_reproducible(attn, inputs, dout, calls=3):
    """The gradients of attn(*inputs) against dout over `calls` calls, bit for bit the same."""
    first = torch.autograd.grad(attn(*inputs), inputs, dout)
    for _ in range(calls - 1):
        again = torch.autograd.grad(attn(*inputs), inputs, dout)
        for name, a, b in zip("qkv", first, again, strict=True):
            assert torch.equal(a, b), f"d{name} differs between deterministic calls"


def assert_varlen_reproducible(lens, d, dv, causal=True, h=4, hk=2):
    """deterministic=True's gradients of packed documents of these lengths (bf16, h query heads over hk),
    bit for bit the same over three calls."""
    from flashattn import flash_attn_varlen_func

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads, dim in ((h, d), (hk, d), (hk, dv)))
    dout = torch.randn(sum(lens), h, dv, device="cuda", dtype=torch.bfloat16)
    assert_reproducible(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                                               causal=causal, deterministic=True),
                        (q, k, v), dout)


def qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(True)

    return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)


def qkv_dv(b, sq, sk, h, hk, d, dv, dtype=torch.bfloat16):
    """qkv's inputs with V's head dim dv."""
    q, k, _ = qkv(b, sq, sk, h, hk, d, dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def check_features(fwd_calls, bwd_calls, q, k, v, grads=True, gluon_backward=True, **options):
    """check_against_oracle with the sink's gradient checked too; the Gluon forward must have run, and the
    Gluon backward where gluon_backward (else the Triton one, as at dv < d = 128)."""
    causal = options.pop("causal", False)
    sink = options.get("learnable_sink")
    wrt = None if sink is None else (q, k, v, sink)
    result = check_against_oracle(q, k, v, causal=causal, grads=grads, wrt=wrt, **options)
    assert fwd_calls, "the Gluon forward did not run"
    if grads:
        assert bool(bwd_calls) is gluon_backward, f"the Gluon backward ran: {bool(bwd_calls)}"
    return result


def options_for(b, h, features: str) -> dict:
    """flash_attn_func's options for features, '+'-separated: window (left and right edges), swa (causal with
    a left edge), softcap, alibi ((h,) slopes), alibi_bh ((b, h) slopes), sink."""
    table = {
        "window": dict(window_size=(100, 37)),
        "swa": dict(causal=True, window_size=(255, -1)),
        "softcap": dict(softcap=20.0),
        "alibi": dict(alibi_slopes=torch.rand(h, device="cuda")),
        "alibi_bh": dict(alibi_slopes=torch.rand(b, h, device="cuda")),
        "sink": dict(learnable_sink=torch.randn(h, device="cuda").requires_grad_(True)),
    }
    options = {}
    for name in features.split("+"):
        options.update(table[name])
    return options


def check_varlen(fwd_calls, bwd_calls, lens_q, lens_k, h, hk, d, dtype=torch.bfloat16, dv=None,
                 gluon_backward=None, **options):
    """flash_attn_varlen_func on packed sequences of lens_q queries and lens_k keys, checked sequence by
    sequence against the oracle (forward, LSE, gradients, the sink's summed over the sequences); the Gluon
    forward must have run (fwd_calls), and the Gluon backward (bwd_calls) exactly where it takes the head
    dims, else the Triton one reading the Gluon forward's LSE."""
    # gluon_backward: the caller's expectation instead
    if gluon_backward is None:
        gluon_backward = takes_gluon_backward(d, dv, options.get("deterministic", False))
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                 device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hk, dim, device="cuda", dtype=dtype, requires_grad=True)
            for dim in (d, dv or d))
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         return_attn_probs=True, **options)
    assert fwd_calls, "the Gluon forward did not run"
    assert lse.shape == (h, sum(lens_q))
    dout = torch.randn_like(out)
    sink = options.get("learnable_sink")
    leaves = (q, k, v) + ((sink,) if sink is not None else ())
    grads = torch.autograd.grad(out, leaves, dout)
    assert bool(bwd_calls) == gluon_backward, f"the Gluon backward ran {len(bwd_calls)} times"
    slopes = options.pop("alibi_slopes", None)
    options.pop("deterministic", None)  # the call's, not the oracle's
    dsink_ref, dsink_pt = 0.0, 0.0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lq == 0:  # keys no query sees: gradient 0 (dK and dV are allocated uninitialised)
            assert (grads[1][ks] == 0).all() and (grads[2][ks] == 0).all()
            continue
        if lk == 0:  # no key: out 0, dq 0, lse +inf (the sink's value with one)
            assert (out[qs] == 0).all() and (grads[0][qs] == 0).all()
            expected = torch.full((h, lq), float("inf"), device="cuda") if sink is None else (
                sink.detach()[:, None].expand(h, lq))
            torch.testing.assert_close(lse[:, qs], expected)
            continue
        seq = dict(options, alibi_slopes=slopes if slopes is None or slopes.dim() == 1 else slopes[i])
        qi, ki, vi = (t[s][None].detach().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        sink_i = None if sink is None else sink.detach().clone().requires_grad_()
        seq["learnable_sink"] = sink_i
        ref, lse_ref = attention_ref(qi, ki, vi, **seq)
        pt, lse_pt = attention_ref(qi, ki, vi, upcast=False, **seq)
        assert_close_to_ref(out[qs][None], ref, pt, name=f"out[{i}]")
        assert_close_to_ref(lse[:, qs][None], lse_ref, lse_pt, name=f"lse[{i}]")
        inputs = (qi, ki, vi) + ((sink_i,) if sink is not None else ())
        refg = torch.autograd.grad(ref, inputs, dout[qs][None].double())
        ptg = torch.autograd.grad(pt, inputs, dout[qs][None])
        for name, g, s, r, p in zip("qkv", grads, (qs, ks, ks), refg, ptg, strict=False):
            assert_close_to_ref(g[s][None], r, p, factor=3.0, name=f"d{name}[{i}]")
        if sink is not None:
            dsink_ref, dsink_pt = dsink_ref + refg[3], dsink_pt + ptg[3]
    if sink is not None:  # the sink's gradient sums over every sequence
        assert_close_to_ref(grads[3], dsink_ref, dsink_pt, factor=3.0, name="dsink")


VARLEN_Q = [0, 1, 17, 113, 1023, 64, 300, 129, 0, 2, 200]
VARLEN_K = [5, 1, 30, 113, 900, 64, 0, 200, 3, 1500, 200]  # seqlen_q != seqlen_k both ways, empty keys
