"""Random valid calls of flash_attn's private varlen backward, of the paged varlen prefill and of the packed
rotary layers (in place), with their oracles (tests/fuzz_cases.py's Call and Draw)."""

from __future__ import annotations

import torch
from fuzz_cases import Call, Draw, _compare, _heads, _options, _ref_options, _tensor

import flashattn
from flashattn import flash_attn_interface as fai
from flashattn.layers.rotary import apply_rotary_emb_kv_, apply_rotary_emb_qkv_
from flashattn.reference import attention_ref_varlen

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


# ----------------------------------------------------------------------------- paged varlen prefill


def paged_prefill_call(d: Draw, env) -> Call:
    """flash_attn_varlen_func with a block_table and no gradient (the paged op: the pools read in the kernel
    where the route can, routes.reads_pages, the keys gathered otherwise): each sequence's keys on shuffled
    pages of 16, 64, 128 or 256 with spare columns and spare pages, whose slots hold 1e4 (attending one
    would show), against the oracle on the packed keys."""
    batch = d.int(1, 3)
    lens_q = [d.length(env, zero=0.15) for _ in range(batch)]
    lens_k = [d.length(env, zero=0.1) for _ in range(batch)]
    h, hk = _heads(d, env, batch)
    hd = d.pick([16, 40, 64])
    dtype = d.pick(env.dtypes)
    page = d.pick([16, 64, 128, 256])
    max_pages = max(max(-(-n // page) for n in lens_k), 1) + d.pick([0, 1])
    num_pages = batch * max_pages + d.pick([0, 2])
    table = torch.randperm(num_pages, generator=d.generator())[: batch * max_pages].view(batch, max_pages)
    q = _tensor(d, (sum(lens_q), h, hd), dtype, env.device)
    k, v = (_tensor(d, (sum(lens_k), hk, hd), dtype, env.device) for _ in range(2))
    pools = []
    for x in (k, v):
        pool = torch.full((num_pages, page, hk, hd), 1e4, dtype=dtype, device=env.device)
        start = 0
        for b, n in enumerate(lens_k):
            for p in range(-(-n // page)):
                rows = x[start + p * page: start + min(n, (p + 1) * page)]
                pool[int(table[b, p]), : rows.shape[0]] = rows
            start += n
        pools.append(pool)
    table = table.to(torch.int32).to(env.device)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                               device=env.device) for n in (lens_q, lens_k))
    mq, mk = max(lens_q), max(lens_k)
    opts = _options(d, env, batch, h)
    opts.pop("dropout_p", None)

    def run():
        with torch.no_grad():
            return flashattn.flash_attn_varlen_func(q, *pools, cu_q, cu_k, mq, mk, block_table=table, **opts)

    def check(out):
        assert out.shape == (sum(lens_q), h, hd) and out.grad_fn is None
        ref_opts = _ref_options(opts)
        ref = attention_ref_varlen(q, k, v, cu_q, cu_k, upcast=True, **ref_opts)[0]
        pt = attention_ref_varlen(q, k, v, cu_q, cu_k, upcast=False, **ref_opts)[0]
        _compare(out, ref, pt, "out", 2.0)

    return Call(f"paged-prefill-{page}", run, check)


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
    gen = d.generator()
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
