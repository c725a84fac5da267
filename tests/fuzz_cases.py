"""Random calls of every public function, valid and invalid, each with its oracle: the cases of
tests/test_fuzz.py (CPU: the torch backend and the Triton interpreter) and of the GPU memcheck sample
(`python tests/fuzz_cases.py --device cuda -n 300`, run under compute-sanitizer by test_fuzz.py's GPU test).

`draw_call(r, env)` turns a random.Random (Hypothesis's, or a seeded one) into a `Call`: what to run, and
either the oracle check of its result (a valid call) or the reason it must be rejected (an invalid one).
`run_call` runs it: a valid call must pass its check under the tolerance rule (tests/utils.py), an invalid
one must raise FlashAttnError, nothing may crash. Shapes are small and odd (lengths 0, 1, 17, 33, ...).

Gradients are checked on float32 calls. In 16 bits a FlashAttention backward's D = rowsum(dO ∘ O) carries
O's rounding, which the tolerance rule's plain-PyTorch baseline does not have; where a row's softmax is
(nearly) one-hot -- one visible key, a strong ALiBi slope, a large scale, all common here -- the true dQ and
dK are ~0 and that rounding exceeds any multiple of the baseline's error (test_interface.py's
test_extreme_logits and test_head_dims describe it). The structured tests check 16-bit gradients.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import flashattn
from flashattn import flash_attn_interface as fai
from flashattn.errors import FlashAttnError
from flashattn.layers.rotary import apply_rotary_emb
from flashattn.reference import attention_ref, attention_ref_varlen, masked_attention_ref


@dataclass
class Env:
    device: str
    dtypes: tuple
    max_len: int  # longest sequence drawn
    max_batch_heads: int  # batch * nheads drawn at most
    grad_chance: float  # share of valid calls that also check gradients


@dataclass
class Call:
    name: str
    run: Callable
    check: Callable | None = None  # called with run's result (valid calls)
    invalid: str | None = None  # why it must be rejected
    detail: dict = field(default_factory=dict)


class Draw:
    def __init__(self, r: random.Random):
        self.r = r

    def int(self, lo, hi):
        return self.r.randint(lo, hi)

    def pick(self, seq):
        return seq[self.r.randrange(len(seq))]

    def chance(self, p):
        return self.r.random() < p

    def length(self, env, zero=0.05):
        if self.chance(zero):
            return 0
        return self.pick([1, 2, 5, 16, 17, 31, 33, env.max_len, self.int(1, env.max_len)])


def _tensor(d: Draw, shape, dtype, device, strided=False, scale=1.0):
    gen = torch.Generator().manual_seed(d.int(0, 2**31 - 1))
    if strided and len(shape) >= 3:
        # a view with a contiguous last dim only: (heads, seq) swapped in memory, headdim padded
        full = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1] + 3, generator=gen) * scale
        return full.to(device=device, dtype=dtype).transpose(-3, -2)[..., : shape[-1]]
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _heads(d: Draw, env, b):
    hk = d.pick([1, 1, 2])
    h = hk * d.pick([1, 2])
    while max(b, 1) * h > env.max_batch_heads and h > 1:
        h //= 2
    return h, min(hk, h)


def _options(d: Draw, env, b, h):
    """flash_attn_func's options: causal, window (negatives unbounded, tensors too), softcap, ALiBi, dropout,
    an explicit scale."""
    opts = {"causal": d.chance(0.5)}
    if d.chance(0.3):
        w = [d.pick([-1, -3, 0, 1, 4, 9, 40]), d.pick([-1, -2, 0, 2, 7])]
        opts["window_size"] = torch.tensor(w) if d.chance(0.2) else tuple(w)
    if d.chance(0.15):
        opts["softcap"] = d.pick([0.5, 3.0, 20.0])
    if d.chance(0.2):
        opts["alibi_slopes"] = torch.rand(*((h,) if d.chance(0.5) else (b, h)), device=env.device) * 0.5
    if d.chance(0.2):
        opts["dropout_p"] = d.pick([0.1, 0.5])
    if d.chance(0.15):
        opts["softmax_scale"] = d.pick([0.05, 0.3, 1.7])
    return opts


def _ref_options(opts):
    """The options as the oracle takes them (a tensor window as ints)."""
    ref = {k: v for k, v in opts.items() if k in ("causal", "softcap", "alibi_slopes", "softmax_scale")}
    w = opts.get("window_size", (-1, -1))
    ref["window_size"] = tuple(int(x) for x in (w.tolist() if isinstance(w, torch.Tensor) else w))
    return ref


def _compare(got, ref, pt, name, factor):
    from utils import assert_close_to_ref

    assert_close_to_ref(got, ref, pt, factor=factor, name=name)


def _grads(d: Draw, env, dtype, *sizes) -> bool:
    """Whether a valid call also checks its gradients: float32 (the module docstring says why), non-empty."""
    return dtype == torch.float32 and all(sizes) and d.chance(env.grad_chance)


def _check_attention(q, k, v, out, lse, opts, s_dmask, our_grads, dout, varlen=None):
    """out / lse against the fp64 oracle and plain PyTorch; with our_grads (a function of dout giving our
    (dq, dk, dv)), the gradients too, the oracle's taken with respect to the views q, k, v."""
    ref_opts = _ref_options(opts)
    p = opts.get("dropout_p", 0.0)
    if p:
        keep = ~torch.signbit(s_dmask)
        if varlen is None:
            keep = keep[:, :, : q.shape[1], : k.shape[1]]
        ref_opts.update(dropout_p=p, dropout_mask=keep)
    if varlen is None:
        ref, ref_lse = attention_ref(q, k, v, upcast=True, **ref_opts)
        pt, pt_lse = attention_ref(q, k, v, upcast=False, **ref_opts)
        rows_q = rows_k = slice(None)
        lse_rows = (slice(None),)
    else:
        cu_q, cu_k = varlen
        ref, ref_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, upcast=True, **ref_opts)
        pt, pt_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, upcast=False, **ref_opts)
        # rows past the last sequence are unspecified
        rows_q, rows_k = slice(0, int(cu_q[-1])), slice(0, int(cu_k[-1]))
        lse_rows = (slice(None), rows_q)
    _compare(out[rows_q], ref[rows_q], pt[rows_q], "out", 2.0)
    _compare(lse[lse_rows], ref_lse[lse_rows], pt_lse[lse_rows], "lse", 2.0)
    if our_grads is None:
        return
    views = (q, k, v)
    g_ref = torch.autograd.grad(ref, views, dout.to(ref.dtype))
    g_pt = torch.autograd.grad(pt, views, dout)
    for name, a, r, b, rows in zip(("dq", "dk", "dv"), our_grads(dout), g_ref, g_pt, (rows_q, rows_k, rows_k),
                                   strict=True):
        _compare(a[rows], r[rows], b[rows], name, 3.0)


