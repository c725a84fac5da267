"""flash_attn_varlen_func(..., block_table=...): paged KV for varlen prefill (flashattn.paged).

The packed keys are scattered into shuffled page pools; the paged call must equal the packed call exactly (the
same kernels read the same values), its gradients must land in the pool slots the keys came from, and the
packed call itself is checked against the fp64 oracle here too. Bad block tables raise clear errors."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close_to_ref

from flashattn import config, flash_attn_varlen_func
from flashattn.reference import attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def _table(b, max_pages, gen):
    """Shuffled page numbers: sequence i owns pages table[i], the pool has 3 pages nobody owns."""
    num_pages = b * max_pages + 3
    table = torch.randperm(num_pages, generator=gen)[: b * max_pages].view(b, max_pages)
    return table.to(torch.int32), num_pages


def _pool(x, lengths, page, table, num_pages):
    """x packed (total, hk, d) scattered into a pool (num_pages, page, hk, d) by table; the slots no key
    takes hold 1e4 (attending one would show)."""
    pool = torch.full((num_pages, page, *x.shape[1:]), 1e4, dtype=x.dtype)
    start = 0
    for i, n in enumerate(lengths):
        for p in range(-(-n // page)):
            rows = x[start + p * page : start + min(n, (p + 1) * page)]
            pool[table[i, p], : rows.shape[0]] = rows.detach().cpu()
        start += n
    return pool.to(DEV)


@pytest.mark.parametrize("page", [16, 48, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_equals_packed(backend, page, causal):
    gen = torch.Generator().manual_seed(page + causal)
    lq, lk = [5, 0, 37, 1, 20], [9, 3, 70, 0, 20]  # empty sequences, sq != sk both ways
    h, hk, d, dv = 4, 2, 32, 16
    dt = torch.float16 if backend == "triton" else torch.float32
    q = torch.randn(sum(lq), h, d, generator=gen).to(DEV, dt)
    k = torch.randn(sum(lk), hk, d, generator=gen).to(DEV, dt)
    v = torch.randn(sum(lk), hk, dv, generator=gen).to(DEV, dt)
    max_pages = -(-max(lk) // page) + 1  # one spare column: entries past a sequence's keys are never read
    table, num_pages = _table(len(lk), max_pages, gen)
    k_pool, v_pool = (_pool(x, lk, page, table, num_pages) for x in (k, v))
    table = table.to(DEV)
    cu_q, cu_k = _cu(lq), _cu(lk)
    kw = dict(causal=causal, return_attn_probs=True)
    q1, kp, vp = (t.clone().requires_grad_() for t in (q, k_pool, v_pool))
    out, lse, _ = flash_attn_varlen_func(q1, kp, vp, cu_q, cu_k, max(lq), max(lk), block_table=table, **kw)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, _ = flash_attn_varlen_func(q2, k2, v2, cu_q, cu_k, max(lq), max(lk), **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)

    dout = torch.randn(out.shape, generator=gen).to(DEV, dt)
    dq, dk_pool, dv_pool = torch.autograd.grad(out, (q1, kp, vp), dout)
    dq_ref, dk, dv = torch.autograd.grad(ref_out, (q2, k2, v2), dout)
    assert torch.equal(dq, dq_ref)
    # each key's gradient sits in its pool slot; every other slot gets zero
    table_cpu = table.cpu()
    for grad_pool, grad in ((dk_pool, dk), (dv_pool, dv)):
        expect = _pool(grad, lk, page, table_cpu, num_pages)
        used = expect != 1e4
        assert torch.equal(grad_pool[used], expect[used]) and (grad_pool[~used] == 0).all()

    # and the packed path against the oracle, per sequence
    for i in range(len(lq)):
        if lq[i] == 0 or lk[i] == 0:
            continue
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref, _ = attention_ref(q[qs][None], k[ks][None], v[ks][None], causal=causal)
        pt, _ = attention_ref(q[qs][None], k[ks][None], v[ks][None], causal=causal, upcast=False)
        assert_close_to_ref(out[qs][None], ref, pt, name=f"out[{i}]")


@pytest.mark.parametrize("page", [16, 7])
def test_paged_inference_equals_packed(backend, page):
    """A call that needs no gradient takes the paged op (attn_fwd_paged: on the pools where the route reads
    pages, else on the gathered keys): equal to the packed call, sinks and windows included."""
    gen = torch.Generator().manual_seed(page)
    lq, lk = [5, 0, 37, 1, 20], [9, 3, 70, 0, 20]
    h, hk, d = 4, 2, 32
    dt = torch.float16 if backend == "triton" else torch.float32
    q, k, v = (torch.randn(sum(n), hh, d, generator=gen).to(DEV, dt)
               for n, hh in ((lq, h), (lk, hk), (lk, hk)))
    table, num_pages = _table(len(lk), -(-max(lk) // page), gen)
    k_pool, v_pool = (_pool(x, lk, page, table, num_pages) for x in (k, v))
    table, cu_q, cu_k = table.to(DEV), _cu(lq), _cu(lk)
    sink = torch.randn(h, generator=gen).to(DEV)
    for kw in (dict(causal=True), dict(window_size=(8, 0), learnable_sink=sink), dict(softcap=5.0)):
        with torch.no_grad():
            out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lq), max(lk), block_table=table,
                                         **kw)
            ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
        assert out.grad_fn is None
        assert torch.equal(out, ref), kw


def _small():
    q = torch.randn(6, 2, 16, device=DEV)
    pool = torch.randn(4, 16, 1, 16, device=DEV)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEV)
    return q, pool, table, _cu([3, 3]), _cu([20, 32])


def test_bad_block_tables():
    q, pool, table, cu_q, cu_k = _small()
    call = lambda **kw: flash_attn_varlen_func(  # noqa: E731
        kw.pop("q", q), kw.pop("k", pool), kw.pop("v", pool), cu_q, kw.pop("cu_k", cu_k), 3,
        kw.pop("max_k", 32), block_table=kw.pop("table", table))
    assert call().shape == (6, 2, 16)
    with pytest.raises(TypeError, match="block_table has dtype torch.int64; expected torch.int32"):
        call(table=table.long())
    with pytest.raises(ValueError, match=r"block_table has shape \(1, 2\); expected \(2, max_pages\)"):
        call(table=table[:1])
    with pytest.raises(ValueError, match="max_seqlen_k is 40 but block_table holds 2 pages of 16 keys = 32"):
        call(max_k=40)
    bad = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=DEV)
    with config.use_check_indices(True), pytest.raises(
            ValueError, match=r"block_table\[1, 1\] = 9; expected a page of the pool in \[0, 4\)"):
        call(table=bad)
    # unchecked (the default: checking reads the table on the host), the entry is clamped into the pool
    clamped = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEV)
    assert torch.equal(call(table=bad), call(table=clamped))
    with pytest.raises(ValueError, match=r"k must have 4 dimensions \(num_pages, page_size"):
        call(k=pool[0])
    with pytest.raises(ValueError, match="their page pools must match"):
        call(v=pool[:, :8])
    # an entry past a sequence's keys is never read, so it may hold anything
    spare = torch.tensor([[0, 1], [2, -5]], dtype=torch.int32, device=DEV)
    assert call(table=spare, cu_k=_cu([20, 16])).shape == (6, 2, 16)


def test_paged_inference_under_torch_compile():
    """The paged op (attn_fwd_paged) through torch.compile without graph breaks: its fake gives the output's
    shape, and the compiled call equals the eager one."""
    q, pool, table, cu_q, cu_k = _small()

    def call(q, k, v, table):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 32, block_table=table, causal=True)

    with torch.no_grad():
        eager = call(q, pool, pool, table)
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q, pool, pool, table)
    assert torch.equal(compiled, eager)

