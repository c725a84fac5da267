"""What a case does inside a worker: build the full problem (identical on every rank: a seeded generator),
shard it, run the distributed attention forward and backward, and compare this rank's shards with the fp64
oracle under the project's tolerance rule (tests/utils.py: error <= 2x (outputs) / 3x (gradients) that of
plain PyTorch in the same precision, plus a tiny floor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from utils import assert_close_to_ref

from flashattn import config
from flashattn.backends import backend_name
from flashattn.distributed import (
    RingStats,
    context_parallel_attn,
    context_parallel_attn_varlen,
    shard,
    shard_varlen,
)
from flashattn.reference import attention_ref, attention_ref_varlen


@dataclass
class Problem:
    """One padded-layout case: shapes, options and how it is sharded."""

    method: str = "ring"
    layout: str = "zigzag"
    causal: bool = False
    dtype: torch.dtype = torch.float32
    b: int = 2
    sq: int = 16
    sk: int | None = None
    h: int = 4
    hk: int = 2
    d: int = 16
    dv: int | None = None
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None  # None, "h" (nheads,) or "bh" (batch, nheads)
    sink: bool = False
    backend: str = "torch"
    device: str = "cpu"
    hybrid: tuple[int, int] | None = None  # (ring, ulysses) mesh shape for method="hybrid"
    expect: Callable | None = None  # (rank, world, RingStats) -> None: assertions on the schedule
    seed: int = 0
    extra: dict = field(default_factory=dict)


def use_backend(name: str, device: str = "cpu") -> None:
    """Route this worker's single-device calls to the ``torch`` backend or the ``triton`` one (interpreted on
    the CPU)."""
    config.set_backend(name)
    assert backend_name(torch.empty(1, device=device)) == name, "no TRITON_INTERPRET=1 in the worker"


def _rand(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def inputs(p: Problem):
    """Full q, k, v, dout, slopes, sink: the same on every rank (seeded generator)."""
    gen = torch.Generator().manual_seed(1234 + p.seed)
    sk, dv = p.sk or p.sq, p.dv or p.d
    q = _rand(gen, p.b, p.sq, p.h, p.d, dtype=p.dtype)
    k = _rand(gen, p.b, sk, p.hk, p.d, dtype=p.dtype)
    v = _rand(gen, p.b, sk, p.hk, dv, dtype=p.dtype)
    g = _rand(gen, p.b, p.sq, p.h, dv, dtype=p.dtype)
    slopes = None
    if p.alibi == "h":
        slopes = torch.rand(p.h, generator=gen) * 0.5
    elif p.alibi == "bh":
        slopes = torch.rand(p.b, p.h, generator=gen) * 0.5
    sink = _rand(gen, p.h, dtype=torch.float32) if p.sink else None
    return tuple(None if x is None else x.to(p.device) for x in (q, k, v, g, slopes, sink))


def _leaves(*xs, dtype=None):
    return [None if x is None else x.detach().to(dtype or x.dtype).clone().requires_grad_() for x in xs]


def reference(q, k, v, g, slopes, sink, *, causal, window, softcap, varlen_cu=None):
    """((out, lse, dq, dk, dv, dsink) in fp64, the same from plain PyTorch in q's dtype)."""
    results = []
    for upcast in (True, False):
        qq, kk, vv, ss = _leaves(q, k, v, sink, dtype=torch.float64 if upcast else None)
        kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, learnable_sink=ss,
                  upcast=upcast)
        if varlen_cu is None:
            out, lse = attention_ref(qq, kk, vv, **kw)
        else:
            out, lse = attention_ref_varlen(qq, kk, vv, varlen_cu, varlen_cu, **kw)
        out.backward(g.to(out.dtype))
        results.append((out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad,
                        None if ss is None else ss.grad))
    return results


def compare(ours: dict, ref64: dict, ref_pt: dict) -> None:
    """Every named tensor of ours against the oracle; all problems in one AssertionError."""
    problems = []
    for name, x in ours.items():
        if x is None:
            continue
        factor = 2.0 if name in ("out", "lse") else 3.0
        try:
            assert_close_to_ref(x, ref64[name], ref_pt[name], factor=factor, name=name)
        except AssertionError as e:
            problems.append(str(e))
    if problems:
        raise AssertionError("\n".join(problems))


def make_sharder(p: Problem, world: int):
    """(x, dim) -> this rank's shard, and the groups to pass (a dict of keyword arguments)."""
    if p.method != "hybrid":
        group = p.extra.get("group")
        return (lambda x, dim=1: shard(x, group, layout=p.layout, dim=dim)), {"group": group}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(p.device.split(":")[0], p.hybrid, mesh_dim_names=("ring", "ulysses"))
    ring, uly = (mesh, "ring"), mesh["ulysses"]  # both spellings of a mesh dimension

    def sharder(x, dim=1):
        return shard(shard(x, ring, layout=p.layout, dim=dim), uly, layout="contiguous", dim=dim)

    return sharder, {"ring_group": ring, "ulysses_group": uly}


