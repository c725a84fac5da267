"""Cases beyond "equals the oracle": error messages, bitwise determinism, shard/unshard round trips, groups
given as subgroups or mesh dimensions, and tracing Ulysses with torch.compile.

Every error case raises on every rank alike (the checks run before, or are themselves, symmetric
collectives), so no rank is left waiting.
"""

from __future__ import annotations

import json
import re

import torch
import torch.distributed as dist
from cp_checks import Problem, VarlenProblem, check_padded, run_padded, run_varlen, use_backend

from flashattn.distributed import (
    context_parallel_attn,
    context_parallel_attn_varlen,
    shard,
    shard_varlen,
    unshard,
    unshard_varlen,
)

SPECIAL: dict = {}


def special(name: str, worlds=(2, 3, 4)):
    def register(fn):
        SPECIAL[name] = (worlds, fn)
        return fn
    return register


def _raises(fn, exc_type, *patterns: str) -> None:
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        for pat in patterns:
            assert re.search(pat, msg), f"message {msg!r} lacks {pat!r}"
        return
    raise AssertionError(f"expected {exc_type.__name__} matching {patterns}")


def _qkv(b=1, s=8, h=4, hk=2, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return tuple(torch.randn(b, s, n, d, generator=gen).to(dtype) for n in (h, hk, hk))


# -- errors --------------------------------------------------------------------------------------------------
@special("error-mismatched-shards")
def _(rank, world):
    use_backend("torch")
    q, k, v = _qkv(s=10 if rank == 0 else 8)  # rank 0's shard is longer than the others'
    _raises(lambda: context_parallel_attn(q, k, v, layout="contiguous"), ValueError,
            r"disagree on seqlen_q_local \(rank 0: 10, rank 1: 8", "same shapes")


@special("error-mismatched-options", (2,))
def _(rank, world):
    use_backend("torch")
    q, k, v = _qkv()
    _raises(lambda: context_parallel_attn(q, k, v, causal=rank == 1), ValueError,
            r"disagree on causal \(rank 0: 0, rank 1: 1\)")


@special("error-indivisible", (3, 4))
def _(rank, world):
    x = torch.zeros(1, 4 * world + 2, 2, 8)
    _raises(lambda: shard(x, layout="contiguous"), ValueError,
            f"global length {4 * world + 2}", f"multiple of the world size = {world}")
    y = torch.zeros(1, 3 * world, 2, 8)  # a multiple of world, not of 2·world
    _raises(lambda: shard(y, layout="zigzag"), ValueError, rf"multiple of 2 \* world size = {2 * world}")


@special("error-zigzag-odd-local", (2,))
def _(rank, world):
    q, k, v = _qkv(s=5)
    _raises(lambda: context_parallel_attn(q, k, v, layout="zigzag"), ValueError,
            "q has 5 tokens per rank", "must be even")


@special("error-ulysses-heads", (3, 4))
def _(rank, world):
    q, k, v = _qkv(h=2 * world + 2, hk=1)
    _raises(lambda: context_parallel_attn(q, k, v, method="ulysses"), ValueError,
            f"q has {2 * world + 2} heads", f"multiple of {world}")


@special("error-arguments", (2,))
def _(rank, world):
    q, k, v = _qkv()
    _raises(lambda: context_parallel_attn(q, k, v, method="hybrid"), ValueError, "needs both ulysses_group")
    _raises(lambda: context_parallel_attn(q, k, v, ring_group=dist.group.WORLD), ValueError,
            "for method='hybrid'")
    _raises(lambda: context_parallel_attn(q, k, v, method="rings"), ValueError, "method='rings'")
    _raises(lambda: context_parallel_attn(q, k, v, layout="zig"), ValueError, "layout='zig'")
    _raises(lambda: context_parallel_attn(q, k, v, window_size=(3,)), ValueError, "window_size")
    k3, v3 = (x[:, :, :1].expand(1, 8, 3, 8) for x in (k, v))
    _raises(lambda: context_parallel_attn(q, k3, v3, check_shards=False), ValueError,
            "k has 3 heads but q has 4")
    _raises(lambda: context_parallel_attn(q, k, v, group="world"), TypeError, "ProcessGroup")
    _raises(lambda: context_parallel_attn(q, k, v, alibi_slopes=torch.ones(3)), ValueError,
            r"alibi_slopes must be a float32 tensor of shape \(4,\)")
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)  # 10 tokens on each of 2 ranks, not 8
    _raises(lambda: context_parallel_attn_varlen(q[0], k[0], v[0], cu, 15), ValueError,
            "q has 8 tokens but this rank's shard of cu_seqlens holds")
    _raises(lambda: context_parallel_attn_varlen(q[0], k[0], v[0], cu, 4), ValueError, "max_seqlen=4")
    _raises(lambda: shard_varlen(torch.zeros(15, 2), cu), ValueError, "ends at 20 but the tensor has 15")


