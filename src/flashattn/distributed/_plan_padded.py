"""The ring schedule of the padded layout ``(b, s_local, h, d)``: which steps any rank needs, and this
rank's tasks at each step.

Step t attends this rank's queries to the K/V block of rank ``(r − t) mod world``. The schedule depends only
on integers (layout, lengths, world, rank, window, whether ALiBi is on), so it is computed once per
signature (an lru_cache of pure results: no state that changes behaviour).
"""

from __future__ import annotations

import functools

import torch

from flashattn.distributed._geometry import UNBOUNDED, band, blocks, rect
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


def _canonical(r: dict) -> tuple:
    """What a :func:`rect` result selects (two equal tuples select the same (row, key) pairs)."""
    if not bool(r["visible"]):
        return (False,)
    return tuple(int(r[k]) for k in ("a0", "a1", "b0", "b1", "causal", "left", "right"))


def _one_call(pairs: list[tuple], rows: int, keys: int, specs: list[dict]) -> dict | None:
    """One call over all local rows and all of the block's keys that does the work of the step's several,
    when a single bottom-right-aligned band on the concatenated tokens selects, on every (query piece, key
    piece) pair, exactly the pairs the true band does: zigzag's step 0 is one causal call (its two pieces
    are in increasing position order), as in ring-flash-attn.

    pairs: ``(q_off, m, k_off, n, lo, hi)`` of every piece pair (true band ``lo <= j − i <= hi``).
    """
    c = keys - rows
    candidates = [(-1, 0), (-1, -1)]
    for s in specs:  # each task's own band, in the coordinates of the whole block
        (r0, r1), (k0, k1) = s["rows"], s["keys"]
        ct = (k1 - k0) - (r1 - r0)
        left, right = s["window"][0], 0 if s["causal"] else s["window"][1]
        lo = ct - left + k0 - r0 if left >= 0 else None
        hi = ct + right + k0 - r0 if right >= 0 else None
        # a negative bound reads as unbounded, like the kernels read it; the check below decides either way
        candidates.append((-1 if lo is None else max(-1, c - lo), -1 if hi is None else max(-1, hi - c)))
    for left, right in candidates:
        same = True
        for q_off, m, k_off, n, lo, hi in pairs:
            shift = k_off - q_off  # j − i in the block = (j'' − i'') + shift
            c_lo = torch.tensor(-UNBOUNDED if left < 0 else c - left - shift)
            c_hi = torch.tensor(UNBOUNDED if right < 0 else c + right - shift)
            if _canonical(rect(c_lo, c_hi, torch.tensor(m), torch.tensor(n))) != _canonical(
                    rect(torch.tensor(lo), torch.tensor(hi), torch.tensor(m), torch.tensor(n))):
                same = False
                break
        if same:
            whole = rect(torch.tensor(-UNBOUNDED if left < 0 else c - left),
                         torch.tensor(UNBOUNDED if right < 0 else c + right), torch.tensor(rows),
                         torch.tensor(keys))
            x = {k: int(v) for k, v in whole.items()}
            return dict(rows=(x["a0"], x["a1"]), keys=(x["b0"], x["b1"]), causal=bool(x["causal"]),
                        window=(x["left"], x["right"]), stride=specs[0]["stride"], exact=False, q_pos=0,
                        k_pos=0, full=False)
    return None


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
        mine, pairs = [], []
        for q_pos, m, stride, q_off in q_tab:
            for k_pos, n, _, k_off in k_tab:
                b = blocks(q_pos, m, k_pos[src], n, stride, offset, left, right)
                needed[t] |= bool(b["visible"].any())
                lo, hi, _ = band(q_pos[rank], k_pos[src[rank]], stride, offset, left, right)
                pairs.append((q_off, m, k_off, n, int(lo), int(hi)))
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
        mine = _coalesce(mine)
        if len(mine) > 1 and not alibi:
            one = _one_call(pairs, q_tab[-1][3] + q_tab[-1][1], k_tab[-1][3] + k_tab[-1][1], mine)
            mine = [one] if one is not None else mine
        steps.append(tuple(mine))
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