def run_padded(p: Problem, rank: int, world: int, *, deterministic: bool = False):
    """Our forward/backward on this rank's shards; returns (dict of ours, stats, sharder)."""
    use_backend(p.backend, p.device)
    q, k, v, g, slopes, sink = inputs(p)
    sharder, groups = make_sharder(p, world)
    ql, kl, vl = _leaves(sharder(q), sharder(k), sharder(v))
    (sl,) = _leaves(sink)
    stats = RingStats()
    out, lse = context_parallel_attn(
        ql, kl, vl, method=p.method, layout=p.layout, causal=p.causal, window_size=p.window,
        softcap=p.softcap, alibi_slopes=slopes, learnable_sink=sl, deterministic=deterministic,
        return_lse=True, stats=stats, **groups,
    )
    out.backward(sharder(g))
    dsink = None
    if sl is not None:  # each rank's sink gradient covers its rows (heads): the group's sum is the full one
        dsink = sl.grad.clone()
        dist.all_reduce(dsink, group=groups.get("group"))
    ours = dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, dsink=dsink)
    return ours, stats, sharder


def check_padded(p: Problem, rank: int, world: int) -> None:
    ours, stats, sharder = run_padded(p, rank, world)
    q, k, v, g, slopes, sink = inputs(p)
    ref64, ref_pt = reference(q, k, v, g, slopes, sink, causal=p.causal, window=p.window, softcap=p.softcap)

    def local(r):
        out, lse, dq, dk, dv, dsink = r
        return dict(out=sharder(out), lse=sharder(lse, 2), dq=sharder(dq), dk=sharder(dk), dv=sharder(dv),
                    dsink=dsink)

    compare(ours, local(ref64), local(ref_pt))
    if p.expect is not None:
        p.expect(rank, world, stats)


@dataclass
class VarlenProblem:
    lengths: tuple[int, ...]
    causal: bool = False
    dtype: torch.dtype = torch.float32
    h: int = 4
    hk: int = 2
    d: int = 16
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None  # None, "h" or "bh" (ndocs, nheads)
    sink: bool = False
    backend: str = "torch"
    device: str = "cpu"
    expect: Callable | None = None
    seed: int = 0


def varlen_inputs(p: VarlenProblem):
    gen = torch.Generator().manual_seed(4321 + p.seed)
    total, ndocs = sum(p.lengths), len(p.lengths)
    cu = torch.tensor([0, *torch.tensor(p.lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = _rand(gen, total, p.h, p.d, dtype=p.dtype)
    k = _rand(gen, total, p.hk, p.d, dtype=p.dtype)
    v = _rand(gen, total, p.hk, p.d, dtype=p.dtype)
    g = _rand(gen, total, p.h, p.d, dtype=p.dtype)
    slopes = None
    if p.alibi == "h":
        slopes = torch.rand(p.h, generator=gen) * 0.5
    elif p.alibi == "bh":
        slopes = torch.rand(ndocs, p.h, generator=gen) * 0.5
    sink = _rand(gen, p.h, dtype=torch.float32) if p.sink else None
    return tuple(None if x is None else x.to(p.device) for x in (cu, q, k, v, g, slopes, sink))


def run_varlen(p: VarlenProblem, deterministic: bool = False):
    use_backend(p.backend, p.device)
    cu, q, k, v, g, slopes, sink = varlen_inputs(p)
    ql, kl, vl = _leaves(*(shard_varlen(x, cu)[0] for x in (q, k, v)))
    (sl,) = _leaves(sink)
    stats = RingStats()
    out, lse = context_parallel_attn_varlen(
        ql, kl, vl, cu, max(p.lengths), causal=p.causal, window_size=p.window, softcap=p.softcap,
        alibi_slopes=slopes, learnable_sink=sl, deterministic=deterministic, return_lse=True, stats=stats,
    )
    out.backward(shard_varlen(g, cu)[0])
    dsink = None
    if sl is not None:
        dsink = sl.grad.clone()
        dist.all_reduce(dsink)
    return dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad, dsink=dsink), stats


def check_varlen(p: VarlenProblem, rank: int, world: int) -> None:
    ours, stats = run_varlen(p)
    cu, q, k, v, g, slopes, sink = varlen_inputs(p)
    ref64, ref_pt = reference(q, k, v, g, slopes, sink, causal=p.causal, window=p.window, softcap=p.softcap,
                              varlen_cu=cu)

    def local(r):
        out, lse, dq, dk, dv, dsink = r
        cut = [shard_varlen(x, cu)[0] for x in (out, lse.t(), dq, dk, dv)]
        return dict(out=cut[0], lse=cut[1].t(), dq=cut[2], dk=cut[3], dv=cut[4], dsink=dsink)

    compare(ours, local(ref64), local(ref_pt))
    if p.expect is not None:
        p.expect(rank, world, stats)
