"""The ring schedule of the padded layout ``(b, s_local, h, d)``: which steps any rank needs, and this
rank's tasks at each step.

Step t attends this rank's queries to the K/V block of rank ``(r − t) mod world``. The schedule depends only
on integers (layout, lengths, world, rank, window, whether ALiBi is on), so it is computed once per
signature (an lru_cache of pure results: no state that changes behaviour).
"""

from __future__ import annotations

import functools

import torch

from flashattn.distributed._geometry import blocks
from flashattn.distributed._tasks import Exact, Task


def _piece_table(layout: str, seqlen: int, world: int):
    """Per piece index: (first position of every rank's piece (world,), count, stride, local offset)."""
    ranks = torch.arange(world, dtype=torch.int64)
    if layout == "contiguous":
        c = seqlen // world
        return [(ranks * c, c, 1, 0)]
    if layout == "zigzag":
        c = seqlen // (2 * world)
        return [(ranks * c, c, 1, 0), ((2 * world - 1 - ranks) * c, c, 1, c)]
    return [(ranks, seqlen // world, world, 0)]


def _coalesce(specs: list[dict]) -> list[dict]:
    """Merge unmasked blocks that share their keys and have adjacent rows (or share rows, adjacent keys):
    one larger call instead of two (zigzag steps become one call each, as in ring-flash-attn)."""
    specs = sorted(specs, key=lambda s: (s["rows"], s["keys"]))
    changed = True
    while changed:
        changed = False
        for i in range(len(specs)):
            for j in range(len(specs)):
                a, b = specs[i], specs[j]
                if i == j or not (a["full"] and b["full"]):
                    continue
                if a["keys"] == b["keys"] and a["rows"][1] == b["rows"][0]:
                    merged = dict(a, rows=(a["rows"][0], b["rows"][1]))
                elif a["rows"] == b["rows"] and a["keys"][1] == b["keys"][0]:
                    merged = dict(a, keys=(a["keys"][0], b["keys"][1]))
                else:
                    continue
                specs = [s for k, s in enumerate(specs) if k not in (i, j)] + [merged]
                changed = True
                break
            if changed:
                break
    return sorted(specs, key=lambda s: (s["rows"], s["keys"]))


@functools.lru_cache(maxsize=256)
def plan(layout: str, seqlen_q: int, seqlen_k: int, world: int, rank: int, left: int, right: int,
         alibi: bool) -> tuple[tuple[bool, ...], tuple[tuple[dict, ...], ...]]:
    """``(needed, steps)``: per step ``t < world`` whether any rank has work with the block of its rank
    ``r − t``, and this rank's block specs (dicts of ints; :func:`tasks` turns them into Tasks)."""
    offset = seqlen_k - seqlen_q
    q_tab, k_tab = _piece_table(layout, seqlen_q, world), _piece_table(layout, seqlen_k, world)
    ranks = torch.arange(world, dtype=torch.int64)
    needed, steps = [], []
    for t in range(world):
        needed.append(False)
        src = (ranks - t) % world
        mine = []
        for q_pos, m, stride, q_off in q_tab:
            for k_pos, n, _, k_off in k_tab:
                b = blocks(q_pos, m, k_pos[src], n, stride, offset, left, right)
                needed[t] |= bool(b["visible"].any())
                if not bool(b["visible"][rank]):
                    continue
                x = {name: int(val[rank]) for name, val in b.items()}
                exact = alibi and not x["alibi_ok"]
                mine.append(dict(
                    rows=(q_off + x["a0"], q_off + x["a1"]), keys=(k_off + x["b0"], k_off + x["b1"]),
                    causal=bool(x["causal"]), window=(x["left"], x["right"]), stride=stride, exact=exact,
                    q_pos=int(q_pos[rank]) + stride * x["a0"], k_pos=int(k_pos[src[rank]]) + stride * x["b0"],
                    full=not alibi and not x["causal"] and x["left"] == -1 and x["right"] == -1,
                ))
        steps.append(tuple(_coalesce(mine)))
    return tuple(needed), tuple(steps)


def tasks(specs: tuple[dict, ...], device) -> list[Task]:
    out = []
    for s in specs:
        exact = None
        if s["exact"]:
            m, n = s["rows"][1] - s["rows"][0], s["keys"][1] - s["keys"][0]
            exact = Exact(pos_q=s["q_pos"] + s["stride"] * torch.arange(m, device=device),
                          pos_k=s["k_pos"] + s["stride"] * torch.arange(n, device=device))
        out.append(Task(rows=s["rows"], keys=s["keys"], causal=s["causal"], window=s["window"],
                        alibi_scale=s["stride"], exact=exact))
    return out
