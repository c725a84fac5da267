"""The ring planners against brute force, without any process group: for random layouts, lengths, world
sizes, masks and windows, the single-device calls a rank makes over all steps cover exactly the (query, key)
pairs the full problem's mask allows, each exactly once, and every call the kernels run with ALiBi has
the global distance. (The oracle tests in test_cp.py check the numbers; this checks the geometry on many
more configurations than they can afford.)"""

from __future__ import annotations

import random

import pytest
import torch

from flashattn.distributed import _plan_padded, _plan_varlen
from flashattn.distributed._geometry import check_divisible, positions, window_bounds


def _kernel_mask(m: int, n: int, causal: bool, window) -> torch.Tensor:
    """What a single-device call of m queries and n keys lets through (bottom-right aligned)."""
    i, j = torch.arange(m).view(-1, 1), torch.arange(n).view(1, -1)
    diag = i + n - m
    vis = torch.ones(m, n, dtype=torch.bool)
    right = 0 if causal else window[1]
    if right >= 0:
        vis &= j <= diag + right
    if window[0] >= 0:
        vis &= j >= diag - window[0]
    return vis


def _truth(pos_q, pos_k, offset: int, left: int, right: int) -> torch.Tensor:
    d = pos_k.view(1, -1) - pos_q.view(-1, 1) - offset
    return (d >= -left) & (d <= right)


def _random_padded(rng: random.Random):
    layout = rng.choice(["contiguous", "zigzag", "striped"])
    world = rng.choice([1, 2, 3, 4, 5])
    unit = 2 * world if layout == "zigzag" else world
    sq, sk = unit * rng.randint(1, 4), unit * rng.randint(1, 4)
    if rng.random() < 0.5:
        sk = sq
    causal = rng.random() < 0.5
    window = (rng.choice([-1, 0, 1, 2, 3, 5, 9]), rng.choice([-1, 0, 1, 2, 4, 7]))
    return layout, world, sq, sk, causal, window, rng.random() < 0.3


@pytest.fixture(autouse=True)
def one_thread():
    # thousands of tiny tensor ops: a thread pool only waits on the other (shared) cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", range(6))
def test_padded_plan_covers_the_mask_once(seed):
    rng = random.Random(seed)
    for _ in range(60):
        layout, world, sq, sk, causal, window, alibi = _random_padded(rng)
        check_divisible("q", sq, layout, world)
        left, right = window_bounds(causal, window)
        for rank in range(world):
            needed, steps = _plan_padded.plan(layout, sq, sk, world, rank, left, right, alibi)
            pos_q = positions(layout, sq, world, rank)
            for t in range(world):
                src = (rank - t) % world
                pos_k = positions(layout, sk, world, src)
                truth = _truth(pos_q, pos_k, sk - sq, left, right)
                cover = torch.zeros(truth.shape, dtype=torch.int64)
                for task in _plan_padded.tasks(steps[t], "cpu"):
                    (r0, r1), (k0, k1) = task.rows, task.keys
                    if task.exact is not None:
                        sub = _truth(task.exact.pos_q, task.exact.pos_k, sk - sq, left, right)
                        assert torch.equal(task.exact.pos_q, pos_q[r0:r1])
                        assert torch.equal(task.exact.pos_k, pos_k[k0:k1])
                    else:
                        sub = _kernel_mask(r1 - r0, k1 - k0, task.causal, task.window)
                        if alibi:  # the kernel's distance, times the stride, is the global one
                            i, j = torch.arange(r1 - r0).view(-1, 1), torch.arange(k1 - k0).view(1, -1)
                            local = (i + (k1 - k0) - (r1 - r0) - j).abs() * task.alibi_scale
                            glob = (pos_q[r0:r1].view(-1, 1) + sk - sq - pos_k[k0:k1].view(1, -1)).abs()
                            assert torch.equal(local[sub], glob[sub])
                    cover[r0:r1, k0:k1] += sub.long()
                cfg = (layout, world, sq, sk, causal, window, alibi, rank, t)
                assert torch.equal(cover, truth.long()), cfg
                if truth.any():
                    assert needed[t], cfg


