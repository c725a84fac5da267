"""Where each rank's tokens sit in the full sequence; which (query piece, key piece) blocks see each other.

Pure integer arithmetic, no communication and no tensors of activations.

A rank's shard is a few *pieces*: runs of tokens whose global positions are ``pos + stride * i`` for
``i < count``, stored at ``off .. off + count`` of the local tensor. ``contiguous``: one piece, chunk r of
``world``; ``zigzag``: chunks r and ``2·world − 1 − r`` of ``2·world`` (causal work is then equal on every
rank); ``striped``: one piece of stride ``world`` (tokens r, r + world, ...).

Visibility (design.md): key position pk is visible to query position pq iff
``−left <= pk − pq − G <= right`` with ``G = seqlen_k − seqlen_q`` (bottom-right alignment), ``right = 0``
under causal, an unbounded side being ±``UNBOUNDED``. Between a query piece and a key piece of one stride
this is a band of the local indices, ``lo <= j − i <= hi``; :func:`blocks` turns the band into the tight
rectangle of rows and keys that see something and the window a single-device kernel needs on that rectangle.

Everything is vectorised over ``int64`` tensors so that the varlen planner can evaluate all documents (and
all ranks) at once; the padded planner calls it with one-element tensors.
"""

from __future__ import annotations

import torch

from flashattn.errors import FlashAttnError

LAYOUTS = ("contiguous", "zigzag", "striped")
# an unbounded window side; large enough that no sum of lengths reaches it, small enough for int64 sums
UNBOUNDED = 1 << 40


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise FlashAttnError(f"layout={layout!r}; expected one of {', '.join(repr(x) for x in LAYOUTS)}")
    return layout


def n_chunks(layout: str, world: int) -> int:
    """How many equal chunks a padded sequence is cut into (the length must be a multiple of it)."""
    return 2 * world if layout == "zigzag" else world


def check_divisible(name: str, seqlen: int, layout: str, world: int) -> None:
    k = n_chunks(layout, world)
    if seqlen % k != 0:
        what = "2 * world size" if layout == "zigzag" else "the world size"
        raise FlashAttnError(
            f"{name} has global length {seqlen}, which layout={layout!r} cannot cut over {world} ranks: it "
            f"must be a multiple of {what} = {k} (pad the sequence, or use the varlen functions)"
        )


def pieces(layout: str, seqlen: int, world: int, rank: int) -> tuple[tuple[int, int, int, int], ...]:
    """The ``(pos, count, stride, off)`` pieces of ``rank``'s shard of a sequence of ``seqlen`` tokens."""
    if layout == "contiguous":
        c = seqlen // world
        return ((rank * c, c, 1, 0),)
    if layout == "zigzag":
        c = seqlen // (2 * world)
        return ((rank * c, c, 1, 0), ((2 * world - 1 - rank) * c, c, 1, c))
    n = seqlen // world
    return ((rank, n, world, 0),)


def positions(layout: str, seqlen: int, world: int, rank: int) -> torch.Tensor:
    """Global positions (int64, in local order) of ``rank``'s tokens."""
    return torch.cat([pos + stride * torch.arange(count)
                      for pos, count, stride, _ in pieces(layout, seqlen, world, rank)])


def doc_chunks(lengths: torch.Tensor, world: int) -> torch.Tensor:
    """``(ndocs, 2·world + 1)`` chunk boundaries of every document: chunk j of a document of length L is
    ``[j·L // (2·world), (j+1)·L // (2·world))`` (equal within one token; empty chunks when L < 2·world)."""
    j = torch.arange(2 * world + 1, dtype=torch.int64)
    return (lengths.view(-1, 1) * j.view(1, -1)) // (2 * world)


def varlen_pieces(lengths: torch.Tensor, world: int, rank: int):
    """Per document (int64 ``(ndocs,)`` each): start and length of ``rank``'s two chunks (r and
    ``2·world − 1 − r``), positions relative to the document's start."""
    bounds = doc_chunks(lengths, world)
    a, b = rank, 2 * world - 1 - rank
    return (bounds[:, a], bounds[:, a + 1] - bounds[:, a]), (bounds[:, b], bounds[:, b + 1] - bounds[:, b])


def _floor_div(a, b: int):
    return torch.div(a, b, rounding_mode="floor")


def band(q_pos, k_pos, stride: int, offset, left: int, right: int):
    """``(lo, hi)``: query i of a piece starting at ``q_pos`` sees key j of one starting at ``k_pos`` (both of
    ``stride``) iff ``lo <= j − i <= hi``; ±UNBOUNDED for an unbounded side. ``offset`` is
    ``seqlen_k − seqlen_q``; ``left``/``right`` the window (UNBOUNDED for none; right 0 under causal)."""
    e = k_pos - q_pos - offset  # key minus query position at i = j = 0, relative to the aligned diagonal
    # stride·(j − i) + e in [−left, right]
    #   <=>  j − i in [ceil((−left − e) / stride), floor((right − e) / stride)]
    lo = -_floor_div(left + e, stride) if left < UNBOUNDED else torch.full_like(e, -UNBOUNDED)
    hi = _floor_div(right - e, stride) if right < UNBOUNDED else torch.full_like(e, UNBOUNDED)
    return lo, hi, e


