"""Random valid calls of the attention functions, each with its oracle (tests/fuzz_run.py draws and runs
them, with those of fuzz_cases_decode.py, fuzz_cases_fp8.py and fuzz_cases_api.py and the invalid ones of
tests/fuzz_defects.py): a `Call` says what to run and checks its result under the tolerance rule
(tests/utils.py). Shapes are small and odd (lengths 0, 1, 17, 33, ...).

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
from flashattn.layers.rotary import apply_rotary_emb
from flashattn.reference import attention_ref, attention_ref_varlen, masked_attention_ref


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

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from this draw: a case's tensors repeat with its seed."""
        return torch.Generator().manual_seed(self.int(0, 2**31 - 1))

    def length(self, env, zero=0.05):
        if self.chance(zero):
            return 0
        return self.pick([1, 2, 5, 16, 17, 31, 33, env.max_len, self.int(1, env.max_len)])


def _tensor(d: Draw, shape, dtype, device, strided=False, scale=1.0):
    gen = d.generator()
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
        gen = d.generator()
        shape = (h,) if d.chance(0.5) else (b, h)
        opts["alibi_slopes"] = torch.rand(*shape, generator=gen).to(env.device) * 0.5
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


def _compare(got, ref, pt, name, factor, floor=1e-5):
    from utils import assert_close_to_ref

    assert_close_to_ref(got, ref, pt, factor=factor, atol_floor=floor, name=name)


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
    # dv = 1 in 16 bits: each output is one rounding of a single sum, and plain PyTorch's max error over a
    # handful of them is a small sample; the floor is then one unit in the last place at the output's
    # magnitude, as test_head_dims (tests/test_interface.py) has a rounding floor for d = 1 (seed 27's case
    # 737731676: fp16, ours -1.29297 where the oracle has -1.29366 and plain PyTorch the nearer -1.29395)
    floor = 1e-5
    if v.shape[-1] == 1 and q.dtype != torch.float32 and ref[rows_q].numel():
        floor = max(floor, torch.finfo(q.dtype).eps * ref[rows_q].abs().max().item())
    _compare(out[rows_q], ref[rows_q], pt[rows_q], "out", 2.0, floor)
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
    gen = d.generator()
    ang = torch.outer(torch.arange(seqlen_ro, dtype=torch.float64),
                      torch.rand(rd // 2, dtype=torch.float64, generator=gen))
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