@pytest.mark.parametrize("seed", range(4))
def test_varlen_plan_covers_the_mask_once(seed):
    rng = random.Random(100 + seed)
    for _ in range(25):
        world = rng.choice([1, 2, 3, 4])
        lengths = [rng.choice([0, 1, 2, 3, 5, 8, 13, 17, 30]) for _ in range(rng.randint(1, 5))]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        causal = rng.random() < 0.5
        window = (rng.choice([-1, 0, 1, 3, 6]), rng.choice([-1, 0, 2, 5]))
        alibi = rng.random() < 0.3
        left, right = window_bounds(causal, window)
        # every rank's tokens in piece-major order: (document, position in it)
        tokens = []
        for r in range(world):
            local = _local_tokens(cu, world, r)
            perm = _plan_varlen.piece_major_index(cu, world, r)
            tokens.append([local[i] for i in perm.tolist()])
        for rank in range(world):
            needed, tasks_of = _plan_varlen.plan(cu, world, rank, left, right, alibi, "cpu")
            for t in range(world):
                src = (rank - t) % world
                tq, tk = tokens[rank], tokens[src]
                dq = torch.tensor([d for d, _ in tq]).view(-1, 1)
                dk = torch.tensor([d for d, _ in tk]).view(1, -1)
                pq = torch.tensor([p for _, p in tq], dtype=torch.int64)
                pk = torch.tensor([p for _, p in tk], dtype=torch.int64)
                truth = (dq == dk) & _truth(pq, pk, 0, left, right) if tq and tk else torch.zeros(
                    len(tq), len(tk), dtype=torch.bool)
                cover = torch.zeros(truth.shape, dtype=torch.int64)
                for task in tasks_of(t):
                    rows = _indices(task.rows)
                    keys = _indices(task.keys)
                    if task.exact is not None:
                        sub = (task.exact.doc_q.view(-1, 1) == task.exact.doc_k.view(1, -1)) & _truth(
                            task.exact.pos_q, task.exact.pos_k, 0, left, right)
                        assert torch.equal(task.exact.pos_q, pq[rows])
                        assert torch.equal(task.exact.pos_k, pk[keys])
                    else:
                        sub = torch.zeros(len(rows), len(keys), dtype=torch.bool)
                        cq, ck = task.cu_q.tolist(), task.cu_k.tolist()
                        for s in range(len(cq) - 1):
                            m, n = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
                            mask = _kernel_mask(m, n, task.causal, task.window)
                            sub[cq[s]:cq[s + 1], ck[s]:ck[s + 1]] = mask
                            if alibi and m and n:
                                i, j = torch.arange(m).view(-1, 1), torch.arange(n).view(1, -1)
                                local = (i + n - m - j).abs()
                                q_rows, k_rows = rows[cq[s]:cq[s + 1]], keys[ck[s]:ck[s + 1]]
                                glob = (pq[q_rows].view(-1, 1) - pk[k_rows]).abs()
                                assert torch.equal(local[mask], glob[mask])
                    cover[rows.view(-1, 1), keys.view(1, -1)] += sub.long()
                cfg = (lengths, world, causal, window, alibi, rank, t)
                assert torch.equal(cover, truth.long()), cfg
                if truth.any():
                    assert needed[t], cfg


def _indices(sel) -> torch.Tensor:
    return torch.arange(sel[0], sel[1]) if isinstance(sel, tuple) else sel


def _local_tokens(cu: torch.Tensor, world: int, rank: int) -> list[tuple[int, int]]:
    """(document, position) of rank's varlen shard in its local order, from the documented chunk rule."""
    out = []
    for doc, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:], strict=False)):
        n = b - a
        bounds = [j * n // (2 * world) for j in range(2 * world + 1)]
        for chunk in (rank, 2 * world - 1 - rank):
            out += [(doc, p) for p in range(bounds[chunk], bounds[chunk + 1])]
    return out