def rect(lo, hi, m, n) -> dict[str, torch.Tensor]:
    """The band ``lo <= j − i <= hi`` on an ``m × n`` block as a single-device call needs it (elementwise).

    Returns:
        visible: some row sees some key.
        a0, a1, b0, b1: the tight rectangle: rows ``[a0, a1)`` and keys ``[b0, b1)`` that see anything. Rows
            outside it see no key of the block; keys outside it are seen by no row.
        causal, left, right: the call on that rectangle (bottom-right aligned, ``−1`` = unbounded):
            ``causal`` when the right bound is 0. Both bounds are >= 0 on the tight rectangle, so no negative
            window (which the kernels cannot express) is ever needed.
        c: the rectangle's own diagonal offset (keys − rows), which its ALiBi distance is aligned with.
    """
    zero = torch.zeros_like(lo)
    a0 = torch.maximum(zero, -hi)
    a1 = torch.minimum(m + zero, n - lo)
    b0 = torch.maximum(zero, lo)
    b1 = torch.minimum(n + zero, m + hi)
    visible = (a1 > a0) & (b1 > b0) & (lo <= hi)
    rows, keys = a1 - a0, b1 - b0
    c = keys - rows  # the kernel's own diagonal offset on the rectangle (bottom-right)
    # band in rectangle coordinates: j'' − i'' in [lo + a0 − b0, hi + a0 − b0] = [c − L, c + R]
    win_l = c - (lo + a0 - b0)
    win_r = hi + a0 - b0 - c
    # a bound that excludes nothing on the rectangle is dropped (-1), so fully visible blocks run unmasked
    win_l = torch.where(win_l >= keys - 1, torch.full_like(win_l, -1), win_l)
    win_r = torch.where(win_r >= rows - 1, torch.full_like(win_r, -1), win_r)
    causal = win_r == 0
    return dict(visible=visible, a0=a0, a1=a1, b0=b0, b1=b1, causal=causal, left=win_l,
                right=torch.where(causal, torch.full_like(win_r, -1), win_r), c=c)


def blocks(q_pos, m, k_pos, n, stride: int, offset, left: int, right: int) -> dict[str, torch.Tensor]:
    """The work of (query piece, key piece) pairs, elementwise over broadcast int64 tensors.

    Args:
        q_pos, m: global position of the first query and the number of queries of each query piece.
        k_pos, n: the same for the key pieces.
        stride: the pieces' common position stride (1, or the world size for ``striped``).
        offset: ``seqlen_k − seqlen_q`` of the full problem (0 in varlen: documents attend to themselves).
        left, right: the window, UNBOUNDED for an unbounded side, right = 0 under causal.

    Returns :func:`rect`'s tensors for the band of each pair, and
        alibi_ok: the kernel's ALiBi distance ``|i + n' − m' − j|`` on the rectangle equals the global
            ``|pq + G − pk| / stride`` (so ALiBi is exact with slopes·stride); false where it needs a shifted
            diagonal the kernels do not take.
    """
    lo, hi, e = band(q_pos, k_pos, stride, offset, left, right)
    r = rect(lo, hi, m, n)
    e_div = _floor_div(e, stride)
    r["alibi_ok"] = (e_div * stride == e) & (r["c"] == r["a0"] - r["b0"] - e_div)
    return r


def window_bounds(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) as :func:`band` takes them: UNBOUNDED for a negative side, right 0 under causal."""
    left, right = (int(x) for x in window_size)
    left = UNBOUNDED if left < 0 else left
    right = 0 if causal else (UNBOUNDED if right < 0 else right)
    return left, right


def ranges_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))`` (int64), without a Python loop."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = torch.cumsum(lengths, 0) - lengths  # where each range begins in the output
    return torch.repeat_interleave(starts.to(torch.int64) - first, lengths) + torch.arange(total)


def varlen_local_index(cu: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Global token indices (int64) of ``rank``'s varlen shard, in its local order: every document's chunk
    ``rank``, then its chunk ``2·world − 1 − rank``, document after document."""
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    (a_pos, a_len), (b_pos, b_len) = varlen_pieces(lengths, world, rank)
    # interleave the two pieces of each document: (A_0, B_0, A_1, B_1, ...)
    s = torch.stack((starts + a_pos, starts + b_pos), 1).flatten()
    n = torch.stack((a_len, b_len), 1).flatten()
    return ranges_index(s, n)