# ------------------------------------------------------------------------------------------ valid calls


def dense_call(d: Draw, env) -> Call:
    b = 0 if d.chance(0.03) else d.int(1, 2)
    sq, sk = d.length(env), d.length(env)
    h, hk = _heads(d, env, b)
    hd = d.pick([1, 8, 16, 24, 40])
    dv = hd if d.chance(0.8) else d.pick([8, 16])
    dtype = d.pick(env.dtypes)
    form = d.pick(["func", "func", "qkvpacked", "kvpacked"])
    if form == "qkvpacked":
        sk, hk, dv = sq, h, hd
    if form == "kvpacked":
        dv = hd
    opts = _options(d, env, b, h)
    if opts.get("causal") is False and d.chance(0.3):
        opts.pop("causal")
    grads = _grads(d, env, dtype, b, sq, sk)
    strided = d.chance(0.2)
    if form == "qkvpacked":
        x = _tensor(d, (b, sq, 3, h, hd), dtype, env.device).requires_grad_(grads)
        q, k, v = x.unbind(2)
        wrt = (x,)
        run = lambda: flashattn.flash_attn_qkvpacked_func(x, return_attn_probs=True, **opts)  # noqa: E731
    elif form == "kvpacked":
        q = _tensor(d, (b, sq, h, hd), dtype, env.device, strided).requires_grad_(grads)
        kv = _tensor(d, (b, sk, 2, hk, hd), dtype, env.device).requires_grad_(grads)
        k, v = kv.unbind(2)
        wrt = (q, kv)
        run = lambda: flashattn.flash_attn_kvpacked_func(q, kv, return_attn_probs=True, **opts)  # noqa: E731
    else:
        q, k, v = (_tensor(d, s, dtype, env.device, strided).requires_grad_(grads)
                   for s in ((b, sq, h, hd), (b, sk, hk, hd), (b, sk, hk, dv)))
        wrt = (q, k, v)
        if d.chance(0.15):  # the private forward, flash_attn's tuple
            left, right = _ref_options(opts)["window_size"]
            scale = opts.get("softmax_scale", hd ** -0.5)

            def run():
                with torch.enable_grad():
                    o, lse, s, _ = fai._flash_attn_forward(
                        q, k, v, opts.get("dropout_p", 0.0), scale, opts.get("causal", False), left, right,
                        opts.get("softcap", 0.0), opts.get("alibi_slopes"), True)
                return o, lse, s

            opts = dict(opts, softmax_scale=scale)
            wrt, grads = (q, k, v), False
        else:
            run = lambda: flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)  # noqa: E731

    def check(res):
        out, lse, s_dmask = res
        assert out.shape == (b, sq, h, v.shape[-1]) and lse.shape == (b, h, sq) and out.dtype == dtype
        dout = _tensor(d, out.shape, dtype, env.device)
        ours = (lambda g: _as_qkv(torch.autograd.grad(out, wrt, g), form, 2)) if grads else None
        _check_attention(q, k, v, out, lse, opts, s_dmask, ours, dout)

    return Call(f"dense-{form}", run, check)


