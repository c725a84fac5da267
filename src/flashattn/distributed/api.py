"""``context_parallel_attn`` and ``context_parallel_attn_varlen``: attention of sequences sharded over a
group, equal to ``flashattn.flash_attn_func`` / ``flash_attn_varlen_func`` on the unsharded tensors."""

from __future__ import annotations

import torch

from flashattn.distributed import _checks, _comm, _local, _plan_padded, _plan_varlen
from flashattn.distributed._geometry import LAYOUTS, check_layout, window_bounds
from flashattn.distributed._tasks import Options, RingStats
from flashattn.distributed.layout import _host_cu
from flashattn.distributed.ring import RingAttention, Schedule
from flashattn.distributed.ulysses import ulysses
from flashattn.errors import FlashAttnError


def _fields(q, k, v, **options) -> dict[str, int]:
    """What every rank of a group must agree on, as ints."""
    f = dict(batch=q.shape[0] if q.dim() == 4 else 0, seqlen_q_local=q.shape[-3],
             seqlen_k_local=k.shape[-3], nheads=q.shape[-2], nheads_k=k.shape[-2], headdim=q.shape[-1],
             headdim_v=v.shape[-1], dtype=_checks.dtype_code(q.dtype))
    for key, val in options.items():
        f[key] = _checks.float_bits(val) if isinstance(val, float) else int(val)
    return f


def _describe(stats: RingStats | None, sched: Schedule) -> None:
    if stats is not None:
        stats.world, stats.down_steps, stats.up_steps, stats.rounds = (sched.world, sched.down, sched.up,
                                                                       sched.rounds)


@torch.compiler.disable  # P2P transfers and a host-side schedule: dynamo cannot trace the ring
def _ring(q, k, v, pg, *, layout, causal, scale, window, softcap, alibi_slopes, learnable_sink, deterministic,
          stats):
    rank, world = _comm.rank_world(pg)
    if layout == "zigzag":
        for name, x in (("q", q), ("k", k)):
            if x.shape[1] % 2:
                raise FlashAttnError(
                    f"{name} has {x.shape[1]} tokens per rank; layout='zigzag' holds two equal chunks per "
                    f"rank, so the local length must be even (the global length a multiple of "
                    f"2 * world size = {2 * world})"
                )
    sq, sk = q.shape[1] * world, k.shape[1] * world
    left, right = window_bounds(causal, window)
    needed, specs = _plan_padded.plan(layout, sq, sk, world, rank, left, right, alibi_slopes is not None)
    device = q.device
    sched = Schedule(needed, world, lambda t: _plan_padded.tasks(specs[t], device))
    opts = Options(scale, softcap, alibi_slopes, deterministic, sk - sq, left, right)
    _describe(stats, sched)
    return RingAttention.apply(q, k, v, learnable_sink, (sched, _comm.Ring(pg), opts, stats))


