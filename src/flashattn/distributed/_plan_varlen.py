"""The ring schedule of the varlen layout: packed documents, each cut into ``2·world`` chunks (zigzag).

Inside the ring a rank's tokens are reordered *piece-major*: every document's chunk r (piece A), then every
document's chunk ``2·world − 1 − r`` (piece B). A (query piece, key piece) pair is then one varlen kernel call
over all documents at once (``cu_seqlens`` of the chunks) whenever every document needs the same
bottom-right-aligned mask on it: always without a window (a chunk pair is either unmasked, the diagonal or
invisible, the same for every document). With a window or ALiBi, documents of different lengths need
different masks; they are grouped by the mask they need and each group's tokens gathered into one call.

Documents attend only to themselves (seqlen_q = seqlen_k per document): positions are document-relative.
"""

from __future__ import annotations

import functools

import torch

from flashattn.distributed._geometry import blocks, doc_chunks, ranges_index
from flashattn.distributed._tasks import Exact, Task


def _excl_cumsum(x):
    return torch.cumsum(x, 0) - x


class VarlenLayout:
    """One rank's pieces, for every document (int64 CPU tensors): ``pos`` (document-relative start),
    ``count`` and ``off`` (where the piece's tokens sit in the piece-major local buffer)."""

    def __init__(self, bounds: torch.Tensor, world: int, rank: int):
        a, b = rank, 2 * world - 1 - rank
        a_pos, a_cnt = bounds[:, a], bounds[:, a + 1] - bounds[:, a]
        b_pos, b_cnt = bounds[:, b], bounds[:, b + 1] - bounds[:, b]
        n_a = int(a_cnt.sum())
        self.pieces = ((a_pos, a_cnt, _excl_cumsum(a_cnt), 0), (b_pos, b_cnt, n_a + _excl_cumsum(b_cnt), n_a))
        self.total = n_a + int(b_cnt.sum())

    def region(self, p: int) -> tuple[int, int]:
        _, cnt, _, start = self.pieces[p]
        return start, start + int(cnt.sum())


