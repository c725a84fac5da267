"""Random valid calls of every public function, each with its oracle (tests/fuzz_run.py draws and runs them,
with the invalid ones of tests/fuzz_defects.py): a `Call` says what to run and checks its result under the
tolerance rule (tests/utils.py). Shapes are small and odd (lengths 0, 1, 17, 33, ...).

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
from flashattn import fp8
from flashattn.layers.rotary import apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_
from flashattn.reference import attention_ref, attention_ref_fp8, attention_ref_varlen, masked_attention_ref


@dataclass
class Env:
    device: str
    dtypes: tuple
    max_len: int  # longest sequence drawn
    max_batch_heads: int  # batch * nheads drawn at most
    grad_chance: float  # share of valid calls that also check gradients
    # 16-bit calls run their backward too, checking only that the gradients are finite (the GPU memcheck
    # sample: the backward kernels must be in it; the module docstring says why not the oracle)
    backward_16bit: bool = False


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
    """Whether a valid call also runs its backward: float32 (checked; the module docstring says why), or
    16-bit where env.backward_16bit; non-empty."""
    wanted = dtype == torch.float32 or env.backward_16bit
    return wanted and all(sizes) and d.chance(env.grad_chance)


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
    if q.dtype != torch.float32:
        assert all(torch.isfinite(g).all() for g in our_grads(dout)), "gradients not finite"
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
            if dtype != torch.float32:
                assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out, (q, k, v), dout))
                return
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


# ------------------------------------------------------------------- paged KV caches and DecodePlan


def page_pool(d: Draw, env, b, hk, hd, dtype, page, max_pages, shared=False):
    """(k_pool, v_pool, block_table): pools of (num_pages, page, hk, hd) with 0-3 spare pages, and a (b,
    max_pages) int32 table of distinct pages in a shuffled order (shared: every sequence reads sequence 0's
    pages, a prefix cache)."""
    num_pages = b * max_pages + d.int(0, 3)
    gen = torch.Generator().manual_seed(d.int(0, 2**31 - 1))
    order = torch.randperm(num_pages, generator=gen)[: b * max_pages].view(b, max_pages)
    if shared:
        order = order[:1].expand(b, -1)
    table = order.to(torch.int32).contiguous().to(env.device)
    k_pool, v_pool = (_tensor(d, (num_pages, page, hk, hd), dtype, env.device) for _ in range(2))
    return k_pool, v_pool, table


def cache_lens(d: Draw, b, room):
    """Keys already in each of b caches, each in [0, room]: the edges often."""
    return [d.pick([0, room, d.int(0, room), d.int(0, room)]) for _ in range(b)]


def appended(cache, lens, new, table=None):
    """The cache (contiguous (b, cap, ...) or a page pool with its table) after new (b, s_new, ...) is
    written at positions lens[i], lens[i] + 1, ... of each sequence."""
    out = cache.clone()
    for i, n in enumerate(lens):
        for j in range(0 if new is None else new.shape[1]):
            pos = n + j
            if table is None:
                out[i, pos] = new[i, j]
            else:
                page = cache.shape[1]
                out[int(table[i, pos // page]), pos % page] = new[i, j]
    return out


def gathered(pool, table):
    """The (b, max_pages * page, ...) cache rows a block table maps out of a page pool (entries past the
    pages a sequence uses may be garbage: clamped, as they are masked anyway)."""
    return pool[table.long().clamp(0, pool.shape[0] - 1)].flatten(1, 2)


def check_decode(q, kf, vf, ends, out, lse, opts):
    """A decode call's out / lse against the oracle on the whole cache rows kf, vf (b, capacity, hk, d), row
    i attending to its first ends[i] keys (causal and windows aligned to them, as the call aligns them)."""
    ends = torch.as_tensor(ends, device=q.device).view(-1, 1)
    mask = torch.arange(kf.shape[1], device=q.device).view(1, -1) < ends
    kw = dict(opts, key_padding_mask=mask)
    ref, ref_lse = attention_ref(q, kf, vf, upcast=True, **kw)
    pt, pt_lse = attention_ref(q, kf, vf, upcast=False, **kw)
    _compare(out, ref, pt, "out", 2.0)
    _compare(lse, ref_lse, pt_lse, "lse", 2.0)


def _decode_options(d: Draw):
    """flash_attn_with_kvcache's attention options drawn for a decode call."""
    opts = {"causal": d.chance(0.5)}
    if d.chance(0.2):
        opts["window_size"] = (d.pick([-1, 0, 3, 17]), d.pick([-1, 0, 2]))
    if d.chance(0.1):
        opts["softcap"] = d.pick([0.5, 5.0])
    if d.chance(0.1):
        opts["softmax_scale"] = d.pick([0.05, 0.7])
    return opts