def context_parallel_attn(q, k, v, group=None, *, method: str = "ring", layout: str = "zigzag",
                          causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                          softcap: float = 0.0, alibi_slopes=None, learnable_sink=None,
                          deterministic: bool = False, return_lse: bool = False, ulysses_group=None,
                          ring_group=None, check_shards: bool = True, stats: RingStats | None = None):
    """Exact attention of sequences sharded over a group: this rank's output shard.

    The result equals ``flashattn.flash_attn_func`` on the unsharded tensors (bottom-right-aligned causal
    mask and window, softcap, ALiBi with global positions, learnable sink, GQA/MQA), sharded like q.

    Args:
        q: ``(batch, seqlen_q / world, nheads, headdim)``: this rank's shard (:func:`shard` with ``layout``),
            float16 / bfloat16 / float32, contiguous last dimension. Every rank's shard has the same shape.
        k: ``(batch, seqlen_k / world, nheads_k, headdim)``, same dtype and device; nheads % nheads_k == 0.
        v: ``(batch, seqlen_k / world, nheads_k, headdim_v)``.
        group: ProcessGroup, 1-D DeviceMesh, ``(DeviceMesh, dim)`` or None (default group), default None: the
            ranks the sequence is sharded over (unused by ``"hybrid"``).
        method: ``"ring"`` (default; K/V blocks circulate, partials merge in float32), ``"ulysses"``
            (all-to-all to head shards; nheads must be a multiple of the group size) or ``"hybrid"``
            (Ulysses within ``ulysses_group``, ring across ``ring_group``).
        layout: ``"zigzag"`` (default), ``"contiguous"`` or ``"striped"``: how the shards were cut (see
            :func:`shard`). Zigzag balances causal work; with a window narrower than a shard, contiguous
            and zigzag exchange blocks with neighbouring ranks only, striped with every rank.
        causal: bool, default False. Bottom-right aligned: query i sees key j iff
            ``j <= i + seqlen_k − seqlen_q``.
        softmax_scale: float > 0, default ``1 / sqrt(headdim)``.
        window_size: ``(left, right)`` ints, default ``(-1, -1)``; −1 (any negative) = unbounded; global
            positions. A block of keys outside every query's band is skipped without computing.
        softcap: float >= 0, default 0.0 (off): ``s ← softcap·tanh(s / softcap)`` before masking.
        alibi_slopes: None (default) or float32 ``(nheads,)`` / ``(batch, nheads)``:
            ``−slope·|i + sk − sq − j|`` with global i, j. Ring blocks off the kernels' diagonal run the
            float32 exact path (see the package docstring); Ulysses is exact at kernel speed.
        learnable_sink: None (default) or float32 ``(nheads,)``, the same on every rank: one extra logit per
            head that enters each row's softmax exactly once. Its gradient on each rank covers that rank's
            rows (ring) or heads (Ulysses): the sum over the group is the full gradient, which the usual
            all-reduce of replicated parameters (DDP/FSDP over the context-parallel ranks) computes.
        deterministic: bool, default False: bitwise-reproducible gradients (fixed reduction orders and the
            kernels' atomic-free backward).
        return_lse: bool, default False: also return the LSE shard.
        ulysses_group, ring_group: for ``method="hybrid"`` only (required there), each a group as ``group``.
            Shard with ``shard(shard(x, ring_group, layout=layout), ulysses_group, layout="contiguous")``.
        check_shards: bool, default True: compare shapes and options across the group first (one small
            all-gather read on the host); mismatched shards then raise ValueError on every rank instead of
            hanging. Turn off in tight loops whose shapes are known to agree.
        stats: a :class:`RingStats` to fill in (ring and hybrid): steps computed, skipped, transferred.

    Returns:
        out: ``(batch, seqlen_q / world, nheads, headdim_v)``, q's dtype, this rank's shard.
        lse (if return_lse): float32 ``(batch, nheads, seqlen_q / world)``, natural log, including the sink;
            +inf for rows that see no key. Not differentiable.

    Raises ValueError / TypeError naming the argument, the value and what is expected.
    """
    _checks.qkv(q, k, v)
    _checks.method(method)
    check_layout(layout)
    scale = _checks.scale(softmax_scale, q.shape[-1])
    window = _checks.window(window_size)
    softcap = _checks.softcap(softcap)
    h = q.shape[2]
    _checks.per_head("alibi_slopes", alibi_slopes, h, q.shape[0], q.device)
    _checks.per_head("learnable_sink", learnable_sink, h, None, q.device)
    if method != "hybrid" and (ulysses_group is not None or ring_group is not None):
        raise FlashAttnError(f"ulysses_group / ring_group are for method='hybrid', not method={method!r}")
    if method == "hybrid" and (ulysses_group is None or ring_group is None):
        raise FlashAttnError("method='hybrid' needs both ulysses_group and ring_group (e.g. the two "
                             "dimensions of a 2-D DeviceMesh: (mesh, 'ulysses') and (mesh, 'ring'))")
    if method == "hybrid":
        upg, rpg = _comm.resolve(ulysses_group, "ulysses_group"), _comm.resolve(ring_group, "ring_group")
    else:
        upg = rpg = _comm.resolve(group)
    _, u_world = _comm.rank_world(upg)
    if method in ("ulysses", "hybrid") and h % u_world:
        raise FlashAttnError(
            f"q has {h} heads; method={method!r} scatters heads over the {u_world} ranks of the "
            f"{'ulysses_group' if method == 'hybrid' else 'group'}, so nheads must be a multiple of {u_world}"
        )
    if check_shards:
        fields = _fields(q, k, v, method=_checks.METHODS.index(method), layout=LAYOUTS.index(layout),
                         causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
                         softmax_scale=scale, alibi=-1 if alibi_slopes is None else alibi_slopes.dim(),
                         sink=learnable_sink is not None, deterministic=deterministic)
        for pg in {id(upg): upg, id(rpg): rpg}.values():
            _comm.check_same(pg, fields, q.device)
    ring_kw = dict(causal=causal, scale=scale, window=window, softcap=softcap, deterministic=deterministic)
    if method == "ring":
        out, lse = _ring(q, k, v, rpg, layout=layout, alibi_slopes=alibi_slopes,
                         learnable_sink=learnable_sink, stats=stats, **ring_kw)
        return (out, lse) if return_lse else out
    u_rank, _ = _comm.rank_world(upg)
    if method == "ulysses":
        def inner(qh, kh, vh, slopes, sink):
            return _local.attention(qh, kh, vh, softmax_scale=scale, causal=causal, window_size=window,
                                    softcap=softcap, alibi_slopes=slopes, learnable_sink=sink,
                                    deterministic=deterministic)
        seq_layout = layout
    else:
        def inner(qh, kh, vh, slopes, sink):
            return _ring(qh, kh, vh, rpg, layout=layout, alibi_slopes=slopes, learnable_sink=sink,
                         stats=stats, **ring_kw)
        seq_layout = "contiguous"  # within the ring shard, the Ulysses ranks hold contiguous parts
    out, lse = ulysses(q, k, v, upg, u_world, u_rank, layout=seq_layout, inner=inner,
                       alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, return_lse=return_lse)
    return (out, lse) if return_lse else out