def piece_major_index(cu: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Local (document-major: A_0, B_0, A_1, B_1, ...) token index of each piece-major slot."""
    bounds = doc_chunks(cu[1:] - cu[:-1], world)
    a, b = rank, 2 * world - 1 - rank
    a_cnt, b_cnt = bounds[:, a + 1] - bounds[:, a], bounds[:, b + 1] - bounds[:, b]
    local_start = _excl_cumsum(a_cnt + b_cnt)
    return torch.cat((ranges_index(local_start, a_cnt), ranges_index(local_start + a_cnt, b_cnt)))


def longest_shard(cu: torch.Tensor, world: int) -> int:
    """The most tokens any rank holds."""
    bounds = doc_chunks(cu[1:] - cu[:-1], world)
    per_chunk = (bounds[:, 1:] - bounds[:, :-1]).sum(0)  # (2·world,)
    return int((per_chunk[:world] + per_chunk[world:].flip(0)).max())


def _cu(counts: torch.Tensor, device) -> torch.Tensor:
    return torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0))).to(device, torch.int32)


def _pair_tasks(qp, kp, q_region, k_region, b, alibi: bool, device) -> list[Task]:
    """Tasks of one (query piece, key piece) pair over all documents; ``b`` is :func:`blocks`' result."""
    q_pos, m, q_off, _ = qp
    k_pos, n, k_off, _ = kp
    active = (m > 0) & (n > 0)
    if not bool((b["visible"] & active).any()):
        return []
    exact = ~b["alibi_ok"] if alibi else torch.zeros_like(active)
    whole = (b["a0"] == 0) & (b["a1"] == m) & (b["b0"] == 0) & (b["b1"] == n)
    sel = active.nonzero().flatten()
    kinds = torch.stack((b["causal"].long(), b["left"], b["right"], exact.long()), 1)
    act = kinds[sel]
    if bool((b["visible"][sel] & whole[sel]).all()) and bool((act == act[0]).all()) and not bool(exact.any()):
        # one call over the pieces as they lie: documents without keys here just see nothing
        return [Task(rows=q_region, keys=k_region, causal=bool(act[0, 0]),
                     window=(int(act[0, 1]), int(act[0, 2])), cu_q=_cu(m, device), cu_k=_cu(n, device),
                     max_q=int(m.max()), max_k=int(n.max()))]
    vis = b["visible"].nonzero().flatten()
    groups, inverse = torch.unique(kinds[vis], dim=0, return_inverse=True)
    tasks = []
    for gi, (causal, left, right, is_exact) in enumerate(groups.tolist()):
        docs = vis[inverse == gi]
        a0, rows = b["a0"][docs], b["a1"][docs] - b["a0"][docs]
        b0, keys = b["b0"][docs], b["b1"][docs] - b["b0"][docs]
        rows_idx = ranges_index(q_off[docs] + a0, rows).to(device)
        keys_idx = ranges_index(k_off[docs] + b0, keys).to(device)
        if is_exact:
            ex = Exact(pos_q=ranges_index(q_pos[docs] + a0, rows).to(device),
                       pos_k=ranges_index(k_pos[docs] + b0, keys).to(device),
                       doc_q=torch.repeat_interleave(docs, rows).to(device),
                       doc_k=torch.repeat_interleave(docs, keys).to(device))
            tasks.append(Task(rows=rows_idx, keys=keys_idx, exact=ex))
            continue
        tasks.append(Task(rows=rows_idx, keys=keys_idx, causal=bool(causal), window=(left, right),
                          cu_q=_cu(rows, device), cu_k=_cu(keys, device), max_q=int(rows.max()),
                          max_k=int(keys.max()), slope_rows=docs.to(device)))
    return tasks


def plan(cu: torch.Tensor, world: int, rank: int, left: int, right: int, alibi: bool, device):
    """``(needed, tasks_of)``: per step ``t < world`` whether any rank has work with the block of its rank
    ``r − t``, and a function of the step giving this rank's tasks. ``cu``: int64 CPU ``(ndocs + 1,)``
    global document boundaries.

    Memoised on the boundaries and options (a pure function of them; its tasks are never modified): every
    layer of a model attends over the same documents, so only the first call of a batch plans (a few ms
    of host time for tens of documents)."""
    needed, steps = _plan(tuple(cu.tolist()), world, rank, left, right, alibi, str(torch.device(device)))
    return needed, steps.__getitem__


@functools.lru_cache(maxsize=32)
def _plan(cu_list: tuple[int, ...], world: int, rank: int, left: int, right: int, alibi: bool, device: str):
    cu = torch.tensor(cu_list, dtype=torch.int64)
    bounds = doc_chunks(cu[1:] - cu[:-1], world)  # (ndocs, 2·world + 1)
    ranks = torch.arange(world)
    # every rank's pieces as (ndocs, world) tensors, for the steps any rank needs
    a_pos, a_cnt = bounds[:, :world], bounds[:, 1 : world + 1] - bounds[:, :world]
    b_idx = 2 * world - 1 - ranks
    b_pos, b_cnt = bounds[:, b_idx], bounds[:, b_idx + 1] - bounds[:, b_idx]
    every = ((a_pos, a_cnt), (b_pos, b_cnt))
    needed = [True] + [False] * (world - 1)
    for t in range(1, world):
        src = (ranks - t) % world
        for q_pos, m in every:
            for k_pos, n in every:
                b = blocks(q_pos, m, k_pos[:, src], n[:, src], 1, 0, left, right)
                needed[t] |= bool((b["visible"] & (m > 0) & (n[:, src] > 0)).any())
    me = VarlenLayout(bounds, world, rank)
    steps = []
    for t in range(world):
        src = (rank - t) % world
        them = me if src == rank else VarlenLayout(bounds, world, src)
        tasks = []
        for qi, qp in enumerate(me.pieces):
            for ki, kp in enumerate(them.pieces):
                b = blocks(qp[0], qp[1], kp[0], kp[1], 1, 0, left, right)
                tasks += _pair_tasks(qp, kp, me.region(qi), them.region(ki), b, alibi, device)
        steps.append(tuple(tasks))
    return tuple(needed), tuple(steps)
