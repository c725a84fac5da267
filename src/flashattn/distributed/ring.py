"""Ring attention: K/V blocks travel around the group while each rank attends its queries to the blocks
at hand; one torch.autograd.Function over the whole ring (forward and backward).

Rank r of W needs the K/V block of every rank s at "step" ``t = (r − s) mod W`` (step 0: its own). The
blocks travel in two relays at once, each a ring: *down* (r sends to r + 1, receives from r − 1; round u
brings the block of r − u) for the steps ``1..a``, and *up* (to r − 1, from r + 1; round u brings r + u, step
W − u) for the steps ``W − b..W − 1``. ``a`` and ``b`` are the smallest that cover every step some rank needs
(:func:`split`): with no window all ``W − 1`` steps, in ``ceil((W − 1)/2)`` rounds using both directions of
every link; under a window narrower than a shard only the neighbours' blocks (causal: only r − 1's in the
contiguous layout), so farther blocks are neither computed nor sent. Each round posts its transfers
(one ``batch_isend_irecv``) before computing, so they run underneath the local attention.

Forward: partials merge into a float32 (out, lse) accumulator (:mod:`._merge`); the sink, if any, is folded
in once after the last round.

Backward: the same relays again (K/V circulate a second time: nothing per step is stored), each block
recomputed against the final LSE and output (so the kernels' ``D = rowsum(dO ∘ O)`` is the full softmax's).
dQ accumulates locally in float32. dK/dV of a block travel with it, in float32: each rank on the way adds
its contribution to the accumulator that arrives and passes it on; after the last round the holder sends
it straight back to the owner, who adds the two relays' sums to its own. Every reduction has a fixed order,
so with ``deterministic=True`` (the kernels' atomic-free backward) gradients are bitwise reproducible.
"""

from __future__ import annotations

import math

import torch

from flashattn.distributed._comm import Ring
from flashattn.distributed._merge import finalize, sink_grad
from flashattn.distributed._tasks import Options, RingStats, run_backward, run_forward

_TAG_KV, _TAG_DKV = 0, 2  # + 1 for the up relay


def split(needed, world: int) -> tuple[int, int]:
    """``(a, b)``: the down relay serves steps ``1..a``, the up relay steps ``W − b..W − 1``; every needed
    step is served, with the fewest rounds ``max(a, b)``, then the fewest transfers ``a + b``."""
    steps = [t for t in range(1, world) if needed[t]]
    best = None
    for a in range(world):
        rest = [t for t in steps if t > a]
        b = world - min(rest) if rest else 0
        cost = (max(a, b), a + b, -a)
        if best is None or cost < best[0]:
            best = (cost, a, b)
    return best[1], best[2]


class Schedule:
    """One call's plan: the relays' lengths and ``tasks(t)``, this rank's Task list at step t."""

    def __init__(self, needed, world: int, tasks_of):
        self.world = world
        self.down, self.up = split(needed, world)
        self.rounds = max(self.down, self.up)
        self._tasks_of = tasks_of
        self._memo: dict = {}  # the backward runs the forward's tasks again: plan them once per call

    def legs(self):
        """(shift, length, step at round u) of each relay in use, down first."""
        w = self.world
        legs = [(1, self.down, lambda u: u), (-1, self.up, lambda u: w - u)]
        return [leg for leg in legs if leg[1] > 0]

    def tasks(self, t: int):
        if t not in self._memo:
            self._memo[t] = self._tasks_of(t)
        return self._memo[t]


def _lse_shape(q) -> tuple[int, ...]:
    # padded (b, s, h, d) -> (b, h, s); varlen (total, h, d) -> (h, total)
    return (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])


def _count(stats, prefix: str, tasks) -> None:
    if stats is not None:
        setattr(stats, prefix + "_computed", getattr(stats, prefix + "_computed") + bool(tasks))


def _finish_counts(stats, prefix: str, world: int) -> None:
    if stats is not None:  # every step without work, reached or not
        setattr(stats, prefix + "_skipped", world - getattr(stats, prefix + "_computed"))


