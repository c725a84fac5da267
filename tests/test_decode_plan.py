"""DecodePlan: plan once, run many. Its results against flash_attn_with_kvcache (the same machinery, bitwise
the same for the same split count), its checks, re-planning, the registered-op path torch.compile takes, and
the workspace it leaves reusable. The oracle comparisons of plan.run are in test_kvcache.py (its "plan-*"
cases)."""

from __future__ import annotations

import pytest
import torch
from utils import INTERPRET

from flashattn import DecodePlan, flash_attn_with_kvcache
from flashattn.ops.registry import through_registered_ops

B, H, HK, D, PAGE, PAGES = 2, 8, 2, 32, 16, 5


def _inputs(seed=0, sq=1, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    pool = PAGES * B + 2
    return dict(
        q=torch.randn(B, sq, H, D, generator=g).to(dtype),
        k_cache=torch.randn(pool, PAGE, HK, D, generator=g).to(dtype),
        v_cache=torch.randn(pool, PAGE, HK, D, generator=g).to(dtype),
        k=torch.randn(B, sq, HK, D, generator=g).to(dtype),
        v=torch.randn(B, sq, HK, D, generator=g).to(dtype),
        rotary_cos=torch.rand(PAGE * PAGES, 8, generator=g),
        rotary_sin=torch.rand(PAGE * PAGES, 8, generator=g),
        cache_seqlens=torch.tensor([37, 70], dtype=torch.int32),
        block_table=torch.randperm(pool, generator=g)[: B * PAGES].view(B, PAGES).to(torch.int32),
    )


def _plan(**kw):
    args = dict(page_size=PAGE, max_seqlen_k=PAGE * PAGES, dtype=torch.float16, device="cpu", causal=True)
    args.update(kw)
    return DecodePlan(B, H, HK, D, **args)


def _run(plan, a):
    return plan.run(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"], k=a["k"],
                    v=a["v"], rotary_cos=a["rotary_cos"], rotary_sin=a["rotary_sin"], return_softmax_lse=True)


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_run_equals_flash_attn_with_kvcache(backend, splits):
    plan = _plan(num_splits=splits)
    a, b = _inputs(), _inputs()
    out, lse = _run(plan, a)
    ref, ref_lse = flash_attn_with_kvcache(b["q"], b["k_cache"], b["v_cache"], b["k"], b["v"],
                                           b["rotary_cos"], b["rotary_sin"], b["cache_seqlens"],
                                           block_table=b["block_table"], causal=True, num_splits=splits,
                                           return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    if backend == "triton":
        # the planned route: what the drop-in's default route would be at this capacity
        assert plan.route is not None and plan.num_splits == (splits or plan.route.num_splits)
        assert plan.route.num_splits > 1 or splits == 1
    # a second run of the same signature takes the kept launch: the same result again
    again, _ = _run(plan, _inputs())
    assert torch.equal(again, out)


def test_run_through_the_registered_op(backend):
    # what torch.compile traces: the op, with the plan's split count; the same arithmetic
    plan = _plan(num_splits=3)
    eager, _ = _run(plan, _inputs())
    with through_registered_ops():
        traced, _ = _run(plan, _inputs())
    assert torch.equal(eager, traced)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's workspace lives on the CPU")
def test_workspace_counters_return_to_zero(monkeypatch):
    from flashattn import config

    monkeypatch.setattr(config, "backend", "triton")
    plan = _plan(num_splits=3)
    _run(plan, _inputs())
    ws = plan._workspace
    assert ws is not None and ws.counters.numel() == B * HK  # one row of programs per (batch, kv head)
    assert torch.count_nonzero(ws.counters) == 0
    # the next plan for a smaller batch composition shares it
    smaller = plan.replan(max_seqlen_k=64)
    assert smaller._workspace is ws and smaller.route.num_splits <= plan.route.num_splits


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's workspace lives on the CPU")
def test_calls_without_a_plan_share_their_streams_workspace(monkeypatch):
    # flash_attn_with_kvcache's launches take their stream's workspace (no allocation and no zeroing per
    # call), grown for a larger launch and left with its counters at 0; the same results as a workspace of
    # the call's own (what a call under CUDA graph capture allocates)
    from flashattn import config
    from flashattn.backends.triton import decode

    monkeypatch.setattr(config, "backend", "triton")
    monkeypatch.setattr(decode, "_stream_workspaces", {})

    def call(a, splits):
        return flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["rotary_cos"],
                                       a["rotary_sin"], a["cache_seqlens"], block_table=a["block_table"],
                                       causal=True, num_splits=splits, return_softmax_lse=True)

    outs, sizes = [], []
    for seed, splits in ((0, 3), (1, 2), (2, 4)):
        outs.append(call(_inputs(seed), splits))
        (ws,) = decode._stream_workspaces.values()
        assert ws.counters.numel() >= B * HK and torch.count_nonzero(ws.counters) == 0
        sizes.append(ws.partials.numel())
    assert sizes[0] == sizes[1] < sizes[2]  # kept for the 2-split launch, grown for the 4-split one
    monkeypatch.setattr(decode, "stream_workspace", lambda *args: None)
    for (seed, splits), (out, lse) in zip(((0, 3), (1, 2), (2, 4)), outs, strict=True):
        fresh, fresh_lse = call(_inputs(seed), splits)
        assert torch.equal(out, fresh) and torch.equal(lse, fresh_lse)


def test_replan_changes_only_what_is_asked():
    plan = _plan()
    other = plan.replan(batch=4, max_seqlen_k=32)
    assert (other.batch, other.max_seqlen_k, other.page_size, other.causal) == (4, 32, PAGE, True)
    assert "DecodePlan(batch=4" in repr(other)


BAD_PLANS = {
    "gqa": (dict(nheads=6), r"nheads=6 is not a multiple of nheads_k=4"),
    "page": (dict(page_size=20), r"page_size=20; expected a multiple of 16"),
    "dtype": (dict(dtype=torch.float64), r"dtype=torch.float64; expected one of"),
    "max_seqlen_k": (dict(max_seqlen_k=0), r"max_seqlen_k must be an int >= 1, got 0"),
    "splits": (dict(num_splits=-1), r"num_splits must be an int >= 0, got -1"),
    "window": (dict(window_size=(2.5, 0)), r"window_size left must be an int >= -1"),
}


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_bad_plan(name):
    changes, match = BAD_PLANS[name]
    args = dict(batch=2, nheads=8, nheads_k=4, headdim=32, max_seqlen_k=64, device="cpu")
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        DecodePlan(**args)


BAD_RUNS = {
    "q-shape": (lambda a: dict(a, q=a["q"][:1]),
                r"q has shape \(1, 1, 8, 32\); the plan expects \(2, 1, 8, 32\)"),
    "q-dtype": (lambda a: dict(a, **{n: a[n].float() for n in ("q", "k_cache", "v_cache", "k", "v")}),
                r"the plan expects torch.float16"),
    "contiguous-cache": (lambda a: dict(a, block_table=None, k_cache=a["k_cache"][:2],
                                        v_cache=a["v_cache"][:2]),
                         r"the plan is for paged caches \(page_size 16\); block_table is None"),
    "page-size": (lambda a: dict(a, k_cache=a["k_cache"].view(-1, 32, HK, D),
                                 v_cache=a["v_cache"].view(-1, 32, HK, D)), r"k_cache has page_size 32"),
    # flash_attn_with_kvcache's own checks come first
    "heads": (lambda a: dict(a, k=a["k"][:, :, :1]), r"k has shape .* expected \(2, seqlen_new, 2, 32\)"),
}


@pytest.mark.parametrize("name", list(BAD_RUNS))
def test_bad_run(name, monkeypatch):
    from flashattn import config

    monkeypatch.setattr(config, "backend", "torch")
    make, match = BAD_RUNS[name]
    with pytest.raises(ValueError, match=match):
        _run(_plan(), make(_inputs()))


@pytest.mark.parametrize("sq", [1, 3])
def test_the_merge_of_the_packed_rows_equals_the_merge_of_the_block(sq):
    # the route's merge takes a block's packed rows (GQA group 4 x sq: 4 or 12 of a 16-row block); the
    # whole block is the same arithmetic row by row, so the same bits
    import dataclasses

    from flashattn import config
    from flashattn.errors import FlashAttnError

    with config.use_backend("triton"):
        plan, whole = _plan(num_splits=3, seqlen_q=sq), _plan(num_splits=3, seqlen_q=sq)
        assert plan.route.merge_rows == (4 if sq == 1 else 16) and plan.route.block_m == 16
        whole.route = dataclasses.replace(whole.route, merge_rows=whole.route.block_m)
        out, lse = _run(plan, _inputs(sq=sq))
        ref, ref_lse = _run(whole, _inputs(sq=sq))
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
        # fewer merge rows than the block's packed rows would leave rows unmerged: refused
        few = _plan(num_splits=3, seqlen_q=sq)
        few.route = dataclasses.replace(few.route, merge_rows=2)
        with pytest.raises(FlashAttnError, match="merge_rows=2"):
            _run(few, _inputs(sq=sq))
