"""Process groups and the point-to-point exchanges of the ring.

A group is given as a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(DeviceMesh, dim)`` pair (a dimension of a
multi-dimensional mesh, by name or index), or None for the default group. Nothing is cached between calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashattn.errors import FlashAttnError


def resolve(group, name: str = "group"):
    """The ProcessGroup ``group`` stands for."""
    if not dist.is_available() or not dist.is_initialized():
        raise FlashAttnError(
            f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group first "
            f"(torchrun sets up its environment)"
        )
    if group is None:
        return dist.group.WORLD
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise FlashAttnError(
                f"{name} is a {group.ndim}-D DeviceMesh; pass one dimension: mesh['<dim name>'] or "
                f"(mesh, '<dim name>')"
            )
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, dist.ProcessGroup):
        return group
    raise FlashAttnError(
        f"{name} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim) pair or "
        f"None, got {type(group).__name__}"
    )


def rank_world(pg) -> tuple[int, int]:
    return dist.get_rank(pg), dist.get_world_size(pg)


def check_same(pg, fields: dict[str, int], device) -> None:
    """Raise ValueError (on every rank alike) unless every rank of ``pg`` passed the same ``fields``.

    One small all-gather: shards of different shapes or options would otherwise exchange mismatched
    buffers, which hangs or corrupts instead of failing.
    """
    world = dist.get_world_size(pg)
    if world == 1:
        return
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=pg)
    rows = [t.tolist() for t in every]
    for col, key in enumerate(fields):
        values = [row[col] for row in rows]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values))
            raise FlashAttnError(
                f"the ranks of the group disagree on {key} ({per_rank}); every rank must pass shards of the "
                f"same shapes and the same options"
            )


class Pending:
    """Point-to-point transfers in flight: ``wait()`` returns the received tensors, one list per leg."""

    def __init__(self, works, received, sent):
        self._works, self._received = works, received
        self._sent = sent  # referenced until completion: the transport reads them asynchronously

    def wait(self) -> list[list[torch.Tensor]]:
        for w in self._works:
            w.wait()
        self._sent = None
        return self._received


class Ring:
    """Exchanges over a group: for each leg ``(tensors, shift, tag)`` rank r sends the (contiguous) tensors
    to r + shift and receives tensors of the same shapes and dtypes from r − shift.

    Every rank posts the same legs in the same order; tags keep kinds of message apart where the
    transport honours them (gloo). Transfers run asynchronously while the caller computes: gloo in its own
    threads, NCCL on its internal stream (a CUDA stream of its own, not the compute stream); ``wait()``
    makes the current stream wait for them without blocking the host.
    """

    def __init__(self, pg):
        self.pg = pg
        self.rank, self.world = rank_world(pg)

    def _global(self, shift: int) -> int:
        return dist.get_global_rank(self.pg, (self.rank + shift) % self.world)

    def exchange(self, legs) -> Pending | None:
        if not legs:
            return None
        ops, received, sent = [], [], []
        for tensors, shift, tag in legs:
            dst, src = self._global(shift), self._global(-shift)
            got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
            ops += [dist.P2POp(dist.isend, t, dst, self.pg, tag) for t in tensors]
            ops += [dist.P2POp(dist.irecv, r, src, self.pg, tag) for r in got]
            received.append(got)
            sent.append(tensors)
        return Pending(dist.batch_isend_irecv(ops), received, sent)