@torch.compiler.disable  # the ring, and a schedule read from cu_seqlens on the host
def context_parallel_attn_varlen(q, k, v, cu_seqlens, max_seqlen: int, group=None, *, causal: bool = False,
                                 softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0,
                                 alibi_slopes=None, learnable_sink=None, deterministic: bool = False,
                                 return_lse: bool = False, check_shards: bool = True,
                                 stats: RingStats | None = None):
    """Exact attention of packed documents sharded over a group (ring; every document cut zigzag-wise).

    Equals ``flashattn.flash_attn_varlen_func`` on the unsharded tokens with ``cu_seqlens_q = cu_seqlens_k
    = cu_seqlens``, returned in this rank's local layout (:func:`shard_varlen`).

    Args:
        q: ``(total_local, nheads, headdim)``: this rank's tokens as :func:`shard_varlen` returned them.
        k: ``(total_local, nheads_k, headdim)``; v: ``(total_local, nheads_k, headdim_v)``.
        cu_seqlens: int32 ``(ndocs + 1,)``, the *global* document boundaries, the same on every rank (read on
            the host: pass a CPU tensor to avoid a device sync). Documents of any length, 0 included.
        max_seqlen: int, the longest document (at least every length).
        group: as :func:`context_parallel_attn`.
        causal, softmax_scale, window_size, softcap, learnable_sink, deterministic, return_lse, check_shards,
            stats: as :func:`context_parallel_attn`; masks and ALiBi use positions within each document.
        alibi_slopes: None or float32 ``(nheads,)`` / ``(ndocs, nheads)`` (row b for document b).

    Returns:
        out: ``(total_local, nheads, headdim_v)``, q's dtype, in q's local layout.
        lse (if return_lse): float32 ``(nheads, total_local)``; +inf for rows that see no key.
    """
    _checks.qkv(q, k, v, varlen=True)
    scale = _checks.scale(softmax_scale, q.shape[-1])
    window = _checks.window(window_size)
    softcap = _checks.softcap(softcap)
    pg = _comm.resolve(group)
    rank, world = _comm.rank_world(pg)
    cu = _host_cu(cu_seqlens)
    ndocs, h = cu.numel() - 1, q.shape[1]
    _checks.per_head("alibi_slopes", alibi_slopes, h, ndocs, q.device)
    _checks.per_head("learnable_sink", learnable_sink, h, None, q.device)
    longest = int((cu[1:] - cu[:-1]).max())
    if int(max_seqlen) < longest:
        raise FlashAttnError(
            f"max_seqlen={max_seqlen} but the longest document of cu_seqlens has {longest} tokens"
        )
    perm = _plan_varlen.piece_major_index(cu, world, rank)
    if perm.numel() != q.shape[0]:
        raise FlashAttnError(f"q has {q.shape[0]} tokens but this rank's shard of cu_seqlens holds "
                             f"{perm.numel()}; pass the global cu_seqlens and the tokens shard_varlen "
                             "returned")
    if check_shards:
        digest = int((cu * torch.arange(1, cu.numel() + 1)).sum() % (1 << 61))
        fields = _fields(q, k, v, ndocs=ndocs, cu_seqlens_digest=digest, causal=causal, window_left=window[0],
                         window_right=window[1], softcap=softcap, softmax_scale=scale,
                         alibi=-1 if alibi_slopes is None else alibi_slopes.dim(),
                         sink=learnable_sink is not None, deterministic=deterministic)
        fields.pop("seqlen_q_local")  # local token counts differ from rank to rank in varlen
        fields.pop("seqlen_k_local")
        _comm.check_same(pg, fields, q.device)
    left, right = window_bounds(causal, window)
    needed, tasks_of = _plan_varlen.plan(cu, world, rank, left, right, alibi_slopes is not None, q.device)
    sched = Schedule(needed, world, tasks_of)
    opts = Options(scale, softcap, alibi_slopes, deterministic, 0, left, right)
    _describe(stats, sched)
    perm_d = perm.to(q.device)
    inverse = torch.argsort(perm).to(q.device)
    qp, kp, vp = (x.index_select(0, perm_d) for x in (q, k, v))
    # K/V travel: every rank's buffer is padded to the longest rank's (the tasks never select the padding)
    longest_local = _plan_varlen.longest_shard(cu, world)
    if longest_local > kp.shape[0]:
        kp, vp = (torch.cat((x, x.new_zeros((longest_local - x.shape[0], *x.shape[1:])))) for x in (kp, vp))
    out, lse = RingAttention.apply(qp, kp, vp, learnable_sink,
                                   (sched, _comm.Ring(pg), opts, stats))
    out = out.index_select(0, inverse)
    return (out, lse.index_select(1, inverse)) if return_lse else out
