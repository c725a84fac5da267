"""Cutting a full sequence into this rank's shard, and gathering shards back (padded and varlen layouts).

``shard`` and ``shard_varlen`` only index (no communication): every rank passes the same full tensor and
keeps its part. ``unshard`` and ``unshard_varlen`` all-gather (a functional collective with autograd, so a
loss on the gathered tensor back-propagates into each rank's shard).
"""

from __future__ import annotations

import torch

from flashattn.distributed import _comm
from flashattn.distributed._geometry import (
    check_divisible,
    check_layout,
    positions,
    varlen_local_index,
    varlen_pieces,
)
from flashattn.errors import FlashAttnError


def _gather(x, dim: int, pg):
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_gather_single_autograd(x.contiguous(), gather_dim=dim, group=pg))


def shard(x: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's part of a full sequence.

    Args:
        x: any tensor holding the full sequence along ``dim``, e.g. ``(batch, seqlen, nheads, headdim)``.
        group: ProcessGroup, 1-D DeviceMesh, ``(DeviceMesh, dim)`` or None (default group), default None.
        layout: ``"contiguous"`` (rank r holds chunk r of ``world``), ``"zigzag"`` (default; the sequence cut
            into ``2·world`` chunks, rank r holds chunks r and ``2·world − 1 − r``, which balances causal
            work) or ``"striped"`` (rank r holds tokens r, r + world, r + 2·world, ...).
        dim: int, default 1, the sequence dimension.

    Returns:
        A new tensor like x with ``seqlen / world`` along ``dim``, the rank's tokens in increasing position
        order within each chunk (zigzag: chunk r, then chunk ``2·world − 1 − r``).

    Raises ValueError when ``seqlen`` is not a multiple of ``world`` (``2·world`` for zigzag).

    A hybrid (Ulysses × ring) layout is two cuts: ``shard(shard(x, ring_group, layout=layout),
    ulysses_group, layout="contiguous")``; :func:`unshard` the other way round.
    """
    check_layout(layout)
    pg = _comm.resolve(group)
    rank, world = _comm.rank_world(pg)
    check_divisible("x", x.shape[dim], layout, world)
    return x.index_select(dim, positions(layout, x.shape[dim], world, rank).to(x.device))


def unshard(x_local: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (all-gather; differentiable): inverse of :func:`shard`.

    Args:
        x_local: this rank's shard, ``seqlen / world`` along ``dim``; every rank's of the same shape.
        group, layout, dim: as :func:`shard` got them.

    Returns: a tensor like x_local with ``seqlen`` along ``dim``, in natural position order.
    """
    check_layout(layout)
    pg = _comm.resolve(group)
    _, world = _comm.rank_world(pg)
    full = _gather(x_local, dim, pg)
    if layout == "contiguous":
        return full
    seqlen = x_local.shape[dim] * world
    order = torch.argsort(torch.cat([positions(layout, seqlen, world, r) for r in range(world)]))
    return full.index_select(dim, order.to(full.device))


def _host_cu(cu_seqlens, total: int | None = None, name: str = "cu_seqlens") -> torch.Tensor:
    """cu_seqlens as an int64 CPU tensor, checked: 1-D, starts at 0, non-decreasing, ends at ``total``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise FlashAttnError(f"{name} must be an int tensor of shape (ndocs + 1,), ndocs >= 1; got {got}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise FlashAttnError(f"{name} has dtype {cu_seqlens.dtype}; expected int32 (or int64)")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise FlashAttnError(f"{name}={cu.tolist()} must start at 0 and be non-decreasing")
    if total is not None and int(cu[-1]) != total:
        raise FlashAttnError(f"{name} ends at {int(cu[-1])} but the tensor has {total} tokens; the last "
                             "entry "
                             f"must be the total number of tokens")
    return cu


def local_cu_seqlens(cu: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """int64 ``(ndocs + 1,)`` offsets of each document's tokens in ``rank``'s varlen shard."""
    (_, a_len), (_, b_len) = varlen_pieces(cu[1:] - cu[:-1], world, rank)
    return torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(a_len + b_len, 0)))


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of packed documents, every document cut zigzag-wise.

    Args:
        x: ``(total, ...)``: the tokens of all documents packed along dim 0, as flash_attn_varlen_func takes
            them.
        cu_seqlens: int32 ``(ndocs + 1,)``: document boundaries (0, ..., total), on any device (it is read on
            the host).
        group: as :func:`shard`.

    Returns:
        x_local: ``(total_local, ...)``: for each document in turn, its chunk r then its chunk
            ``2·world − 1 − r`` of ``2·world`` near-equal chunks (chunk j of a document of length L covers
            ``[j·L // (2·world), (j+1)·L // (2·world))``; documents shorter than ``2·world`` leave some
            chunks, and so some ranks, empty; that is allowed).
        cu_seqlens_local: int32 ``(ndocs + 1,)`` on cu_seqlens' device: each document's tokens in x_local.
    """
    pg = _comm.resolve(group)
    rank, world = _comm.rank_world(pg)
    cu = _host_cu(cu_seqlens, x.shape[0])
    idx = varlen_local_index(cu, world, rank)
    local_cu = local_cu_seqlens(cu, world, rank).to(device=cu_seqlens.device, dtype=torch.int32)
    return x.index_select(0, idx.to(x.device)), local_cu


def unshard_varlen(x_local: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> torch.Tensor:
    """The packed documents from every rank's varlen shard (all-gather; differentiable): inverse of
    :func:`shard_varlen`.

    Args:
        x_local: ``(total_local, ...)`` as :func:`shard_varlen` returned it on this rank.
        cu_seqlens: the *global* int32 ``(ndocs + 1,)`` boundaries.
        group: as :func:`shard`.

    Returns: ``(total, ...)``, the documents in their original order.
    """
    pg = _comm.resolve(group)
    rank, world = _comm.rank_world(pg)
    cu = _host_cu(cu_seqlens)
    indices = [varlen_local_index(cu, world, r) for r in range(world)]
    if x_local.shape[0] != indices[rank].numel():
        raise FlashAttnError(f"x_local has {x_local.shape[0]} tokens but this rank's shard of cu_seqlens "
                             "holds "
                             f"{indices[rank].numel()}; pass the global cu_seqlens that shard_varlen got")
    # an all-gather needs equal sizes: pad every shard to the longest
    longest = max(i.numel() for i in indices)
    pad = x_local.new_zeros((longest - x_local.shape[0], *x_local.shape[1:]))
    full = _gather(torch.cat((x_local, pad)), 0, pg)  # (world · longest, ...)
    # global token p came from rank w's local slot j: row w · longest + j of the gathered tensor
    src = torch.empty(int(cu[-1]), dtype=torch.int64)
    for r, idx in enumerate(indices):
        src[idx] = r * longest + torch.arange(idx.numel())
    return full.index_select(0, src.to(full.device))