def paged_kvcache_call(d: Draw, env) -> Call:
    """flash_attn_with_kvcache on a page pool through a block table: the pool after the append (the pages
    written, nothing else), and out / lse against the oracle on the gathered pages."""
    b, sq = d.int(1, 3), d.pick([1, 1, 2, 3])
    h, hk = _heads(d, env, b)
    hd = d.pick([16, 32, 40])
    dtype = d.pick(env.dtypes)
    page = d.pick([16, 32])
    max_pages = d.int(1, -(-env.max_len // page) + 1)
    cap = page * max_pages
    s_new = d.pick([0, 0, 1, 2, 3])
    shared = s_new == 0 and b > 1 and d.chance(0.15)  # sequences sharing pages: appends would collide
    kc, vc, table = page_pool(d, env, b, hk, hd, dtype, page, max_pages, shared)
    lens = cache_lens(d, b, cap - s_new)
    as_int = d.chance(0.15)
    if as_int:
        lens = [lens[0]] * b
    ends = [n + s_new for n in lens]
    if d.chance(0.3):  # vLLM pads the table past each sequence's last page: never read, never checked
        table = table.clone()
        for i, e in enumerate(ends):
            table[i, -(-e // page):] = d.pick([-1, 10**6, 2**31 - 1])
    q = _tensor(d, (b, sq, h, hd), dtype, env.device)
    kn = vn = None
    if s_new:
        kn, vn = (_tensor(d, (b, s_new, hk, hd), dtype, env.device) for _ in range(2))
    seqlens = lens[0] if as_int else torch.tensor(lens, dtype=torch.int32, device=env.device)
    opts = _decode_options(d)
    check_inputs = d.pick([None, True, False])
    before = (kc.clone(), vc.clone())

    def run():
        return flashattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table,
                                                 return_softmax_lse=True, check_inputs=check_inputs, **opts)

    def check(res):
        out, lse = res
        kf, vf = appended(before[0], lens, kn, table), appended(before[1], lens, vn, table)
        assert torch.equal(kc, kf) and torch.equal(vc, vf), "the page pools after the append"
        check_decode(q, gathered(kf, table), gathered(vf, table), ends, out, lse, opts)

    return Call("kvcache-paged", run, check)


def decode_plan_call(d: Draw, env) -> Call:
    """DecodePlan(...).run on a random batch composition (paged or contiguous caches, an append, rotary,
    GQA, the plan's options, a replanned plan): the same out, lse and caches as flash_attn_with_kvcache with
    the plan's split count, and out / lse against the oracle."""
    b, sq = d.int(1, 3), d.pick([1, 1, 2])
    h, hk = _heads(d, env, b)
    hd = d.pick([16, 32, 40])
    dtype = d.pick(env.dtypes)
    page = d.pick([None, 16, 32])
    if page is None:
        cap = d.pick([16, 17, 33, env.max_len])
        kc, vc = (_tensor(d, (b, cap, hk, hd), dtype, env.device) for _ in range(2))
        table = None
    else:
        max_pages = d.int(1, -(-env.max_len // page) + 1)
        cap = page * max_pages
        kc, vc, table = page_pool(d, env, b, hk, hd, dtype, page, max_pages)
    s_new = d.pick([0, sq]) if cap >= sq else 0
    lens = cache_lens(d, b, cap - s_new)
    ends = [n + s_new for n in lens]
    q = _tensor(d, (b, sq, h, hd), dtype, env.device)
    new = {}
    if s_new:
        new = dict(zip("kv", (_tensor(d, (b, s_new, hk, hd), dtype, env.device) for _ in range(2)),
                       strict=True))
        if d.chance(0.25):
            rd = d.pick([r for r in (8, 16, hd) if r <= hd and r % 2 == 0])
            ang = torch.rand(cap, rd // 2, generator=torch.Generator().manual_seed(d.int(0, 2**31 - 1)),
                             dtype=torch.float64) * 6.3
            new.update(rotary_cos=ang.cos().to(env.device, dtype), rotary_sin=ang.sin().to(env.device, dtype))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=env.device)
    opts = _decode_options(d)
    interleaved = d.chance(0.5)
    plan_args = dict(page_size=page, max_seqlen_k=d.pick([cap, max(max(ends), 1), d.int(1, 2 * cap)]),
                     dtype=dtype, device=env.device, seqlen_q=sq, num_splits=d.pick([0, 0, 1, 2, 3]),
                     check_inputs=d.pick([None, True]), rotary_interleaved=interleaved, **opts)
    replan = d.chance(0.2)
    before = (kc.clone(), vc.clone())

    def run():
        if replan:  # a plan for another composition, replanned to this one (its workspace reused)
            plan = flashattn.DecodePlan(b + 1, h, hk, hd, **dict(plan_args, max_seqlen_k=2 * cap))
            plan = plan.replan(batch=b, max_seqlen_k=plan_args["max_seqlen_k"])
        else:
            plan = flashattn.DecodePlan(b, h, hk, hd, **plan_args)
        out, lse = plan.run(q, kc, vc, seqlens, table, return_softmax_lse=True, **new)
        return plan, out, lse

    def check(res):
        plan, out, lse = res
        kc2, vc2 = before[0].clone(), before[1].clone()
        ref, ref_lse = flashattn.flash_attn_with_kvcache(
            q, kc2, vc2, cache_seqlens=seqlens, block_table=table, num_splits=plan.num_splits,
            rotary_interleaved=interleaved, return_softmax_lse=True, **new, **opts)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse), (
            f"plan.run != flash_attn_with_kvcache (num_splits {plan.num_splits}): max diff "
            f"{(out.double() - ref.double()).abs().max().item() if out.numel() else 0}")
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "the caches after plan.run's append"
        if "rotary_cos" in new:  # the rotary oracle of an append: test_kvcache.py
            return
        kf, vf = (appended(c, lens, new.get(n), table) for c, n in zip(before, "kv", strict=True))
        assert torch.equal(kc, kf) and torch.equal(vc, vf), "the caches after the append"
        if table is not None:
            kf, vf = gathered(kf, table), gathered(vf, table)
        check_decode(q, kf, vf, ends, out, lse, opts)

    return Call(f"decode-plan-{'paged' if page else 'contiguous'}", run, check)


# ------------------------------------------------------------------------------------------ FP8 forward

FP8_FLOOR = 1e-3  # tests/test_interface_fp8.py: the output's own rounding; the LSE's is 1e-4


def _quantized(x, granularity, hk, seq_contiguous=False):
    """fp8.quantize(x, granularity), granularity "kv-head" too: q (b, s, h, d) with one descale per (batch,
    kv head) (FlashAttention-3's shape), quantised as (b, s, hk, h / hk * d)."""
    if granularity != "kv-head":
        return fp8.quantize(x, granularity, seq_contiguous=seq_contiguous)
    b, s, h, d = x.shape
    x8, descale = fp8.quantize(x.reshape(b, s, hk, (h // hk) * d), "head")
    return x8.view(b, s, h, d), descale


def _fp8_values(gen, b, s, heads, dim, sign, device):
    """Random values, each (batch, head) in a binade of its own (quantize's descales are powers of two: a
    descale read for the wrong head shows); q's shrink as k's grow (sign), so scores stay of order one."""
    binade = 2.0 ** (sign * torch.randint(0, 4, (b, 1, heads, 1), generator=gen).float())
    return (torch.randn(b, s, heads, dim, generator=gen) * binade).to(device)


def _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, out_dtype, opts):
    from utils import assert_close_to_ref

    ref, ref_lse = attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=True, **opts)
    pt, pt_lse = attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=False, out_dtype=out_dtype, **opts)
    assert out.dtype == out_dtype, f"out dtype {out.dtype}, expected {out_dtype}"
    assert_close_to_ref(out, ref, pt, atol_floor=FP8_FLOOR)
    assert_close_to_ref(lse, ref_lse, pt_lse, atol_floor=1e-4, name="lse")


def fp8_call(d: Draw, env) -> Call:
    """flash_attn_func / flash_attn_varlen_func on e4m3 q, k, v with descales (one left out: 1), against
    attention_ref_fp8 under the FP8 tolerance of tests/test_interface_fp8.py. out_dtype among env.dtypes:
    the interpreter's are fp16 / fp32 (it rounds to bf16 wrongly)."""
    varlen = d.chance(0.35)
    batch = d.int(1, 3) if varlen else d.int(1, 2)
    h, hk = _heads(d, env, 1 if varlen else batch)
    hd = d.pick([16, 32, 40])
    dv = hd if d.chance(0.8) else d.pick([16, 32])
    out_dtype = d.pick(env.dtypes)
    opts = {"causal": d.chance(0.5)}
    if d.chance(0.25):
        opts["window_size"] = (d.pick([-1, 0, 4, 19]), d.pick([-1, 0, 5]))
    if d.chance(0.15):
        opts["softcap"] = d.pick([0.5, 4.0])
    if d.chance(0.15):
        opts["alibi_slopes"] = _tensor(d, (h,), torch.float32, env.device).abs() * 0.3
    if d.chance(0.15):
        opts["learnable_sink"] = _tensor(d, (h,), torch.float32, env.device)
    if d.chance(0.1):
        opts["softmax_scale"] = d.pick([0.05, 0.3])
    gen = torch.Generator().manual_seed(d.int(0, 2**31 - 1))
    grans = (d.pick(["tensor", "head", "kv-head"]), d.pick(fp8.GRANULARITIES), d.pick(fp8.GRANULARITIES))
    v_seq_contiguous = d.chance(0.3)
    omit = d.pick([None] * 8 + [0, 1, 2])  # a descale left out means 1
    if not varlen:
        sq, sk = d.length(env), d.length(env)
        q8, k8, v8, qd, kd, vd = _fp8_dense(gen, env, batch, (sq, sk), (h, hk), (hd, dv), grans,
                                            v_seq_contiguous)
        cu_q = cu_k = None
    else:
        lens_q = [d.length(env, zero=0.15) for _ in range(batch)]
        lens_k = [d.length(env, zero=0.1) for _ in range(batch)]
        extra = d.pick([0, 0, 3])  # rows past the last sequence (unspecified)
        q8, k8, v8, qd, kd, vd = _fp8_varlen(gen, env, (lens_q, lens_k), extra, (h, hk), (hd, dv), grans,
                                             v_seq_contiguous and d.chance(0.5))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n, dtype=torch.int64).cumsum(0).tolist()],
                                   dtype=torch.int32, device=env.device) for n in (lens_q, lens_k))
        mq, mk = max(lens_q), max(lens_k)
    tensors, descales = [q8, k8, v8], [qd, kd, vd]
    if omit is not None and descales[omit].numel() == 1:  # that tensor's values taken as they are (x · 1)
        tensors[omit] = (tensors[omit].float() * descales[omit]).to(fp8.FP8)
        descales[omit] = torch.ones(1, device=env.device)
    else:
        omit = None
    q8, k8, v8 = tensors
    given = {f"{n}_descale": None if i == omit else x for i, (n, x) in enumerate(zip("qkv", descales,
                                                                                   strict=True))}

    def run():
        if cu_q is None:
            return flashattn.flash_attn_func(q8, k8, v8, return_attn_probs=True, out_dtype=out_dtype, **given,
                                             **opts)
        return flashattn.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, return_attn_probs=True,
                                                out_dtype=out_dtype, **given, **opts)

    def check(res):
        out, lse, s = res
        assert s.numel() == 0, "S_dmask of an FP8 call: empty"
        assert out.shape == (*q8.shape[:-1], dv), f"out shape {tuple(out.shape)}"
        if cu_q is None:
            _check_fp8(out, lse, q8, k8, v8, *descales, out_dtype, opts)
            return
        for i in range(batch):
            rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            ds = [x if x.numel() == 1 else x[i : i + 1] for x in descales]
            _check_fp8(out[rq].unsqueeze(0), lse[:, rq].unsqueeze(0), q8[rq].unsqueeze(0),
                       k8[rk].unsqueeze(0), v8[rk].unsqueeze(0), *ds, out_dtype, opts)

    return Call(f"fp8-{'varlen' if varlen else 'dense'}", run, check)


