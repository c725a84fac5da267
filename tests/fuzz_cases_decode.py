"""Random valid calls of the paged KV cache and of DecodePlan, with their oracles (tests/fuzz_cases.py's
Call and Draw; drawn by tests/fuzz_run.py)."""

from __future__ import annotations

import torch
from fuzz_cases import Call, Draw, _compare, _heads, _tensor

import flashattn
from flashattn.reference import attention_ref

# ------------------------------------------------------------------- paged KV caches and DecodePlan


def page_pool(d: Draw, env, b, hk, hd, dtype, page, max_pages, shared=False):
    """(k_pool, v_pool, block_table): pools of (num_pages, page, hk, hd) with 0-3 spare pages, and a (b,
    max_pages) int32 table of distinct pages in a shuffled order (shared: every sequence reads sequence 0's
    pages, a prefix cache)."""
    num_pages = b * max_pages + d.int(0, 3)
    gen = d.generator()
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
            ang = torch.rand(cap, rd // 2, generator=d.generator(),
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