# -- determinism ------------------------------------------------------------------------------------------
def _same_grads(a: dict, b: dict) -> None:
    for name in ("out", "dq", "dk", "dv", "dsink"):
        if a[name] is not None:
            assert torch.equal(a[name], b[name]), f"{name} differs between two identical runs"


@special("deterministic-ring")
def _(rank, world):
    p = Problem(causal=True, sink=True, hk=1, sq=8 * world, dtype=torch.float16, window=(9, -1))
    runs = [run_padded(p, rank, world, deterministic=True)[0] for _ in range(2)]
    _same_grads(*runs)


@special("deterministic-ulysses", (2, 4))
def _(rank, world):
    p = Problem(method="ulysses", causal=True, sq=8 * world, hk=1)
    runs = [run_padded(p, rank, world, deterministic=True)[0] for _ in range(2)]
    _same_grads(*runs)


@special("deterministic-varlen", (3,))
def _(rank, world):
    p = VarlenProblem((5, 0, 1, 13, 24), causal=True, alibi="h")
    runs = [run_varlen(p, deterministic=True)[0] for _ in range(2)]
    _same_grads(*runs)


@special("deterministic-interp", (2,))
def _(rank, world):
    p = Problem(b=1, sq=16, h=2, hk=1, causal=True, backend="triton")
    runs = [run_padded(p, rank, world, deterministic=True)[0] for _ in range(2)]
    _same_grads(*runs)


# -- layouts -------------------------------------------------------------------------------------------------
@special("shard-unshard-roundtrip")
def _(rank, world):
    x = torch.randn(3, 4 * world, 2, generator=torch.Generator().manual_seed(3))
    for layout in ("contiguous", "zigzag", "striped"):
        for dim in (1, 0, -2):
            if x.shape[dim] % (2 * world if layout == "zigzag" else world):
                continue
            local = shard(x, layout=layout, dim=dim)
            assert local.shape[dim] == x.shape[dim] // world, (layout, dim, local.shape)
            assert torch.equal(unshard(local, layout=layout, dim=dim), x), (layout, dim)
    # zigzag: rank r holds chunks r and 2W − 1 − r
    c = x.shape[1] // (2 * world)
    back = 2 * world - 1 - rank
    want = torch.cat((x[:, rank * c:(rank + 1) * c], x[:, back * c:(back + 1) * c]), 1)
    assert torch.equal(shard(x, layout="zigzag"), want)
    assert torch.equal(shard(x, layout="striped"), x[:, rank::world])