def _as_qkv(grads, form, axis):
    """The gradients of the leaves as (dq, dk, dv): packed ones unbound along their q/k/v axis."""
    if form == "qkvpacked":
        return grads[0].unbind(axis)
    if form == "kvpacked":
        return (grads[0], *grads[1].unbind(axis))
    return grads


def varlen_call(d: Draw, env) -> Call:
    batch = 0 if d.chance(0.03) else d.int(1, 3)
    lens_q = [d.length(env, zero=0.15) for _ in range(batch)]
    lens_k = [d.length(env, zero=0.1) for _ in range(batch)]
    form = d.pick(["func", "func", "qkvpacked", "kvpacked", "private"])
    if form == "qkvpacked":
        lens_k = lens_q
    h, hk = _heads(d, env, 1)
    if form == "qkvpacked":
        hk = h
    hd = d.pick([8, 16, 40])
    dtype = d.pick(env.dtypes)
    extra = d.pick([0, 0, 3])  # rows past the last sequence (unspecified in out)
    cu = [torch.tensor([0, *torch.tensor(n, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                       device=env.device) for n in (lens_q, lens_k)]
    tq, tk = sum(lens_q) + extra, sum(lens_k) + (extra if form != "qkvpacked" else extra)
    if form == "qkvpacked":
        tk = tq
    mq = max(lens_q, default=0) + d.pick([0, 0, 5])
    mk = max(lens_k, default=0) + d.pick([0, 0, 3])
    if form == "qkvpacked":
        mk = mq
    opts = _options(d, env, batch, h)
    grads = _grads(d, env, dtype, tq, tk, batch) and form != "private"
    if form == "qkvpacked":
        x = _tensor(d, (tq, 3, h, hd), dtype, env.device).requires_grad_(grads)
        q, k, v = x.unbind(1)
        wrt = (x,)
        run = lambda: flashattn.flash_attn_varlen_qkvpacked_func(  # noqa: E731
            x, cu[0], mq, return_attn_probs=True, **opts)
    elif form == "kvpacked":
        q = _tensor(d, (tq, h, hd), dtype, env.device).requires_grad_(grads)
        kv = _tensor(d, (tk, 2, hk, hd), dtype, env.device).requires_grad_(grads)
        k, v = kv.unbind(1)
        wrt = (q, kv)
        run = lambda: flashattn.flash_attn_varlen_kvpacked_func(  # noqa: E731
            q, kv, cu[0], cu[1], mq, mk, return_attn_probs=True, **opts)
    else:
        q, k, v = (_tensor(d, s, dtype, env.device).requires_grad_(grads)
                   for s in ((tq, h, hd), (tk, hk, hd), (tk, hk, hd)))
        wrt = (q, k, v)
        if form == "private":
            left, right = _ref_options(opts)["window_size"]
            scale = opts.get("softmax_scale", hd ** -0.5)
            opts = dict(opts, softmax_scale=scale)

            def run():
                o, lse, s, _ = fai._flash_attn_varlen_forward(
                    q, k, v, cu[0], cu[1], mq, mk, opts.get("dropout_p", 0.0), scale,
                    opts.get("causal", False), left, right, opts.get("softcap", 0.0),
                    opts.get("alibi_slopes"), True)
                return o, lse, s
        else:
            run = lambda: flashattn.flash_attn_varlen_func(  # noqa: E731
                q, k, v, cu[0], cu[1], mq, mk, return_attn_probs=True, **opts)
    def check(res):
        out, lse, s_dmask = res
        assert out.shape == (tq, h, hd) and lse.shape == (h, tq)
        dout = _tensor(d, out.shape, dtype, env.device)
        ours = (lambda g: _as_qkv(torch.autograd.grad(out, wrt, g), form, 1)) if grads else None
        _check_attention(q, k, v, out, lse, opts, s_dmask, ours, dout, varlen=(cu[0], cu[1]))

    return Call(f"varlen-{form}", run, check)


def private_backward_call(d: Draw, env) -> Call:
    b, sq, sk = 1, min(d.length(env), 20), min(d.length(env), 20)
    if sq * sk == 0:
        sq, sk = 5, 9
    h, hk = _heads(d, env, b)
    dtype = torch.float32  # gradients: the module docstring says why float32
    q, k, v = (_tensor(d, s, dtype, env.device) for s in ((b, sq, h, 16), (b, sk, hk, 16), (b, sk, hk, 16)))
    causal, p = d.chance(0.5), d.pick([0.0, 0.0, 0.3])
    dout = _tensor(d, (b, sq, h, 16), dtype, env.device)

    def run():
        out, lse, s_dmask, rng = fai._flash_attn_forward(q, k, v, p, 0.25, causal, -1, -1, 0.0, None, True)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        fai._flash_attn_backward(dout, q, k, v, out, lse, *grads, p, 0.25, causal, -1, -1, 0.0, None, False,
                                 rng)
        return out, s_dmask, grads

    def check(res):
        out, s_dmask, grads = res
        kw = dict(causal=causal, softmax_scale=0.25)
        if p:
            kw.update(dropout_p=p, dropout_mask=~torch.signbit(s_dmask)[:, :, :sq, :sk])
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        ref, pt = (attention_ref(*leaves, upcast=u, **kw)[0] for u in (True, False))
        _compare(out, ref, pt, "out", 2.0)
        rules = zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, leaves, dout.double()),
                    torch.autograd.grad(pt, leaves, dout), strict=True)
        for name, g, r, gp in rules:
            _compare(g, r, gp, name, 3.0)

    return Call("private-backward", run, check)