def _fp8_dense(gen, env, b, lens, heads, dims, grans, v_seq_contiguous):
    (sq, sk), (h, hk), (hd, dv) = lens, heads, dims
    q, k, v = (_fp8_values(gen, b, s, n, dim, sign, env.device)
               for s, n, dim, sign in ((sq, h, hd, -1), (sk, hk, hd, 1), (sk, hk, dv, 1)))
    (q8, qd), (k8, kd), (v8, vd) = (_quantized(x, g, hk, seq) for x, g, seq in
                                    zip((q, k, v), grans, (False, False, v_seq_contiguous), strict=True))
    return q8, k8, v8, qd, kd, vd


def _fp8_varlen(gen, env, lens, extra, heads, dims, grans, v_seq_contiguous):
    """Packed e4m3 q, k, v (extra zero rows past the last sequence) and their descales: per tensor, or per
    sequence and head (each sequence quantised alone: (batch, heads) descales); a per-sequence granularity
    "tensor" drawn becomes "head" (a varlen descale is (1,) or (batch, heads))."""
    (lens_q, lens_k), (h, hk), (hd, dv) = lens, heads, dims
    if grans[0] == "tensor":  # per tensor: the packed tensors quantised at once
        parts = [_fp8_values(gen, 1, sum(n) + extra, heads_, dim, sign, env.device)
                 for n, heads_, dim, sign in ((lens_q, h, hd, -1), (lens_k, hk, hd, 1), (lens_k, hk, dv, 1))]
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, seq_contiguous=seq) for x, seq in
                                        zip(parts, (False, False, v_seq_contiguous), strict=True))
        return q8[0], k8[0], v8[0], qd, kd, vd
    seqs = []
    for lq, lk in zip(lens_q, lens_k, strict=True):
        q, k, v = (_fp8_values(gen, 1, s, n, dim, sign, env.device)
                   for s, n, dim, sign in ((lq, h, hd, -1), (lk, hk, hd, 1), (lk, hk, dv, 1)))
        seqs.append((_quantized(q, grans[0], hk), fp8.quantize(k, "head"), fp8.quantize(v, "head")))
    out = []
    for i in range(3):
        x8 = torch.cat([s[i][0][0] for s in seqs])
        x8 = torch.cat([x8, x8.new_zeros(extra, *x8.shape[1:])])
        out.append(x8)
    return (*out, *(torch.cat([s[i][1] for s in seqs]) for i in range(3)))


