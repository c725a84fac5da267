"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: all-to-all from sequence shards to head shards,
attention on whole sequences, all-to-all back.

Every step is differentiable through autograd: the all-to-alls are functional collectives
(``all_to_all_single_autograd``), the reorderings are index_selects and the local attention is the public
``flash_attn_func`` (or, for the hybrid method, the ring), so there is no custom backward here.

Heads: rank w of a group of U gets query heads ``[w·h/U, (w+1)·h/U)``. K/V heads are cut alike when U divides
h_k; otherwise (GQA with fewer K/V heads than ranks, MQA) each K/V head is repeated ``lcm(h_k, U) / h_k``
times first, which keeps query head i reading K/V head ``i // (h / h_k)``; autograd sums the copies'
gradients.
"""

from __future__ import annotations

import math

import torch

from flashattn.distributed._geometry import positions


def _a2a(x, pg):
    from torch.distributed import _functional_collectives as funcol

    # waited here: the next step needs the data anyway, and an output that is never waited on explicitly
    # (a view, say) would leave its work registered until process exit
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, pg))


def seq_to_heads(x, pg, world: int):
    """(b, s, h, d) sequence shard -> (b, world·s, h/world, d): every rank's shard of this rank's heads,
    concatenated in rank order."""
    b, s, h, d = x.shape
    y = _a2a(x.view(b, s, world, h // world, d).permute(2, 0, 1, 3, 4), pg)  # (world, b, s, h/world, d)
    return y.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def heads_to_seq(x, pg, world: int):
    """Inverse of :func:`seq_to_heads`: (b, world·s, hl, d) -> (b, s, world·hl, d)."""
    b, n, hl, d = x.shape
    y = _a2a(x.view(b, world, n // world, hl, d).permute(1, 0, 2, 3, 4), pg)  # (world, b, s, hl, d)
    return y.permute(1, 2, 0, 3, 4).reshape(b, n // world, world * hl, d)


def lse_heads_to_seq(lse, pg, world: int):
    """(b, hl, world·s) -> (b, world·hl, s)."""
    b, hl, n = lse.shape
    y = _a2a(lse.view(b, hl, world, n // world).permute(2, 0, 1, 3), pg)  # (world, b, hl, s)
    return y.permute(1, 0, 2, 3).reshape(b, world * hl, n // world)


def kv_repeats(nheads_k: int, world: int) -> int:
    """How many times each K/V head is repeated so that the group can cut the K/V heads evenly."""
    return math.lcm(nheads_k, world) // nheads_k


def _order(layout: str, seqlen: int, world: int):
    """(to natural order, back to rank-concatenated order), or None for the contiguous layout."""
    if layout == "contiguous":
        return None
    concat = torch.cat([positions(layout, seqlen, world, r) for r in range(world)])
    return torch.argsort(concat), concat


def ulysses(q, k, v, pg, world: int, rank: int, *, layout: str, inner, alibi_slopes, learnable_sink,
            return_lse: bool):
    """Ulysses around ``inner(q, k, v, alibi_slopes, learnable_sink) -> (out, lse)``, which attends whole
    sequences (in natural order) of this rank's heads.

    q, k, v: ``(b, s_local, ·, ·)`` sequence shards in ``layout``; alibi_slopes ``(h,)``/``(b, h)`` and
    learnable_sink ``(h,)`` or None. Returns this rank's ``(out, lse or None)`` shards.
    """
    h, hk = q.shape[2], k.shape[2]
    rep = kv_repeats(hk, world)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qh, kh, vh = (seq_to_heads(x, pg, world) for x in (q, k, v))
    orders = [_order(layout, x.shape[1], world) for x in (qh, kh)]
    if orders[0] is not None:
        qh = qh.index_select(1, orders[0][0].to(qh.device))
        kh = kh.index_select(1, orders[1][0].to(kh.device))
        vh = vh.index_select(1, orders[1][0].to(vh.device))
    heads = slice(rank * h // world, (rank + 1) * h // world)
    slopes = None if alibi_slopes is None else alibi_slopes[..., heads]
    sink = None if learnable_sink is None else learnable_sink[heads]
    out, lse = inner(qh, kh, vh, slopes, sink)
    if orders[0] is not None:
        back = orders[0][1].to(out.device)
        out = out.index_select(1, back)
        lse = lse.index_select(2, back) if return_lse else lse
    out = heads_to_seq(out, pg, world)
    return out, lse_heads_to_seq(lse, pg, world) if return_lse else None