def kvcache_call(d: Draw, env) -> Call:
    b, sq = d.int(1, 2), d.pick([1, 1, 2, 3])
    h, hk = _heads(d, env, b)
    hd = d.pick([16, 32])
    dtype = d.pick(env.dtypes)
    cap = d.pick([16, 17, 33, env.max_len])
    s_new = d.pick([0, 0, 1, 2]) if cap >= 3 else 0
    lens = [d.int(0, cap - s_new) for _ in range(b)]
    q = _tensor(d, (b, sq, h, hd), dtype, env.device)
    kc, vc = (_tensor(d, (b, cap, hk, hd), dtype, env.device) for _ in range(2))
    kn = vn = None
    if s_new:
        kn, vn = (_tensor(d, (b, s_new, hk, hd), dtype, env.device) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=env.device)
    causal = d.chance(0.5)
    before = (kc.clone(), vc.clone())

    def run():
        return flashattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal,
                                                 return_softmax_lse=True)

    def check(res):
        out, lse = res
        kf, vf = before[0].clone(), before[1].clone()
        for i, n in enumerate(lens):
            if s_new:
                kf[i, n : n + s_new], vf[i, n : n + s_new] = kn[i], vn[i]
        assert torch.equal(kc, kf) and torch.equal(vc, vf), "the cache after the append"
        mask = torch.arange(cap, device=env.device).view(1, -1) < (seqlens + s_new).view(-1, 1)
        kw = dict(causal=causal, key_padding_mask=mask)
        ref, ref_lse = attention_ref(q, kf, vf, upcast=True, **kw)
        pt, pt_lse = attention_ref(q, kf, vf, upcast=False, **kw)
        _compare(out, ref, pt, "out", 2.0)
        _compare(lse, ref_lse, pt_lse, "lse", 2.0)

    return Call("kvcache", run, check)