# -------------------------------------------------------------------------- the varlen private backward

SENTINEL = 7.0  # what the dq / dk / dv buffers hold before a private backward writes into them


def varlen_backward_call(d: Draw, env) -> Call:
    """flash_attn 2.8's _flash_attn_varlen_forward then _flash_attn_varlen_backward writing into given dq,
    dk, dv (separate buffers, or views of a packed dkv / dqkv buffer as flash_attn's packed functions pass):
    the gradients against the oracle's (float32: the module docstring says why), the rows no sequence
    holds zeroed with zero_tensors or left as they were, and the softmax_d it returns."""
    batch = d.int(1, 3)
    lens_q = [min(d.length(env, zero=0.15), 24) for _ in range(batch)]
    lens_k = [min(d.length(env, zero=0.1), 24) for _ in range(batch)]
    h, hk = _heads(d, env, 1)
    hd = d.pick([8, 16, 40])
    layout = d.pick(["separate", "separate", "dkv", "dqkv"])
    if layout == "dqkv":
        lens_k, hk = lens_q, h
    extra = d.pick([0, 0, 2])
    tq, tk = sum(lens_q) + extra, sum(lens_k) + extra
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                               device=env.device) for n in (lens_q, lens_k))
    mq, mk = max(lens_q) + d.pick([0, 0, 3]), max(lens_k)
    if layout == "dqkv":
        mk = mq
    opts = _options(d, env, batch, h)
    opts.setdefault("causal", False)
    # scores of order a few: with _options' scale 1.7 (|s| ~ 30) the kernels' float32 rounding of the
    # recomputed probabilities can pass 3x plain PyTorch's (seen under the interpreter: dv off by 2.5e-5 at
    # |dv| ~ 4, 6 parts in a million, against a tolerance of 1.9e-5): rounding, not a defect
    scale = opts["softmax_scale"] = d.pick([hd ** -0.5, hd ** -0.5, 0.05, 0.3])
    left, right = _ref_options(opts)["window_size"]
    p = opts.get("dropout_p", 0.0)
    dtype = torch.float32
    q, k, v = (_tensor(d, s, dtype, env.device) for s in ((tq, h, hd), (tk, hk, hd), (tk, hk, hd)))
    dout = _tensor(d, (tq, h, hd), dtype, env.device)
    zero_tensors, deterministic = d.chance(0.3), d.chance(0.3)
    if layout == "dqkv":
        buf = torch.full((tq, 3, h, hd), SENTINEL, device=env.device)
        grads = list(buf.unbind(1))
    elif layout == "dkv":
        buf = torch.full((tk, 2, hk, hd), SENTINEL, device=env.device)
        grads = [torch.full_like(q, SENTINEL), *buf.unbind(1)]
    else:
        grads = [torch.full_like(x, SENTINEL) for x in (q, k, v)]

    def run():
        out, lse, s_dmask, rng = fai._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, mq, mk, p, scale, opts["causal"], left, right, opts.get("softcap", 0.0),
            opts.get("alibi_slopes"), True)
        softmax_d = fai._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, *grads, cu_q, cu_k, mq, mk, p, scale, opts["causal"], left, right,
            opts.get("softcap", 0.0), opts.get("alibi_slopes"), deterministic, rng, zero_tensors)
        return out, s_dmask, softmax_d

    def check(res):
        out, s_dmask, softmax_d = res
        ref_opts = _ref_options(opts)
        if p:
            ref_opts.update(dropout_p=p, dropout_mask=~torch.signbit(s_dmask))
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        ref = attention_ref_varlen(*leaves, cu_q, cu_k, upcast=True, **ref_opts)[0]
        pt = attention_ref_varlen(*leaves, cu_q, cu_k, upcast=False, **ref_opts)[0]
        rq, rk = slice(0, int(cu_q[-1])), slice(0, int(cu_k[-1]))
        _compare(out[rq], ref[rq], pt[rq], "out", 2.0)
        g_ref = torch.autograd.grad(ref, leaves, dout.double())
        g_pt = torch.autograd.grad(pt, leaves, dout)
        for name, g, r, gp, rows in zip(("dq", "dk", "dv"), grads, g_ref, g_pt, (rq, rk, rk), strict=True):
            _compare(g[rows], r[rows], gp[rows], name, 3.0)
            past = g[rows.stop:]
            want = 0.0 if zero_tensors else SENTINEL
            assert torch.all(past == want), f"{name}: the rows past the sequences are not {want}"
        # softmax_d: rowsum(dout * out), row t of sequence i at column t + 128 i (flash_attn's layout)
        assert softmax_d.shape == (h, tq + 128 * batch), f"softmax_d shape {tuple(softmax_d.shape)}"
        rows = torch.arange(int(cu_q[-1]), device=env.device)
        seq = torch.searchsorted(cu_q[1:].long(), rows, right=True)
        want_d = (dout[rq].double() * out[rq].double()).sum(-1).t()
        torch.testing.assert_close(softmax_d[:, rows + 128 * seq].double(), want_d, rtol=1e-4, atol=1e-4)

    return Call(f"varlen-private-backward-{layout}", run, check)