@special("shard-unshard-varlen")
def _(rank, world):
    lengths = [5, 0, 1, 13, 3, 24, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.arange(int(cu[-1]), dtype=torch.float32).view(-1, 1).expand(-1, 3).clone().requires_grad_()
    local, local_cu = shard_varlen(x, cu)
    assert local_cu.dtype == torch.int32 and local_cu.shape == cu.shape
    assert int(local_cu[-1]) == local.shape[0]
    for doc, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:], strict=False)):
        n = b - a
        bounds = [j * n // (2 * world) for j in range(2 * world + 1)]
        mine = [*range(a + bounds[rank], a + bounds[rank + 1]),
                *range(a + bounds[2 * world - 1 - rank], a + bounds[2 * world - rank])]
        got = local[int(local_cu[doc]):int(local_cu[doc + 1]), 0].long().tolist()
        assert got == mine, (doc, got, mine)
    full = unshard_varlen(local, cu)
    assert torch.equal(full, x.detach())
    full.sum().backward()  # every token reaches exactly one rank's shard: gradient 1 there
    grad = x.grad.clone()
    dist.all_reduce(grad)
    assert torch.equal(grad, torch.ones_like(grad) * world), "unshard_varlen's backward"


# -- groups: subgroups, mesh dimensions ----------------------------------------------------------------------
@special("subgroups", (4,))
def _(rank, world):
    # two rings of two ranks each, running at once; ranks are global ids 0,1 and 2,3
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    check_padded(Problem(causal=True, sq=16, seed=rank // 2, extra={"group": mine}), rank, world)
    check_padded(Problem(method="ulysses", sq=16, seed=rank // 2, extra={"group": mine}), rank, world)


@special("mesh-group", (2,))
def _(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    check_padded(Problem(causal=True, sq=16, extra={"group": mesh}), rank, world)
    check_padded(Problem(layout="striped", sq=16, extra={"group": (mesh, "cp")}), rank, world)


# -- torch.compile traces Ulysses ---------------------------------------------------------------------------
@special("compile-ulysses", (2,))
def _(rank, world):
    use_backend("torch")
    q, k, v = (shard(x, layout="zigzag") for x in _qkv(s=16))

    def f(a, b, c):
        return context_parallel_attn(a, b, c, method="ulysses", causal=True, check_shards=False)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = f(*leaves)
    ref.sum().backward()
    compiled = [x.clone().requires_grad_() for x in (q, k, v)]
    torch._dynamo.reset()
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*compiled)
    out.sum().backward()
    assert torch.allclose(out, ref, atol=1e-6)
    for a, b in zip(compiled, leaves, strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


# -- the bench suite, measured ------------------------------------------------------------------------------
@special("bench-cp-measured", (2,))
def _(rank, world):
    import tempfile
    from pathlib import Path

    from flashattn.bench.suites import cp

    use_backend("torch")
    cfg = cp.CPConfig(dtype="fp32", nheads=2, nheads_k=1, headdim=16, causal=(True,), weak_local=(16,),
                      strong_global=(64,), warmup=1, iters=2)
    with tempfile.TemporaryDirectory() as out:
        assert cp.run_suite(cfg, torch.device("cpu"), Path(out), quiet=True) == 0
        if rank == 0:
            rows = json.loads((Path(out) / "cp.json").read_text())["rows"]
            assert {(r["method"], r["mode"], r["scaling"]) for r in rows} == {
                (m, mode, s) for m in ("ring", "ulysses") for mode in ("fwd", "fwd+bwd")
                for s in ("weak", "strong")}
            for r in rows:
                assert r["kind"] == "measured" and r["world"] == 2
                assert r["ms"] > 0 and r["comm_ms"] > 0 and r["compute_ms"] > 0 and r["single_ms"] > 0
                assert 0.0 <= r["hidden"] <= 1.0
            assert "Weak scaling" in (Path(out) / "cp.md").read_text()


# -- GPU only (test_cp_gpu.py) ----------------------------------------------------------------------------
@special("gpu-deterministic", ())
def _(rank, world):
    p = Problem(causal=True, sink=True, hk=2, h=8, d=128, sq=512 * world, dtype=torch.bfloat16,
                backend="triton", device="cuda")
    runs = [run_padded(p, rank, world, deterministic=True)[0] for _ in range(2)]
    _same_grads(*runs)


@special("gpu-overlap-transfer", ())
def _(rank, world):
    """A transfer posted through NCCL while the compute stream is busy arrives intact, and what the current
    stream queues after wait() sees it (with one GPU there is no one to send to: nothing to check)."""
    from flashattn.distributed._comm import Ring

    if world == 1:
        return
    ring = Ring(dist.group.WORLD)
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + rank
    a = torch.randn(4096, 4096, device="cuda")
    pending = ring.exchange([([x], 1, 0)])  # to rank + 1, from rank − 1
    busy = a @ a  # runs on the compute stream while the transfer is in flight
    (got,) = pending.wait()[0]
    want = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + (rank - 1) % world
    assert torch.equal(got, want) and bool(busy.isfinite().all())