def sparse_call(d: Draw, env) -> Call:
    b, sq = d.int(1, 2), d.int(1, env.max_len)
    sk = sq if d.chance(0.5) else d.int(1, env.max_len)
    h, hk = _heads(d, env, b)
    dtype = d.pick(env.dtypes)
    bs = d.pick([16, 32])
    kind = d.pick(["causal", "full", "window", "local_global"])
    if kind == "causal":
        mask = flashattn.BlockMask.causal(sq, sk, block_size=bs, device=env.device)
    elif kind == "full":
        mask = flashattn.BlockMask.full(sq, sk, block_size=bs, device=env.device)
    elif kind == "window":
        mask = flashattn.BlockMask.sliding_window(sq, sk, (d.int(-1, 9), d.int(-1, 5)), block_size=bs,
                                                  device=env.device)
    else:
        sk = sq
        mask = flashattn.BlockMask.local_global(sq, d.int(0, 6), d.int(0, 3), causal=d.chance(0.5),
                                                block_size=bs, device=env.device)
    grads = _grads(d, env, dtype, b)
    q, k, v = (_tensor(d, s, dtype, env.device).requires_grad_(grads)
               for s in ((b, sq, h, 16), (b, sk, hk, 16), (b, sk, hk, 16)))

    def run():
        return flashattn.block_sparse_attn_func(q, k, v, mask, return_attn_probs=True)

    def check(res):
        out, lse, _ = res
        dense = mask.to_dense()
        ref, ref_lse = masked_attention_ref(q, k, v, dense, upcast=True)
        pt, pt_lse = masked_attention_ref(q, k, v, dense, upcast=False)
        _compare(out, ref, pt, "out", 2.0)
        _compare(lse, ref_lse, pt_lse, "lse", 2.0)
        if grads:
            dout = _tensor(d, out.shape, dtype, env.device)
            for name, g, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                                     torch.autograd.grad(ref, (q, k, v), dout.double()),
                                     torch.autograd.grad(pt, (q, k, v), dout), strict=True):
                _compare(g, r, p, name, 3.0)

    return Call(f"sparse-{kind}", run, check)


def merge_call(d: Draw, env) -> Call:
    b, s, h, hd, parts = d.int(1, 2), d.int(1, 9), d.int(1, 3), d.pick([8, 16]), d.int(1, 3)
    dtype = d.pick(env.dtypes)
    outs = [_tensor(d, (b, s, h, hd), dtype, env.device) for _ in range(parts)]
    lses = []
    for _ in range(parts):
        lse = _tensor(d, (b, h, s), torch.float32, env.device, scale=3.0)
        if d.chance(0.3):  # rows that saw no key in this part
            lse[..., d.int(0, s - 1)] = d.pick([math.inf, -math.inf])
        lses.append(lse)

    def run():
        return flashattn.merge_attention_states(outs, lses)

    def check(res):
        out, lse = res
        ls = torch.stack(lses).double()
        ls = torch.where(torch.isinf(ls), -math.inf, ls)  # an empty part: no weight, either sign
        m = ls.amax(0)
        w = torch.exp(ls - torch.where(torch.isinf(m), 0.0, m))
        total = w.sum(0)
        ref = (torch.stack(outs).double() * (w / torch.where(total > 0, total, 1.0)).permute(0, 1, 3, 2)
               .unsqueeze(-1)).sum(0)
        ref_lse = torch.where(total > 0, m + torch.log(torch.where(total > 0, total, 1.0)), math.inf)
        pt = ref.to(dtype)  # the merge's only rounding: its result in the parts' dtype
        _compare(out, ref, pt, "out", 2.0)
        _compare(lse, ref_lse, ref_lse.float(), "lse", 2.0)

    return Call("merge", run, check)