# ------------------------------------------------------------------------------ packed rotary (in place)


def _rotate_ref(x, cos, sin, pos, interleaved, dt):
    """x (b, s, heads, d) rotated at positions pos (b, s) in dtype dt; a position past the tables (or
    negative) leaves its token unrotated."""
    rd = 2 * cos.shape[1]
    seen = ((pos >= 0) & (pos < cos.shape[0])).unsqueeze(-1)
    idx = pos.clamp(0, cos.shape[0] - 1)
    c = torch.where(seen, cos.double()[idx], 1.0).to(dt).unsqueeze(-2)
    s = torch.where(seen, sin.double()[idx], 0.0).to(dt).unsqueeze(-2)
    xr = x[..., :rd].to(dt)
    a, b = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : rd // 2], xr[..., rd // 2 :])
    parts = (a * c - b * s, a * s + b * c)
    rot = torch.stack(parts, -1).flatten(-2) if interleaved else torch.cat(parts, -1)
    return torch.cat((rot, x[..., rd:].to(dt)), -1)


def rotary_packed_call(d: Draw, env) -> Call:
    """apply_rotary_emb_qkv_ (qkv (b, s, 3, h, d), or (b, s, h + 2 hk, d) with num_heads_q; k's own tables
    or q's) and apply_rotary_emb_kv_, in place: the q / k parts against a float64 rotation, v unchanged,
    the call returning its argument; in float32 the gradient too (the inverse rotation)."""
    b, s = d.int(1, 2), d.int(1, 20)
    hd = d.pick([8, 16, 24, 40])
    rd = d.pick([r for r in (4, 8, 16, 24, 40) if r <= hd])
    dtype = d.pick(env.dtypes)
    form = d.pick(["qkv", "qkv-gqa", "kv"])
    h, hk = _heads(d, env, b)
    seqlen_ro = s + d.int(0, 6)
    gen = torch.Generator().manual_seed(d.int(0, 2**31 - 1))
    table_dtype = d.pick([dtype, torch.float32])

    def tables():
        ang = torch.outer(torch.arange(seqlen_ro, dtype=torch.float64),
                          torch.rand(rd // 2, generator=gen, dtype=torch.float64))
        return ang.cos().to(env.device, table_dtype), ang.sin().to(env.device, table_dtype)

    cos, sin = tables()
    cos_k = sin_k = None
    if form != "kv" and d.chance(0.3):  # k's own tables (XPos-like)
        cos_k, sin_k = (t * 0.5 for t in tables())
    interleaved = d.chance(0.5)
    if d.chance(0.3):  # per-sequence offsets: past the tables, tokens stay unrotated
        offsets = torch.tensor([d.int(0, seqlen_ro - s + 4) for _ in range(b)],
                               dtype=d.pick([torch.int32, torch.int64]), device=env.device)
        pos = torch.arange(s, device=env.device).view(1, -1) + offsets.long().view(-1, 1)
    else:
        offsets = d.int(0, seqlen_ro - s)
        pos = (torch.arange(s, device=env.device) + offsets).view(1, -1).expand(b, s)
    if form == "qkv":
        x = _tensor(d, (b, s, 3, h, hd), dtype, env.device)
        parts = lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2])  # noqa: E731
    elif form == "qkv-gqa":
        x = _tensor(d, (b, s, h + 2 * hk, hd), dtype, env.device)
        parts = lambda t: (t[:, :, :h], t[:, :, h : h + hk], t[:, :, h + hk :])  # noqa: E731
    else:
        x = _tensor(d, (b, s, 2, hk, hd), dtype, env.device)
        parts = lambda t: (None, t[:, :, 0], t[:, :, 1])  # noqa: E731
    grads = dtype == torch.float32 and d.chance(env.grad_chance)
    leaf = x.clone().requires_grad_(grads)

    def run():
        work = leaf * 1.0 if grads else leaf.clone()  # a non-leaf, rotated in place
        if form == "kv":
            return work, apply_rotary_emb_kv_(work, cos, sin, interleaved, offsets)
        kw = {"num_heads_q": h} if form == "qkv-gqa" else {}
        return work, apply_rotary_emb_qkv_(work, cos, sin, cos_k, sin_k, interleaved, offsets, **kw)

    def check(res):
        work, out = res
        assert out is work, "the packed rotary returns its argument, rotated in place"
        want = [(cos, sin), (cos if cos_k is None else cos_k, sin if sin_k is None else sin_k)]
        for name, got, orig, (c, sn) in zip("qk", parts(out)[:2], parts(x)[:2], want, strict=True):
            if orig is not None:
                _compare(got, _rotate_ref(orig, c, sn, pos, interleaved, torch.float64),
                         _rotate_ref(orig, c, sn, pos, interleaved, dtype), f"rotary {name}", 2.0)
        assert torch.equal(parts(out)[2], parts(x)[2]), "v must stay as it was"
        if grads:
            g = _tensor(d, x.shape, dtype, env.device)
            (grad,) = torch.autograd.grad(out, leaf, g)
            for name, got, gin, (c, sn) in zip("qk", parts(grad)[:2], parts(g)[:2], want, strict=True):
                if gin is not None:  # the inverse rotation: by the negated sines
                    _compare(got, _rotate_ref(gin, c, -sn, pos, interleaved, torch.float64),
                             _rotate_ref(gin, c, -sn, pos, interleaved, dtype), f"d{name}", 3.0)
            assert torch.equal(parts(grad)[2], parts(g)[2]), "dv: the gradient passes v unchanged"

    return Call(f"rotary-{form}", run, check)


VALID = [dense_call, dense_call, varlen_call, varlen_call, private_backward_call, kvcache_call, sparse_call,
         merge_call, rotary_call, paged_kvcache_call, decode_plan_call, fp8_call, varlen_backward_call,
         rotary_packed_call]
