"""Mask patterns: an element predicate plus a cheap, conservative block classifier, and their materialisation.

A pattern answers two questions. `classify(g)` says, for every (query block, key block) of the geometry g,
whether it is certainly full or certainly empty, from arithmetic on the block's corners alone; it may always
answer "don't know". `predicate(b, h, i, j)` decides single elements. Materialising evaluates the predicate
only on the blocks the classifier could not decide, a few at a time, so memory stays bounded and the common
patterns (causal, windows, documents) cost a band of blocks, not the whole matrix. The result is exact either
way: a classifier that says "don't know" everywhere (an arbitrary mask_mod) just costs more evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._kernel import EMPTY, FULL, PARTIAL, pack_bits

MAYBE = 3
# elements evaluated per predicate call while materialising: bounds the temporary memory (a few bytes per
# element), and on the GPU amortises the Python loop
_EVAL_BUDGET = {"cpu": 1 << 22, "cuda": 1 << 25}


@dataclass(frozen=True)
class Geometry:
    """Block grid of a (seqlen_q, seqlen_k) problem. r0/r1: first/last row < seqlen_q of each query block,
    (Mq, 1); c0/c1: first/last key of each key block, (1, Nk), c1 possibly past seqlen_k (the builder makes
    tail blocks partial)."""

    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    device: torch.device

    @property
    def n_qblocks(self) -> int:
        return -(-self.seqlen_q // self.block_m)

    @property
    def n_kblocks(self) -> int:
        return -(-self.seqlen_k // self.block_n)

    @property
    def r0(self) -> torch.Tensor:
        return (torch.arange(self.n_qblocks, device=self.device) * self.block_m).view(-1, 1)

    @property
    def r1(self) -> torch.Tensor:
        return (self.r0 + self.block_m).clamp(max=self.seqlen_q) - 1

    @property
    def c0(self) -> torch.Tensor:
        return (torch.arange(self.n_kblocks, device=self.device) * self.block_n).view(1, -1)

    @property
    def c1(self) -> torch.Tensor:
        return self.c0 + self.block_n - 1


def _none(g: Geometry) -> torch.Tensor:
    return torch.zeros((1, 1), dtype=torch.bool, device=g.device)


def _all(g: Geometry) -> torch.Tensor:
    return torch.ones((1, 1), dtype=torch.bool, device=g.device)


@dataclass(frozen=True)
class Pattern:
    """classify(g) -> (full, empty), bool grids broadcastable to (B, H, Mq, Nk); predicate(b, h, i, j) -> bool
    on broadcasting int64 index tensors (FlexAttention's mask_mod convention)."""

    classify: Callable[[Geometry], tuple[torch.Tensor, torch.Tensor]]
    predicate: Callable[..., torch.Tensor]

    def __and__(self, other: Pattern) -> Pattern:
        def classify(g):
            (fa, ea), (fb, eb) = self.classify(g), other.classify(g)
            return fa & fb, ea | eb

        return Pattern(classify, lambda b, h, i, j: self.predicate(b, h, i, j) & other.predicate(b, h, i, j))

    def __or__(self, other: Pattern) -> Pattern:
        def classify(g):
            (fa, ea), (fb, eb) = self.classify(g), other.classify(g)
            return fa | fb, ea & eb

        return Pattern(classify, lambda b, h, i, j: self.predicate(b, h, i, j) | other.predicate(b, h, i, j))


def band(diag: int, left: int | None, right: int | None) -> Pattern:
    """Query i sees keys [i + diag - left, i + diag + right] (None: unbounded on that side)."""

    def classify(g):
        full, empty = _all(g), _none(g)
        if right is not None:
            full = full & (g.c1 <= g.r0 + diag + right)
            empty = empty | (g.c0 > g.r1 + diag + right)
        if left is not None:
            full = full & (g.c0 >= g.r1 + diag - left)
            empty = empty | (g.c1 < g.r0 + diag - left)
        return full, empty

    def predicate(b, h, i, j):
        vis = torch.ones((), dtype=torch.bool, device=i.device)
        if right is not None:
            vis = vis & (j <= i + diag + right)
        if left is not None:
            vis = vis & (j >= i + diag - left)
        return vis

    return Pattern(classify, predicate)


def key_prefix(n: int) -> Pattern:
    """Every query sees keys [0, n)."""
    return Pattern(lambda g: (g.c1 < n, g.c0 >= n), lambda b, h, i, j: j < n)


def query_prefix(n: int) -> Pattern:
    """Queries [0, n) see every key."""
    return Pattern(lambda g: (g.r1 < n, g.r0 >= n), lambda b, h, i, j: i < n)


def diagonals(stride: int) -> Pattern:
    """Query i sees key j iff i - j is a multiple of stride (Sparse Transformer's strided heads)."""

    def classify(g):
        lo, hi = g.r0 - g.c1, g.r1 - g.c0  # the range of i - j over the block
        hit = torch.div(hi, stride, rounding_mode="floor") * stride >= lo
        full = _all(g) if stride == 1 else _none(g)
        return full, ~hit

    return Pattern(classify, lambda b, h, i, j: torch.remainder(i - j, stride) == 0)


def documents(ids: torch.Tensor) -> Pattern:
    """Query i sees key j iff ids[i] == ids[j] (one id per token, shared by queries and keys)."""

    def block_range(n_blocks, size, length):
        pos = torch.arange(n_blocks * size, device=ids.device).clamp(max=length - 1)
        per = ids[pos].view(n_blocks, size)  # the tail repeats the last id: it adds no new id
        return per.amin(1), per.amax(1)

    def classify(g):
        qmin, qmax = block_range(g.n_qblocks, g.block_m, g.seqlen_q)
        kmin, kmax = block_range(g.n_kblocks, g.block_n, g.seqlen_k)
        qmin, qmax, kmin, kmax = qmin.view(-1, 1), qmax.view(-1, 1), kmin.view(1, -1), kmax.view(1, -1)
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (kmax < qmin)
        return full, empty

    last = ids.shape[0] - 1
    return Pattern(classify, lambda b, h, i, j: ids[i.clamp(max=last)] == ids[j.clamp(max=last)])


def tree(ancestors: torch.Tensor, prefix_len: int) -> Pattern:
    """Tree token i (query row i, key prefix_len + i) sees the whole prefix and key prefix_len + a for every
    ancestor-or-self a; ancestors is the bool (T, T) relation."""
    t = ancestors.shape[0]

    def predicate(b, h, i, j):
        a = (j - prefix_len).clamp(0, t - 1)
        return (j < prefix_len) | ancestors[i.clamp(0, t - 1), a]

    return Pattern(lambda g: (g.c1 < prefix_len, _none(g)), predicate)


def opaque(predicate: Callable[..., torch.Tensor]) -> Pattern:
    """A predicate the classifier knows nothing about: every block is evaluated."""
    return Pattern(lambda g: (_none(g), _none(g)), predicate)


def listed(full: torch.Tensor, listed_any: torch.Tensor, predicate) -> Pattern:
    """Blocks given as grids (B, H, Mq, Nk): `full` are full, the other `listed_any` are decided by the
    predicate, the rest are empty."""
    return Pattern(lambda g: (full, ~listed_any & ~full), predicate)


def materialize(pattern: Pattern, g: Geometry, batch: int, heads: int):
    """(state int8 (B, H, Mq, Nk), part_index int32 (B, H, Mq, Nk), part_bits uint8 (P, bm, bn // 8))."""
    full, empty = pattern.classify(g)
    shape = (batch, heads, g.n_qblocks, g.n_kblocks)
    full = torch.broadcast_to(full, shape)
    empty = torch.broadcast_to(empty, shape)
    state = torch.full(shape, MAYBE, dtype=torch.int8, device=g.device)
    state[full] = FULL
    state[empty] = EMPTY  # "empty" wins: it is what a classifier that is unsure about "full" also says
    if g.seqlen_k % g.block_n:
        # the key tail block holds keys >= seqlen_k: never full (the kernels skip predicates on full blocks)
        tail = state[..., -1]
        tail[tail == FULL] = MAYBE
    todo = (state == MAYBE).nonzero()  # (K, 4): b, h, m, n
    part_index = torch.full(shape, -1, dtype=torch.int32, device=g.device)
    chunks = []
    per_call = max(1, _EVAL_BUDGET.get(g.device.type, 1 << 22) // (g.block_m * g.block_n))
    rows = torch.arange(g.block_m, device=g.device).view(1, -1, 1)
    keys = torch.arange(g.block_n, device=g.device).view(1, 1, -1)
    n_parts = 0
    for start in range(0, todo.shape[0], per_call):
        blk = todo[start:start + per_call]
        b, h, m, n = (blk[:, k].view(-1, 1, 1) for k in range(4))
        i = m * g.block_m + rows  # (K, bm, 1)
        j = n * g.block_n + keys  # (K, 1, bn)
        inside = (i < g.seqlen_q) & (j < g.seqlen_k)
        # the predicate only ever sees in-range indices (a mask_mod may index tables of seqlen entries)
        vis = pattern.predicate(b, h, i.clamp(max=g.seqlen_q - 1), j.clamp(max=g.seqlen_k - 1))
        vis = torch.as_tensor(vis, device=g.device)
        vis = torch.broadcast_to(vis.bool(), inside.shape) & inside
        # full: every in-range row sees all bn keys (a key tail can never be all visible)
        is_full = (vis | (i >= g.seqlen_q)).flatten(1).all(1)
        is_empty = ~vis.flatten(1).any(1)
        new = torch.where(is_full, FULL, torch.where(is_empty, EMPTY, PARTIAL)).to(torch.int8)
        state[blk[:, 0], blk[:, 1], blk[:, 2], blk[:, 3]] = new
        sel = new == PARTIAL
        k = int(sel.sum())
        if k:
            chunks.append(pack_bits(vis[sel]))
            pb = blk[sel]
            part_index[pb[:, 0], pb[:, 1], pb[:, 2], pb[:, 3]] = torch.arange(
                n_parts, n_parts + k, dtype=torch.int32, device=g.device)
            n_parts += k
    if chunks:
        bits = torch.cat(chunks)
    else:
        bits = torch.zeros((0, g.block_m, g.block_n // 8), dtype=torch.uint8, device=g.device)
    return state, part_index, bits
