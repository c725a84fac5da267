"""The dense kernels' launch order (1D grids through kernels/common.py::grouped_program): it may not change a
single bit of the results, and it must visit every (head, tile) once, heaviest tiles of a group of heads
first."""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET
from utils import LaunchRecorder, make_qkv, program_pairs

from flashattn import flash_attn_func, flash_attn_varlen_func
from flashattn.kernels.common import grouped_program
from flashattn.ops import attention as launchers
from flashattn.ops.attention import _problem

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


def _pb(causal=False, window=(-1, -1), s=1024, h=16, hk=16):
    q = torch.empty(2, s, h, 128, dtype=torch.bfloat16)
    k = torch.empty(2, s, hk, 128, dtype=torch.bfloat16)
    return _problem(q, k, k, 0.1, causal, window, 0.0, None, 0.0, 0, 0, None, None, None)


def test_group_size_follows_the_masking_and_the_l2_budget(monkeypatch):
    monkeypatch.delenv("FLASHATTN_SCHEDULE", raising=False)
    assert _pb().lpt_group(32, 1 << 20) == 1  # every tile of a head does the same work
    assert _pb(causal=True).lpt_group(32, 1 << 20) == 16  # 16 MiB of streamed tiles
    assert _pb(window=(64, 64)).lpt_group(32, 1 << 20) == 16
    assert _pb(causal=True).lpt_group(8, 1 << 20) == 8  # no more than the heads there are
    assert _pb(causal=True).lpt_group(32, 64 << 20) == 1  # one head is already over the budget
    monkeypatch.setenv("FLASHATTN_SCHEDULE", "head-major")
    assert _pb(causal=True).lpt_group(32, 1 << 20) == 1


def _run(q, k, v, monkeypatch, schedule, budget, **kwargs):
    monkeypatch.setenv("FLASHATTN_SCHEDULE", schedule)
    monkeypatch.setattr(launchers, "_L2_BUDGET", budget)
    calls = []
    monkeypatch.setattr(launchers, "attn_bwd_kernel", LaunchRecorder(launchers.attn_bwd_kernel, calls))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    varlen = kwargs.pop("varlen", None)
    if varlen is None:
        out = flash_attn_func(*leaves, **kwargs)
    else:
        cu, longest = varlen
        out = flash_attn_varlen_func(*leaves, cu, cu, longest, longest, **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    monkeypatch.undo()
    return (out, *grads), len(calls)


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
    grouped, n_grouped = _run(q, k, v, monkeypatch, "", 2 * head_bytes, **kwargs)
    plain, n_plain = _run(q, k, v, monkeypatch, "head-major", 2 * head_bytes, **kwargs)
    assert (n_grouped, n_plain) == (2, 2)
    for a, c in zip(grouped, plain, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_varlen_results_do_not_depend_on_the_launch_order(monkeypatch):
    lens = [5, 70, 33, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(total, 4, 32, generator=gen).half() for _ in range(3))
    runs = [_run(q, k, v, monkeypatch, schedule, 4096, varlen=(cu, max(lens)), causal=True)[0]
            for schedule in ("", "head-major")]
    for a, c in zip(*runs, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
