"""The dense kernels' launch order (1D grids through kernels/triton/common.py::grouped_program; the routes'
lpt_group): it may not change a single bit of the results, and it must visit every (head, tile) once,
heaviest tiles of a group of heads first."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from utils import INTERPRET, LaunchRecorder, make_qkv, program_pairs

from flashattn.backends.triton import attention as launchers
from flashattn.backends.triton import routes
from flashattn.kernels.triton.common import grouped_program

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")


@pytest.mark.parametrize("n_bh, n_tiles, group", [(1, 1, 1), (5, 3, 1), (8, 4, 3), (7, 5, 7), (6, 2, 4),
                                                   (16, 9, 16)])
def test_grouped_order_covers_every_tile_once(n_bh, n_tiles, group):
    pairs = program_pairs(grouped_program, n_bh * n_tiles, n_bh, n_tiles, group)
    assert sorted(pairs) == [(b, t) for b in range(n_bh) for t in range(n_tiles)]
    # groups run one after the other; inside one, every head's rank r before any head's rank r + 1
    groups = [b // group for b, _ in pairs]
    assert groups == sorted(groups)
    for g in set(groups):
        ranks = [t for b, t in pairs if b // group == g]
        assert ranks == sorted(ranks)
    if group == 1:
        assert pairs == [(b, t) for b in range(n_bh) for t in range(n_tiles)]  # plain head-major


def _spec(window=(-1, -1), s=1024, h=16, hk=16):
    return routes.Spec(2, h, hk, s, s, 128, 128, window=window)


def test_group_size_follows_the_masking_and_the_l2_budget():
    assert routes.lpt_group(_spec(), 32, 1 << 20) == 1  # every tile of a head does the same work
    assert routes.lpt_group(_spec(window=(-1, 0)), 32, 1 << 20) == 16  # 16 MiB streamed, 1 MiB a head
    assert routes.lpt_group(_spec(window=(64, 64)), 32, 1 << 20) == 16
    assert routes.lpt_group(_spec(window=(-1, 0)), 8, 1 << 20) == 8  # no more than the heads there are
    assert routes.lpt_group(_spec(window=(-1, 0)), 32, 64 << 20) == 1  # one head is already over the budget


def _run(q, k, v, head_major, varlen=None, causal=False, window_size=(-1, -1)):
    """Forward and backward through the launchers with their default routes or the same routes head by head;
    (out, dq, dk, dv) and the number of backward launches."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launchers, "attn_bwd_kernel", LaunchRecorder(launchers.attn_bwd_kernel, calls))
        kw = dict(softmax_scale=32 ** -0.5, causal=causal, window_size=window_size)
        if varlen is not None:
            cu, longest = varlen
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        pb = launchers._problem(q, k, v, kw["softmax_scale"], causal, window_size, 0.0, None, 0.0, 0, 0,
                                kw.get("cu_seqlens_q"), kw.get("max_seqlen_q"), kw.get("max_seqlen_k"), None)
        fwd, bwd = routes.forward_route(pb.spec), routes.backward_route(pb.spec)
        if head_major:
            fwd = dataclasses.replace(fwd, lpt_group=1)
            bwd = dataclasses.replace(bwd, kv_group=1, q_group=1)
        else:
            assert fwd.lpt_group > 1 or not pb.spec.banded  # the grouped order is what runs
        out, lse = launchers.attention_forward(q, k, v, route=fwd, **kw)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        dq, dk, dv, _ = launchers.attention_backward(dout, q, k, v, out, lse, route=bwd, **kw)
    return (out, dq, dk, dv), len(calls)


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(causal=True, window_size=(40, 0)),
    dict(window_size=(24, 9)),
    dict(causal=False),
])
@pytest.mark.parametrize("shape", [(3, 77, 77, 4, 2), (2, 45, 100, 3, 1), (2, 100, 45, 3, 3)])
def test_results_do_not_depend_on_the_launch_order(monkeypatch, kwargs, shape):
    """Grouped heaviest-first order with partial groups (a tiny L2 budget) against head-major order: bitwise
    the same output and gradients, the backward in two launches (one per role) either way."""
    b, sq, sk, h, hk = shape
    q, k, v = make_qkv(b, sq, sk, h, hk, 32, dtype=torch.float16, generator=torch.Generator().manual_seed(2))
    head_bytes = sk * 64 * 2
    monkeypatch.setattr(routes, "L2_BUDGET", 2 * head_bytes)  # partial groups of two heads
    grouped, n_grouped = _run(q, k, v, False, **kwargs)
    plain, n_plain = _run(q, k, v, True, **kwargs)
    assert (n_grouped, n_plain) == (2, 2)
    for a, c in zip(grouped, plain, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_varlen_results_do_not_depend_on_the_launch_order(monkeypatch):
    lens = [5, 70, 33, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(total, 4, 32, generator=gen).half() for _ in range(3))
    monkeypatch.setattr(routes, "L2_BUDGET", 3 * max(lens) * 64 * 2)  # groups of 3 of the 4 heads
    runs = [_run(q, k, v, head_major, varlen=(cu, max(lens)), causal=True)[0] for head_major in (False, True)]
    for a, c in zip(*runs, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