def ring_forward(q, k, v, sink, sched: Schedule, ring: Ring, opts: Options, stats: RingStats | None):
    """Float32 ``(out, lse)`` of this rank's queries over every rank's keys (lse +inf: the row sees none)."""
    acc_out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    acc_lse = torch.full(_lse_shape(q), -math.inf, dtype=torch.float32, device=q.device)
    legs = sched.legs()
    held = [[k, v] for _ in legs]  # the block each relay holds this round
    for u in range(sched.rounds + 1):
        pending = ring.exchange([(held[i], shift, _TAG_KV + i)
                                 for i, (shift, n, _) in enumerate(legs) if u < n])
        work = [(0, k, v)] if u == 0 else [(step(u), *held[i])
                                           for i, (_, n, step) in enumerate(legs) if u <= n]
        for t, kb, vb in work:
            tasks = sched.tasks(t)
            for task in tasks:
                run_forward(task, q, kb, vb, acc_out, acc_lse, opts, stats)
            _count(stats, "forward", tasks)
        if pending is not None:
            got = iter(pending.wait())
            held = [next(got) if u < n else held[i] for i, (_, n, _) in enumerate(legs)]
    _finish_counts(stats, "forward", sched.world)
    return finalize(acc_out, acc_lse, sink)


def _zeros32(tensors):
    return [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in tensors]


def ring_backward(dout, q, k, v, out, lse, sched: Schedule, ring: Ring, opts: Options,
                  stats: RingStats | None):
    """Float32 ``(dq, dk, dv)`` of this rank's shards (dk/dv complete: every rank's contribution)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    legs = sched.legs()
    held = [[k, v] for _ in legs]
    own = _zeros32((k, v))  # this block's dK/dV: its own contribution, then each relay's sum as it returns
    tasks = sched.tasks(0)
    for task in tasks:
        add_k, add_v = run_backward(task, dout, q, k, v, out, lse, dq, opts, stats)
        add_k(own[0])
        add_v(own[1])
    _count(stats, "backward", tasks)
    dkv_pending, posted = None, []  # the dK/dV transfers of the previous round, and their legs
    for u in range(sched.rounds + 1):
        kv_pending = ring.exchange([(held[i], shift, _TAG_KV + i) for i, (shift, n, _) in enumerate(legs)
                                    if u < n])
        if u >= 1:
            # compute first: the accumulators arriving from the previous round are only needed for the adds,
            # so their transfer runs underneath this round's kernels like the K/V transfer does
            parts = {}
            for i, (_, n, step) in enumerate(legs):
                if u <= n:
                    tasks = sched.tasks(step(u))
                    parts[i] = [run_backward(task, dout, q, held[i][0], held[i][1], out, lse, dq, opts, stats)
                                for task in tasks]
                    _count(stats, "backward", tasks)
            incoming = dict(zip(posted, dkv_pending.wait(), strict=True)) if dkv_pending is not None else {}
            for i in posted:
                if legs[i][1] == u - 1:  # that relay's last round was the previous one: own block's sum
                    own[0].add_(incoming[i][0])
                    own[1].add_(incoming[i][1])
            post, posted = [], []
            for i, (shift, n, _) in enumerate(legs):
                if u > n:
                    continue
                # block r ∓ u: the sum of the ranks before this one on its way (the first starts from 0),
                # then this rank's contribution
                acc = incoming[i] if u >= 2 else _zeros32(held[i])
                for add_k, add_v in parts[i]:
                    add_k(acc[0])
                    add_v(acc[1])
                # on with the block; after the relay's last round, straight back to the block's owner
                post.append((acc, shift if u < n else -shift * n, _TAG_DKV + i))
                posted.append(i)
            dkv_pending = ring.exchange(post)
        if kv_pending is not None:
            got = iter(kv_pending.wait())
            held = [next(got) if u < n else held[i] for i, (_, n, _) in enumerate(legs)]
    if dkv_pending is not None:  # the relays whose last round was the last round
        for acc in dkv_pending.wait():
            own[0].add_(acc[0])
            own[1].add_(acc[1])
    _finish_counts(stats, "backward", sched.world)
    return dq, own[0], own[1]


class RingAttention(torch.autograd.Function):
    """``(out, lse)`` of the ring; differentiable in q, k, v and the sink (the lse is not, as in
    flash_attn). ``call`` carries the schedule, the ring, the options and the optional stats."""

    @staticmethod
    def forward(ctx, q, k, v, sink, call):
        sched, ring, opts, stats = call
        # the transports send whole buffers: K/V (and everything received) are contiguous
        k, v = k.contiguous(), v.contiguous()
        out32, lse = ring_forward(q, k, v, sink, sched, ring, opts, stats)
        out = out32.to(q.dtype)
        # the sink's gradient takes D from the float32 output: rounding O to 16 bits would go straight
        # into it, with nothing to cancel it
        ctx.save_for_backward(q, k, v, out, lse, sink, out32 if sink is not None else None)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink, out32 = ctx.saved_tensors
        sched, ring, opts, stats = ctx.call
        if dout is None:  # only the (non-differentiable) lse was used; every rank still takes this path
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, sched, ring, opts, stats)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_grad(dout, out32, lse, sink).to(sink.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None