def rotary_call(d: Draw, env) -> Call:
    b, s, h, hd = d.int(1, 2), d.int(1, 20), d.int(1, 3), d.pick([8, 16, 24])
    rd = d.pick([r for r in (4, 8, 16, 24) if r <= hd])
    dtype = d.pick(env.dtypes)
    seqlen_ro = s + d.int(0, 6)
    x = _tensor(d, (b, s, h, hd), dtype, env.device)
    ang = torch.outer(torch.arange(seqlen_ro, dtype=torch.float64), torch.rand(rd // 2, dtype=torch.float64))
    cos, sin = ang.cos().to(env.device, dtype), ang.sin().to(env.device, dtype)
    off = d.int(0, seqlen_ro - s)
    interleaved = d.chance(0.5)

    def check(out):
        pos = torch.arange(s, device=env.device) + off
        c, sn = cos.double()[pos].unsqueeze(-2), sin.double()[pos].unsqueeze(-2)

        def rot(t, dt):
            xr = t[..., :rd].to(dt)
            a, bb = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : rd // 2], xr[..., rd // 2:])
            c2, s2 = c.to(dt), sn.to(dt)
            parts = (a * c2 - bb * s2, a * s2 + bb * c2)
            r = torch.stack(parts, -1).flatten(-2) if interleaved else torch.cat(parts, -1)
            return torch.cat((r, t[..., rd:].to(dt)), -1)

        _compare(out, rot(x, torch.float64), rot(x, dtype), "rotary", 2.0)

    return Call("rotary", lambda: apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=off), check)


VALID = [dense_call, dense_call, varlen_call, varlen_call, private_backward_call, kvcache_call, sparse_call,
         merge_call, rotary_call]


# ---------------------------------------------------------------------------------------- invalid calls


def _qkv(d, env, b=2, sq=9, sk=11, h=2, hk=1, hd=16, dtype=None):
    dtype = dtype or env.dtypes[0]
    return [_tensor(d, s, dtype, env.device) for s in ((b, sq, h, hd), (b, sk, hk, hd), (b, sk, hk, hd))]


def _dense_defect(d: Draw, env) -> Call:
    q, k, v = _qkv(d, env)
    f = flashattn.flash_attn_func
    defects = {
        "q float64": lambda: f(q.double(), k, v),
        "q int32": lambda: f(q.to(torch.int32), k, v),
        "q 3-D": lambda: f(q[0], k, v),
        "q a list": lambda: f(q.tolist(), k, v),
        "k headdim": lambda: f(q, k[..., :8], v),
        "heads not a multiple": lambda: f(q, *(_tensor(d, (2, 11, 3, 16), q.dtype, env.device)
                                               for _ in "kv")),
        "headdim 300": lambda: f(*(_tensor(d, (1, 3, 1, 300), q.dtype, env.device) for _ in "qkv")),
        "batch": lambda: f(q, k[:1], v[:1]),
        "v seqlen": lambda: f(q, k, v[:, :5]),
        "dtype mix": lambda: f(q, k.float() if k.dtype != torch.float32 else k.half(), v),
        "last dim strided": lambda: f(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v),
        "nheads 0": lambda: f(q[:, :, :0], k[:, :, :0], v[:, :, :0]),
        "dropout_p 1": lambda: f(q, k, v, dropout_p=1.0),
        "dropout_p str": lambda: f(q, k, v, dropout_p="0.1"),
        "softcap < 0": lambda: f(q, k, v, softcap=-1.0),
        "scale 0": lambda: f(q, k, v, softmax_scale=0.0),
        "scale nan": lambda: f(q, k, v, softmax_scale=math.nan),
        "window float": lambda: f(q, k, v, window_size=(1.5, 2)),
        "window triple": lambda: f(q, k, v, window_size=(1, 2, 3)),
        "window float tensor": lambda: f(q, k, v, window_size=torch.tensor([1.0, 2.0])),
        "alibi shape": lambda: f(q, k, v, alibi_slopes=torch.rand(3, device=env.device)),
        "alibi float64": lambda: f(q, k, v, alibi_slopes=torch.rand(2, device=env.device).double()),
        "sink shape": lambda: f(q, k, v, learnable_sink=torch.rand(5, device=env.device)),
        "qkvpacked 2 parts": lambda: flashattn.flash_attn_qkvpacked_func(torch.stack([q, q], 2)),
        "kvpacked 3 parts": lambda: flashattn.flash_attn_kvpacked_func(q, torch.stack([k, k, k], 2)),
    }
    name = d.pick(sorted(defects))
    return Call("dense", defects[name], invalid=name)


def _varlen_defect(d: Draw, env) -> Call:
    lens = [3, 0, 6]
    q, k, v = (_tensor(d, (9, 2, 16), env.dtypes[0], env.device) for _ in range(3))
    i32 = dict(dtype=torch.int32, device=env.device)
    cu = torch.tensor([0, 3, 3, 9], **i32)
    f = flashattn.flash_attn_varlen_func
    defects = {
        "cu int64": lambda: f(q, k, v, cu.long(), cu, 6, 6),
        "cu 2-D": lambda: f(q, k, v, cu.view(1, -1), cu, 6, 6),
        "cu empty": lambda: f(q, k, v, cu[:0], cu[:0], 6, 6),
        "cu batch mismatch": lambda: f(q, k, v, cu, cu[:3], 6, 6),
        "cu decreasing": lambda: f(q, k, v, torch.tensor([0, 5, 3, 9], **i32), cu, 6, 6),
        "cu first not 0": lambda: f(q, k, v, cu + d.pick([1, -1]), cu, 6, 6),
        "cu past the tokens": lambda: f(q, k, v, cu, torch.tensor([0, 3, 3, d.pick([10, 2**31 - 1])], **i32),
                                        6, 6),
        "cu strided": lambda: f(q, k, v, torch.tensor([0, 0, 3, 0, 3, 0, 9, 0], **i32)[::2], cu, 6, 6),
        "max_seqlen below the longest": lambda: f(q, k, v, cu, cu, d.pick([0, 5]), 6),
        "max_seqlen_k below the longest": lambda: f(q, k, v, cu, cu, 6, 2),
        "max_seqlen negative": lambda: f(q, k, v, cu, cu, -1, 6),
        "max_seqlen float": lambda: f(q, k, v, cu, cu, 6.0, 6),
        "q 4-D": lambda: f(q.unsqueeze(0), k, v, cu, cu, 6, 6),
        "qkvpacked cu": lambda: flashattn.flash_attn_varlen_qkvpacked_func(
            torch.stack([q, k, v], 1), torch.tensor([0, 4, 2, 9], **i32), 6),
        "private num_splits": lambda: fai._flash_attn_varlen_forward(q, k, v, cu, cu, 6, 6, 0.0, 0.25, False,
                                                                     num_splits=2),
        "private seqused_k": lambda: fai._flash_attn_varlen_forward(
            q, k, v, cu, cu, 6, 6, 0.0, 0.25, False, seqused_k=torch.tensor([4, 0, 6], **i32)),
    }
    del lens
    name = d.pick(sorted(defects))
    return Call("varlen", defects[name], invalid=name)


def _other_defect(d: Draw, env) -> Call:
    q, k, v = _qkv(d, env, sq=1)
    kc = _tensor(d, (2, 16, 1, 16), q.dtype, env.device)
    vc = kc.clone()
    i32 = dict(dtype=torch.int32, device=env.device)
    lse = torch.zeros(2, 2, 1, device=env.device)
    out = torch.zeros_like(q)
    cos = torch.ones(8, 4, device=env.device)
    kv = flashattn.flash_attn_with_kvcache
    defects = {
        "kvcache seqlens past the cache": lambda: kv(q, kc, vc, cache_seqlens=torch.tensor([3, 17], **i32)),
        "kvcache seqlens negative": lambda: kv(q, kc, vc, cache_seqlens=torch.tensor([-1, 2], **i32)),
        "kvcache append past the cache": lambda: kv(q, kc, vc, k[:, :1], v[:, :1], cache_seqlens=16),
        "kvcache k without v": lambda: kv(q, kc, vc, k[:, :1], None, cache_seqlens=3),
        "kvcache dtype": lambda: kv(q, kc.double(), vc.double()),
        "kvcache batch_idx": lambda: kv(q, kc, vc, cache_batch_idx=torch.tensor([0, 2], **i32)),
        "sparse lengths": lambda: flashattn.block_sparse_attn_func(
            q, k, v, flashattn.BlockMask.causal(5, 11, block_size=16, device=env.device)),
        "sparse not a mask": lambda: flashattn.block_sparse_attn_func(q, k, v, None),
        "merge lse shape": lambda: flashattn.merge_attention_states(out, lse[:, :1], out, lse),
        "merge lse float64": lambda: flashattn.merge_attention_states(out, lse.double(), out, lse.double()),
        "merge nothing": lambda: flashattn.merge_attention_states([], []),
        "rotary offset past the table": lambda: apply_rotary_emb(q, cos, cos, seqlen_offsets=8),
        "rotary dim past headdim": lambda: apply_rotary_emb(q, torch.ones(8, 9, device=env.device),
                                                            torch.ones(8, 9, device=env.device)),
        "private backward lse": lambda: fai._flash_attn_backward(out, q, k, v, out, lse[:, :, :0], None, None,
                                                                 None, 0.0, 0.25, False, -1, -1, 0.0, None,
                                                                 False),
        "private backward dq": lambda: fai._flash_attn_backward(out, q, k, v, out, lse, k, None, None, 0.0,
                                                                0.25, False, -1, -1, 0.0, None, False),
    }
    name = d.pick(sorted(defects))
    return Call("other", defects[name], invalid=name)


INVALID = [_dense_defect, _varlen_defect, _other_defect]


def draw_call(r: random.Random, env: Env, invalid_share: float = 0.35) -> Call:
    d = Draw(r)
    makers = INVALID if d.chance(invalid_share) else VALID
    return d.pick(makers)(d, env)


def run_call(call: Call) -> None:
    """Runs one call: a valid one passes its oracle check, an invalid one raises FlashAttnError."""
    try:
        result = call.run()
    except FlashAttnError as e:
        if call.invalid is None:
            raise AssertionError(f"{call.name}: a valid call was rejected: {e}") from e
        msg = str(e)
        assert msg and len(msg) > 20, f"{call.name} ({call.invalid}): an unhelpful message {msg!r}"
        return
    if call.invalid is not None:
        raise AssertionError(f"{call.name}: accepted an invalid call ({call.invalid})")
    try:
        call.check(result)
    except AssertionError as e:
        raise AssertionError(f"{call.name}: {e}") from e


def main(argv=None) -> None:
    """The GPU sample: `python tests/fuzz_cases.py --device cuda -n 300 [--seed 0]` (under compute-sanitizer
    by test_fuzz.py), and the same calls with the kernels' own clamps (launchers given bad cu_seqlens)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    dtypes = (torch.float16, torch.bfloat16) if on_cuda else (torch.float32,)
    env = Env(args.device, dtypes, max_len=70, max_batch_heads=8, grad_chance=0.4)
    r = random.Random(args.seed)
    for i in range(args.n):
        call = draw_call(r, env)
        run_call(call)
        if on_cuda:
            torch.cuda.synchronize()
        if i % 50 == 0:
            print(f"fuzz call {i}: {call.name} {call.invalid or 'valid'}", flush=True)
    for cu in BAD_CU_SEQLENS:
        launch_with_bad_cu_seqlens(cu, args.device, dtypes[0])
    if on_cuda:
        torch.cuda.synchronize()
    print(f"fuzz sample done: {args.n} calls, {len(BAD_CU_SEQLENS)} unchecked cu_seqlens", flush=True)


# cu_seqlens the checks would reject, handed straight to the Triton launchers (as unchecked CUDA values
# reach them): past the tokens, negative, decreasing, extreme, longer than max_seqlen; 20 tokens,
# max_seqlen 16
BAD_CU_SEQLENS = ([0, 10, 1_000_000], [0, -50, 20], [5, 3, 2**31 - 1], [-(2**31), 0, 40])


def launch_with_bad_cu_seqlens(cu, device, dtype) -> None:
    """The Triton launchers (forward, backward, S_dmask) with unchecked cu_seqlens: the kernels clamp every
    row into the packed tensors, so this must finish without touching memory out of bounds (the results are
    not specified)."""
    from flashattn.backends.triton import attention, probs

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 2, 16, generator=gen).to(device, dtype) for _ in range(3))
    c = torch.tensor(cu, dtype=torch.int32, device=device)
    kw = dict(softmax_scale=0.25, causal=True, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=16,
              max_seqlen_k=16)
    out, lse = attention.attention_forward(q, k, v, **kw)
    attention.attention_backward(torch.ones_like(out), q, k, v, out, lse, **kw)
    probs.attention_probs(q, k, dropout_p=0.3, rng_seed=1, rng_offset=0, block_n=64, **kw)


if __name__ == "__main__":
    main()
