"""One ring step's work as a list of single-device calls (:class:`Task`), and how a task runs forward and
backward. The planners (:mod:`._plan_padded`, :mod:`._plan_varlen`) build the tasks; :mod:`.ring` runs them.

A task selects rows of the local queries and keys of the K/V block at hand, either as a ``(start, stop)``
range along the token dimension (a view: no copy) or as an int64 index (a gather, for varlen groups of
documents whose pieces are not adjacent), and says how the block is computed:

* by the single-device kernels (:mod:`._local`) with a bottom-right-aligned ``causal``/``window`` on the
  block, ALiBi slopes multiplied by ``alibi_scale`` (the layout's position stride), varlen ``cu_seqlens``;
* or, where the kernels cannot express the block (ALiBi with a shifted diagonal), by :mod:`._exact` from the
  tokens' global positions (``exact`` holds them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashattn.distributed import _exact, _local
from flashattn.distributed._merge import merge_into


@dataclass
class RingStats:
    """What a ring call did on this rank, filled in when passed as ``stats=`` (tests assert on it).

    A step is the attention of this rank's queries with one rank's K/V block; there are ``world`` of them
    (step 0: the rank's own block). A step is *skipped* when no query of this rank sees any key of that
    block (causal or window band): no kernel runs for it. Blocks that no rank needs are not even sent.

    Fields:
        world: ring size.
        down_steps, up_steps: blocks each rank receives per pass through the down relay (from r − 1, r − 2,
            ...) and the up relay (from r + 1, ...); their sum is ``world − 1`` unless a narrow band lets the
            relays stop early. rounds: ``max(down_steps, up_steps)``, transfer rounds per pass.
        forward_computed / forward_skipped: steps with / without local work in the forward.
        backward_computed / backward_skipped: the same in the backward (0 until backward runs).
        kernel_calls: single-device kernel calls (forward and backward).
        exact_calls: block computations that fell back to the float32 position-exact path (ALiBi on a block
            off the kernel's diagonal).
    """

    world: int = 0
    down_steps: int = 0
    up_steps: int = 0
    rounds: int = 0
    forward_computed: int = 0
    forward_skipped: int = 0
    backward_computed: int = 0
    backward_skipped: int = 0
    kernel_calls: int = 0
    exact_calls: int = 0


@dataclass
class Exact:
    """Global positions (and varlen document ids) of a task's rows and keys, for :mod:`._exact`."""

    pos_q: torch.Tensor
    pos_k: torch.Tensor
    doc_q: torch.Tensor | None = None
    doc_k: torch.Tensor | None = None


@dataclass
class Task:
    rows: tuple[int, int] | torch.Tensor
    keys: tuple[int, int] | torch.Tensor
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    alibi_scale: int = 1
    exact: Exact | None = None
    # varlen: per-sequence boundaries of the selected rows and keys, the longest of each, and which rows of
    # (batch, h) ALiBi slopes the sequences use (None: all, in order)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    slope_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class Options:
    """The call's options as the tasks need them."""

    softmax_scale: float
    softcap: float
    alibi_slopes: torch.Tensor | None
    deterministic: bool
    offset: int  # seqlen_k − seqlen_q of the full problem (0 in varlen)
    left: int  # window as _geometry.band takes it (UNBOUNDED = none; right 0 under causal)
    right: int


def _take(x, sel, dim: int):
    if isinstance(sel, tuple):
        return x.narrow(dim, sel[0], sel[1] - sel[0])
    return x.index_select(dim, sel)


def _slopes_kernel(task: Task, opts: Options):
    s = opts.alibi_slopes
    if s is None:
        return None
    if task.slope_rows is not None and s.dim() == 2:
        s = s.index_select(0, task.slope_rows)
    return s * task.alibi_scale if task.alibi_scale != 1 else s


def _slopes_exact(task: Task, opts: Options, varlen: bool):
    """(b|1, h, m|1) slopes for _exact: per sequence in the padded layout, per row (by document) in varlen."""
    s = opts.alibi_slopes
    if s is None:
        return None
    if s.dim() == 1:
        return s.view(1, -1, 1)
    if varlen:
        return s.index_select(0, task.exact.doc_q).t().unsqueeze(0)
    return s.unsqueeze(-1)


def _kernel_kw(task: Task, opts: Options) -> dict:
    return dict(softmax_scale=opts.softmax_scale, causal=task.causal, window_size=task.window,
                softcap=opts.softcap, alibi_slopes=_slopes_kernel(task, opts), cu_seqlens_q=task.cu_q,
                cu_seqlens_k=task.cu_k, max_seqlen_q=task.max_q, max_seqlen_k=task.max_k)


def _exact_kw(task: Task, opts: Options, varlen: bool) -> dict:
    e = task.exact
    return dict(offset=opts.offset, left=opts.left, right=opts.right, softmax_scale=opts.softmax_scale,
                softcap=opts.softcap, slopes=_slopes_exact(task, opts, varlen), doc_q=e.doc_q, doc_k=e.doc_k)


def run_forward(task: Task, q, k, v, acc_out, acc_lse, opts: Options, stats: RingStats | None) -> None:
    """Attention of the task's rows with its keys, merged into the float32 accumulators (rows like q's)."""
    td = q.dim() - 3  # token dimension: 1 padded, 0 varlen
    varlen = td == 0
    qs, ks, vs = _take(q, task.rows, td), _take(k, task.keys, td), _take(v, task.keys, td)
    if task.exact is not None:
        if varlen:
            qs, ks, vs = qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0)
        out, lse = _exact.forward(qs, ks, vs, task.exact.pos_q, task.exact.pos_k,
                                  **_exact_kw(task, opts, varlen))
        if varlen:
            out, lse = out[0], lse[0]
    else:
        out, lse = _local.forward(qs, ks, vs, **_kernel_kw(task, opts))
    if stats is not None:
        stats.exact_calls += task.exact is not None
        stats.kernel_calls += task.exact is None
    if isinstance(task.rows, tuple):
        merge_into(_take(acc_out, task.rows, td), _take(acc_lse, task.rows, acc_lse.dim() - 1), out, lse)
        return
    a_out, a_lse = acc_out.index_select(td, task.rows), acc_lse.index_select(acc_lse.dim() - 1, task.rows)
    merge_into(a_out, a_lse, out, lse)
    acc_out.index_copy_(td, task.rows, a_out)
    acc_lse.index_copy_(acc_lse.dim() - 1, task.rows, a_lse)


def _add(acc, sel, dim: int, x) -> None:
    if isinstance(sel, tuple):
        acc.narrow(dim, sel[0], sel[1] - sel[0]).add_(x)
    else:
        # the indices of one task are distinct, so the adds do not collide (deterministic on any device)
        acc.index_add_(dim, sel, x.to(acc.dtype))


def run_backward(task: Task, dout, q, k, v, out, lse, dq_acc, opts: Options, stats: RingStats | None):
    """The task's gradients against the final ``out``/``lse`` (+inf = row sees no key). dQ is added to the
    float32 ``dq_acc`` (rows like q's) at once; returns ``(add_dk, add_dv)``, callables that add dK/dV to
    float32 accumulators shaped like the block, for the ring to apply once the block's accumulator has
    arrived."""
    td = q.dim() - 3
    varlen = td == 0
    qs, ks, vs = _take(q, task.rows, td), _take(k, task.keys, td), _take(v, task.keys, td)
    dos, os_ = _take(dout, task.rows, td), _take(out, task.rows, td)
    ls = _take(lse, task.rows, lse.dim() - 1)
    if task.exact is not None:
        if varlen:
            qs, ks, vs, dos, os_, ls = (x.unsqueeze(0) for x in (qs, ks, vs, dos, os_, ls))
        dq, dk, dv = _exact.backward(dos, qs, ks, vs, os_, ls, task.exact.pos_q, task.exact.pos_k,
                                     **_exact_kw(task, opts, varlen))
        if varlen:
            dq, dk, dv = dq[0], dk[0], dv[0]
    else:
        dq, dk, dv = _local.backward(dos, qs, ks, vs, os_, ls, deterministic=opts.deterministic,
                                     **_kernel_kw(task, opts))
    if stats is not None:
        stats.exact_calls += task.exact is not None
        stats.kernel_calls += task.exact is None
    _add(dq_acc, task.rows, td, dq)
    return (lambda acc: _add(acc, task.keys, td, dk)), (lambda acc: _add(acc, task.keys, td, dv))
