"""The Gluon backward for wide heads (Q and K 129..256 columns): FlashAttention-3's partition for d = 256.

attn_bwd.py gives each consumer warpgroup 64 keys and every column of their dK and dV: at d = 256 those two
accumulators alone are 256 registers a thread, more than a thread has. Here a program owns 64 keys, both
warpgroups see all of them, and they split each step's work two ways:
  - by query rows for the scores: each warpgroup computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the 64 keys and its
    32 of the step's 64 query rows (a wgmma N of 32), recomputes its part of Pᵀ and dSᵀ, and writes it into
    the step's P and dS tiles in shared memory (rows: queries);
  - by columns for the gradients: once both parts are there (an mbarrier), each warpgroup adds its columns
    of dV += Pᵀ dO and dK += dSᵀ Q and computes its columns of dQ = dS K, every operand from shared memory.
    The columns go in 64-wide units so that both warpgroups issue the same matrix work (`_consumer`'s
    K0 / KW, V0 / VW, Q0 / QW): at d = dv = 256, 128 of each; at d 192 / dv 128, dK 128 + dV 64 + dQ 64
    against 64 + 64 + 128 (the second warpgroup's second dQ unit, issued after dK and dV, then staged, is
    what it does beyond the first's).
Per thread: dK and dV 64 registers each at d = 256, dQ 64 while it is in flight, Sᵀ and dPᵀ 16 each.
dQ leaves as attn_bwd.py's does, by TMA reduce-adds into a float32 buffer, one 64-column unit at a time
through a staging tile; dK and dV, staged in K's and V's tiles once no one reads those, by TMA stores.
Shared memory at d = dv = 256: two Q stages and one dO stage (FA3's choice too), K, V, the P and dS tiles
of two steps (a warpgroup may write step c + 1's while the other still reads step c's), the dQ staging:
225 KB of the 227.

The options are the compile-time variants of attn_bwd.py, with the same code for the scores (scores.py):
windows alone or with causal at any seqlen_q and seqlen_k (`key_tile` visits only the query tiles that
see the key tile), softcap, ALiBi, learnable sinks, the packed (varlen) layout, GQA (SPLIT programs per
key tile adding dK and dV into float32 buffers), and DETERMINISTIC (attn_bwd.py's fixed order, LOCK): the
warpgroups stage each step's dQ units in two rounds through their staging tiles for a dQ-writer warp
(`_dq_writer`), which adds them once the programs before it in the order have added theirs into that query
tile. Q and K are read through tiles HEAD_DIM (256) wide, the columns past the
head dim read as zeros, and only D_QK of them (192 or 256: the head dim rounded up to 64-column units)
enter a product.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from flashattn.kernels.gluon.attn_bwd import dtanh, sink_step
from flashattn.kernels.gluon.bwd_dq import (
    count_in,
    count_slot,
    reduce_add,
    wait_count,
    warp_lanes,
    writer_tile,
)
from flashattn.kernels.gluon.bwd_tiles import (
    add_key_tile,
    key_sequence,
    key_tile,
    part_heads,
    program_sequence,
    step_rows,
)
from flashattn.kernels.gluon.schedule import publish_tile, store_rows
from flashattn.kernels.gluon.scores import transposed_probs

ROWS = gl.constexpr(32)  # query rows of a step per warpgroup (the scores' wgmma N)
UNIT = gl.constexpr(64)  # columns of a dQ staging tile and reduce-add
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _loader(args, STAGES: gl.constexpr, DO_STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    """K and V once, then per step Q with its rows' stats (a ring of STAGES) and dO (a ring of DO_STAGES)."""
    descs, smems, bars, problem = args[0], args[1], args[2], args[3]
    q_desc, do_desc, k_desc, v_desc, stats_desc = descs
    q_smem, do_smem, k_smem, v_smem, stats_smem, seq_smem = smems
    kv_bar, q_ready, q_empty, do_ready, do_empty, seq_ready = bars
    nheads_k = problem[0]
    varlen: gl.constexpr = problem[7] is not None
    b = 0
    if varlen:
        t, b = key_sequence(problem, SPLIT)
        publish_tile(seq_smem, seq_ready, 0, t, b)
    # DETERMINISTIC's launch order: each head's key tiles last first under a right edge (causal included)
    reverse: gl.constexpr = args[16][0] is not None and (CAUSAL or problem[6] is not None)
    off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, _, _ = key_tile(
        problem, b, BLOCK_M, BLOCK_N, CAUSAL, SPLIT, reverse)
    HEADS: gl.constexpr = GROUP // SPLIT
    head0 = off_hk * GROUP + part * HEADS
    desc_b = 0 if varlen else off_b  # varlen: the packed tensors' descriptors have one batch
    stats_row0 = 0
    if varlen:
        stats_row0 = 4 * gl.load(problem[10] + off_b)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [desc_b, k_start + start_n, off_hk, 0], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [desc_b, k_start + start_n, off_hk, 0], kv_bar, v_smem.index(0))
    c = 0
    for g in range(HEADS):
        off_h = head0 + g
        for mi in range(n_m):
            m0 = m_first + mi * BLOCK_M
            s = c % STAGES
            # a fresh mbarrier counts as having completed the phase before 0, so the first pass does not wait
            mbarrier.wait(q_empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [desc_b, q_start + m0, off_h, 0], q_ready.index(s),
                                            q_smem.index(s))
            plane = desc_b * nheads_k * GROUP + off_h
            tma.async_copy_global_to_shared(stats_desc, [0, plane, stats_row0 + m0], q_ready.index(s),
                                            stats_smem.index(s))
            t = c % DO_STAGES
            mbarrier.wait(do_empty.index(t), ((c // DO_STAGES) & 1) ^ 1)
            mbarrier.expect(do_ready.index(t), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [desc_b, q_start + m0, off_h, 0], do_ready.index(t),
                                            do_smem.index(t))
            c += 1


@gluon.jit
def _scores(k, q_rows, D_QK: gl.constexpr, zero):
    """Sᵀ = K Qᵀ over the first D_QK columns (192: a 128- and a 64-column product; the rest are padding)."""
    if D_QK == 256:
        st = warpgroup_mma(k, q_rows.permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        st = warpgroup_mma(k.slice(0, 128, dim=1), q_rows.slice(0, 128, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        st = warpgroup_mma(k.slice(128, D_QK - 128, dim=1),
                           q_rows.slice(128, D_QK - 128, dim=1).permute((1, 0)), st, is_async=True)
    return st


@gluon.jit
def _stage_dq(dq, dq_buf, dq_desc, coord, sm_scale, handoff, u, ROUND: gl.constexpr):
    """One 64-column unit of dQ through this warpgroup's staging tile, reduce-added at coord.
    DETERMINISTIC (handoff: (the rounds' dq_full, this tile's dq_empty)): staged for the dQ writer
    instead, in the step's round ROUND (each warpgroup's first unit in round 0, its second in round 1), as
    the tile's use u, once the writer has read use u - 1."""
    if handoff is not None:
        # a fresh mbarrier counts as having completed the phase before 0, so the first use does not wait
        mbarrier.wait(handoff[1], (u & 1) ^ 1)
    else:
        tma.store_wait(0)  # the previous reduce-add has read the staging tile
    dq_buf.reshape([dq.shape[0], UNIT]).store(dq * sm_scale)
    fence_async_shared()
    if handoff is not None:
        mbarrier.arrive(handoff[0].index(ROUND), count=1)
    else:
        reduce_add(dq_desc, coord, dq_buf)


@gluon.jit
def _tile(smem, i):
    """Tile i of a ring of TMA tiles (stages, batch, rows, head, cols) as a (rows, cols) operand."""
    return smem.index(i).reshape([smem.shape[2], smem.shape[4]])


@gluon.jit
def _issue_scores(c, q_smem, k_smem, q_ready, STAGES: gl.constexpr, D_QK: gl.constexpr, WG: gl.constexpr,
                  s_zero):
    """Step c's Sᵀ = K Qᵀ over this warpgroup's rows, issued once the step's Q stage is in. K through a
    view indexed by c >> 30 (0, which the compiler cannot know): left loop-invariant, the wgmma descriptors
    of its 16-column steps were hoisted out of the loop and spilled (64 registers at d = 256)."""
    s = c % STAGES
    mbarrier.wait(q_ready.index(s), (c // STAGES) & 1)
    return _scores(_tile(k_smem, c >> 30), _tile(q_smem, s).slice(WG * ROWS, ROWS, dim=0), D_QK, s_zero)


@gluon.jit
def _issue_dp(c, do_smem, v_smem, do_ready, DO_STAGES: gl.constexpr, WG: gl.constexpr, s_zero):
    """Step c's dPᵀ = V dOᵀ over this warpgroup's rows, issued once the step's dO stage is in."""
    t = c % DO_STAGES
    mbarrier.wait(do_ready.index(t), (c // DO_STAGES) & 1)
    do = _tile(do_smem, t).slice(WG * ROWS, ROWS, dim=0)
    return warpgroup_mma(_tile(v_smem, c >> 30), do.permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _probs_ds(st, dpt, c, sink_acc, rows, band, diag_r, diag_l, scales, sink, STAGES: gl.constexpr,
              BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, WG: gl.constexpr,
              s_layout: gl.constexpr, HEADS: gl.constexpr):
    """Step c's Pᵀ and dSᵀ (keys × this warpgroup's rows, float32) from its finished Sᵀ and dPᵀ, and the
    sink's gradient summed over them. diag_r, diag_l: the band's edges (None where unbounded)."""
    stats_rows, _, _, _, off_b = rows
    offs_k, key0, key_tail, seqlen_q, seqlen_k, diag = band
    qk_scale, _, cap_in, cap_out, ALIBI, stride_alibi_b = scales
    SINK, DSINK = sink
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a vector along Sᵀ's columns (the query rows)
    off_h, m0, head_done = step_rows(c, rows[1], rows[2], rows[3], BLOCK_M, HEADS)
    row0 = m0 + WG * ROWS  # this warpgroup's first query row
    offs_q = row0 + gl.arange(0, ROWS, layout=row_layout)
    slope = None
    if ALIBI is not None:
        slope = gl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
    s = c % STAGES
    lse_row = stats_rows.index(2 * s).slice(WG * ROWS, ROWS)
    lse = lse_row.load(row_layout)
    inside = None
    if VARLEN:
        # rows past the sequence's end count as rows that saw no key, and D 0 (attn_bwd.py)
        inside = offs_q < seqlen_q
        lse = gl.where(inside, lse, float("inf"))
    pt, lse = transposed_probs(st, lse, offs_k, offs_q, key0, row0, key_tail, seqlen_k, qk_scale, cap_in,
                               cap_out, slope, diag, diag_r, diag_l, CAUSAL)
    if SINK is not None:  # this warpgroup's rows' share
        sink_acc = sink_step(sink_acc, pt, dpt, lse_row.load(row_layout), inside, SINK, DSINK, off_h,
                             head_done, s_layout)
    delta = stats_rows.index(2 * s + 1).slice(WG * ROWS, ROWS).load(row_layout)
    if VARLEN:
        delta = gl.where(inside, delta, 0.0)
    dst = pt * (dpt - delta[None, :])
    if cap_in is not None:
        dst = dst * dtanh(pt, lse_row.load(row_layout), cap_out, slope, offs_q, offs_k, diag)
    return pt, dst, sink_acc


@gluon.jit
def _share_pds(pt, dst, c, p_smem, ds_smem, pds_ready, WG: gl.constexpr):
    """This warpgroup's rows of step c's P and dS (rows: queries) into the step's buffers, then wait for the
    other's. Two buffers: a warpgroup reaches step c + 2's writes only after the other arrived at step
    c + 1's barrier, which it does once its step-c products (the readers of buffer c % 2) are done."""
    b = c % 2
    dtype: gl.constexpr = p_smem.dtype
    p_smem.index(b).slice(WG * ROWS, ROWS, dim=0).store(gl.permute(pt.to(dtype), (1, 0)))
    ds_smem.index(b).slice(WG * ROWS, ROWS, dim=0).store(gl.permute(dst.to(dtype), (1, 0)))
    fence_async_shared()
    mbarrier.arrive(pds_ready.index(b), count=1)
    mbarrier.wait(pds_ready.index(b), (c // 2) & 1)


@gluon.jit
def _issue_grads(c, dk, dv, k, p_smem, ds_smem, q_smem, do_smem, STAGES: gl.constexpr,
                 DO_STAGES: gl.constexpr, K0: gl.constexpr, KW: gl.constexpr, V0: gl.constexpr,
                 VW: gl.constexpr, Q0: gl.constexpr, q_zero):
    """Step c's products on this warpgroup's columns: dQ's first unit (first, so that it can leave while
    dV and dK are multiplied), dV += Pᵀ dO and dK += dSᵀ Q."""
    ds_buf = ds_smem.index(c % 2)
    dq = warpgroup_mma(ds_buf, k.slice(Q0, UNIT, dim=1), q_zero, use_acc=False, is_async=True)
    do = _tile(do_smem, c % DO_STAGES)
    dv = warpgroup_mma(p_smem.index(c % 2).permute((1, 0)), do.slice(V0, VW, dim=1), dv, is_async=True)
    dk = warpgroup_mma(ds_buf.permute((1, 0)), _tile(q_smem, c % STAGES).slice(K0, KW, dim=1), dk,
                       is_async=True)
    return dq, dk, dv


@gluon.jit
def _finish_grads(c, dq, dk, dv, k, ds_smem, dq_buf, dq_desc, coord, q_empty, do_empty, sm_scale, handoff,
                  STAGES: gl.constexpr, DO_STAGES: gl.constexpr, Q0: gl.constexpr, QW: gl.constexpr,
                  q_zero):
    """Step c's dQ units reduce-added, or staged for the dQ writer (handoff; `_stage_dq`) (a second unit,
    QW = 128, issued once the first is staged: both in flight beside dK and dV spilled, 64 registers more),
    dK and dV waited for, and the step's Q and dO stages released. coord: the dQ tile's coordinates but its
    first column."""
    dq = warpgroup_mma_wait(2, deps=(dq,))
    _stage_dq(dq, dq_buf, dq_desc, [coord[0], coord[1], coord[2], Q0], sm_scale, handoff, c * (QW // UNIT),
              0)
    if QW == 128:
        dq = warpgroup_mma(ds_smem.index(c % 2), k.slice(Q0 + UNIT, UNIT, dim=1), q_zero, use_acc=False,
                           is_async=True)
        dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        _stage_dq(dq, dq_buf, dq_desc, [coord[0], coord[1], coord[2], Q0 + UNIT], sm_scale, handoff,
                  2 * c + 1, 1)
    else:
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    # this step's Q and dO have no reader left in this warpgroup
    mbarrier.arrive(q_empty.index(c % STAGES), count=1)
    mbarrier.arrive(do_empty.index(c % DO_STAGES), count=1)
    return warpgroup_mma_init(dk), warpgroup_mma_init(dv)


@gluon.jit
def _consumer(args, STAGES: gl.constexpr, DO_STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
              D_QK: gl.constexpr, WG: gl.constexpr):
    (_, smems, bars, problem, dk_desc, dv_desc, dq_desc, p_smem, ds_smem, dq_smem, pds_ready, done, scales,
     kv_rows, kv_acc, sink, det, widths) = args
    handoff = None
    if det[0] is not None:
        handoff = (det[2], det[3].index(WG))
    q_smem, do_smem, k_smem, v_smem, stats_smem, seq_smem = smems
    kv_bar, q_ready, q_empty, do_ready, do_empty, seq_ready = bars
    sm_scale = scales[1]
    d_qk, d_v = widths
    left = problem[5]
    right = problem[6]
    varlen: gl.constexpr = problem[7] is not None
    reverse: gl.constexpr = det[0] is not None and (CAUSAL or right is not None)  # the loader's order
    off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, seqlen_q, seqlen_k = key_tile(
        problem, program_sequence(seq_smem, seq_ready, varlen), BLOCK_M, BLOCK_N, CAUSAL, SPLIT, reverse)
    HEADS: gl.constexpr = GROUP // SPLIT
    head0 = off_hk * GROUP + part * HEADS
    desc_b = 0 if varlen else off_b
    dtype: gl.constexpr = q_smem.dtype
    HEAD_DIM: gl.constexpr = q_smem.shape[-1]
    DV: gl.constexpr = do_smem.shape[-1]
    # this warpgroup's columns: dK's [K0, K0 + KW), dV's [V0, V0 + VW), dQ's [Q0, Q0 + QW); at D_QK = 192
    # the first warpgroup takes more of dK and the second more of dQ
    KW: gl.constexpr = 128 if (D_QK == 256 or WG == 0) else 64
    QW: gl.constexpr = 128 if (D_QK == 256 or WG == 1) else 64
    K0: gl.constexpr = WG * 128
    Q0: gl.constexpr = WG * (D_QK - QW)
    VW: gl.constexpr = DV // 2
    V0: gl.constexpr = WG * VW
    # Sᵀ, dPᵀ: (keys, this warpgroup's query rows); dK, dV: (keys, its columns); dQ: (query rows, 64)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, ROWS, 16])
    k_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, KW, 16])
    v_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, VW, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, UNIT, 16])
    diag = seqlen_k - seqlen_q
    diag_r = None  # the band's edges (scores.py), None where unbounded; CAUSAL's right edge is the diagonal
    if CAUSAL:
        diag_r = diag
    elif right is not None:
        diag_r = diag + right
    diag_l = None
    if left is not None:
        diag_l = diag - left
    key0 = start_n
    offs_k = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    key_tail = key0 + BLOCK_N > seqlen_k
    s_zero = gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout)
    q_zero = gl.zeros([BLOCK_M, UNIT], gl.float32, q_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, KW], gl.float32, k_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, VW], gl.float32, v_layout))
    k = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
    v = v_smem.index(0).reshape([BLOCK_N, DV])
    dq_buf = dq_smem.index(WG)
    mbarrier.wait(kv_bar, 0)
    n_steps = HEADS * n_m
    # the stats tiles as rows: 2s is stage s's LSE (base 2), 2s + 1 its D (attn_bwd.py's reinterpretation)
    stats_rows = stats_smem._reinterpret(gl.float32, [2 * STAGES, BLOCK_M],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    rows = (stats_rows, gl.maximum(n_m, 1), head0, m_first, off_b)
    band = (offs_k, key0, key_tail, seqlen_q, seqlen_k, diag)
    sink_acc = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, s_layout))
    # Each step in order: its scores, Pᵀ and dSᵀ, the hand-off, its products. Issuing step c + 1's Sᵀ and
    # dPᵀ ahead of step c's products (its Pᵀ and dSᵀ computed under them) made the d 192 / dv 128 backward
    # take 30% longer on the H100 (tuning-log v59)
    for c in range(n_steps):
        st = _issue_scores(c, q_smem, k_smem, q_ready, STAGES, D_QK, WG, s_zero)
        dpt = _issue_dp(c, do_smem, v_smem, do_ready, DO_STAGES, WG, s_zero)
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        pt, dst, sink_acc = _probs_ds(st, dpt, c, sink_acc, rows, band, diag_r, diag_l, scales, sink,
                                      STAGES, BLOCK_M, CAUSAL, varlen, WG, s_layout, HEADS)
        off_h, m0, _last = step_rows(c, rows[1], rows[2], rows[3], BLOCK_M, HEADS)
        _share_pds(pt, dst, c, p_smem, ds_smem, pds_ready, WG)
        dq, dk, dv = _issue_grads(c, dk, dv, k, p_smem, ds_smem, q_smem, do_smem, STAGES, DO_STAGES,
                                  K0, KW, V0, VW, Q0, q_zero)
        dk, dv = _finish_grads(c, dq, dk, dv, k, ds_smem, dq_buf, dq_desc, (desc_b, q_start + m0, off_h),
                               q_empty, do_empty, sm_scale, handoff, STAGES, DO_STAGES, Q0, QW, q_zero)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))

    # K and V are no longer read once both warpgroups are done: their tiles stage dK and dV
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    if SPLIT > 1:
        if start_n < seqlen_k:  # past the varlen list: nothing
            DK_ACC, DV_ACC = kv_acc
            key_row0 = off_b.to(gl.int64) * seqlen_k
            if varlen:
                key_row0 = k_start.to(gl.int64)
            head_k, heads_k = part_heads(off_hk, part, problem[0], SPLIT, det[0])
            first = (key_row0, key0, seqlen_k, head_k, heads_k)
            add_key_tile(DK_ACC, dk * sm_scale, first, d_qk, K0, k_layout)
            add_key_tile(DV_ACC, dv, first, d_v, V0, v_layout)
    else:
        dk_tile = k.slice(K0, KW, dim=1)
        dv_tile = v.slice(V0, VW, dim=1)
        dk_tile.store((dk * sm_scale).to(dtype))
        dv_tile.store(dv.to(dtype))
        if varlen and key0 + BLOCK_N > seqlen_k:
            if start_n < seqlen_k:
                # the sequence ends inside the key tile, and a TMA store would write the next sequence's:
                # this warpgroup's columns of the keys inside by masked stores
                DK, DV_, stride_km, stride_kh, stride_vm, stride_vh = kv_rows
                n = seqlen_k - key0
                store_rows(dk_tile, DK + K0, k_start + key0, n, off_hk, stride_km, stride_kh, d_qk - K0)
                store_rows(dv_tile, DV_ + V0, k_start + key0, n, off_hk, stride_vm, stride_vh, d_v - V0)
        else:
            # both warpgroups' columns staged, then one TMA store each: dK from the first, dV from the second
            fence_async_shared()
            mbarrier.arrive(done, count=1)
            mbarrier.wait(done, 1)
            key = k_start + key0
            if WG == 0:
                tma.async_copy_shared_to_global(dk_desc, [desc_b, key, off_hk, 0], k_smem.index(0))
            else:
                tma.async_copy_shared_to_global(dv_desc, [desc_b, key, off_hk, 0], v_smem.index(0))
    tma.store_wait(0)


@gluon.jit
def _consumer0(args, STAGES: gl.constexpr, DO_STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
               D_QK: gl.constexpr):
    _consumer(args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK, 1)


@gluon.jit
def _consumer1(args, STAGES: gl.constexpr, DO_STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
               D_QK: gl.constexpr):
    _consumer(args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK, 0)


@gluon.jit
def _dq_writer(args, STAGES: gl.constexpr, DO_STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
               D_QK: gl.constexpr):
    """DETERMINISTIC: each step's dQ units, staged by the warpgroups in two rounds through their one tile
    each (`_stage_dq`), reduce-added in the fixed order across programs (bwd_dq.dq_writer's, per 64-row
    step): wait for the programs before this one at the step's query tile, add round 0's units (both
    warpgroups' first), then round 1's (the second of each warpgroup that has one: both at D_QK 256,
    warpgroup 1's only at 192), release the tiles read after each round, count in."""
    dq_desc = args[6]
    dq_smem = args[9]
    seq_smem = args[1][5]
    seq_ready = args[2][5]
    problem = args[3]
    det = args[16]
    dq_full = det[2]
    dq_empty = det[3]
    left = problem[5]
    right = problem[6]
    off_b, head0, desc_b, m_first, n_m, q_start, n, n_last, diag = writer_tile(
        problem, seq_smem, seq_ready, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT)
    HEADS: gl.constexpr = GROUP // SPLIT
    lanes = warp_lanes()
    # tile w is the warpgroup w's (_consumer0 runs warpgroup 1); its first dQ column, as `_consumer`'s Q0
    col0 = 0
    col1 = 128 if D_QK == 256 else 64
    steps_per_head = gl.maximum(n_m, 1)
    for c in range(HEADS * n_m):
        g = c // steps_per_head
        off_h = head0 + g
        m0 = m_first + (c - g * steps_per_head) * BLOCK_M
        counter, before = count_slot(det, off_b, off_h, q_start, m0, BLOCK_M, n, n_last, diag, left, right,
                                     BLOCK_N, CAUSAL)
        wait_count(counter, before, lanes)  # while the consumers compute the step
        for r in gl.static_range(2):
            mbarrier.wait(dq_full.index(r), c & 1)
            if r == 0 or D_QK == 256:
                reduce_add(dq_desc, [desc_b, q_start + m0, off_h, col0 + r * UNIT], dq_smem.index(0))
            reduce_add(dq_desc, [desc_b, q_start + m0, off_h, col1 + r * UNIT], dq_smem.index(1))
            tma.store_wait(0)  # the staging tiles read: the warpgroups may write the next units
            if r == 0 or D_QK == 256:
                mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)
        count_in(counter, lanes)


@gluon.jit
def attn_bwd_dsplit_kernel(
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, stats_desc, nheads_k, seqlen_q, seqlen_k,
    qk_scale, sm_scale, n_bhk, lpt_group, left, right, cap_in, cap_out, d_qk, d_v, ALIBI, stride_alibi_b,
    CU_Q, CU_K, PLAN, STATS_ROW0, DK, DV, stride_km, stride_kh, stride_vm, stride_vh, DK_ACC, DV_ACC, SINK,
    DSINK, LOCK, stride_lock_b, stride_lock_h,
    GROUP: gl.constexpr, D_QK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, DO_STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr = 1,
):
    # the arguments of attn_bwd.py's kernel, and d_qk / d_v: the head dims (the columns dK and dV have; Q's
    # and K's descriptors are 256 wide, V's and dO's DV); D_QK: d_qk rounded up to 192 or 256; stride_vm,
    # stride_vh: DV's row and head strides (varlen; dv may differ from d). LOCK (DETERMINISTIC): as
    # attn_bwd.py's; its dQ writer takes each step's units in two rounds from the warpgroups' staging tiles
    gl.static_assert(LOCK is None or SINK is None)
    gl.static_assert(BLOCK_M == 2 * ROWS)
    gl.static_assert((D_QK == 192 or D_QK == 256) and D_QK <= q_desc.block_type.shape[3])
    gl.static_assert(GROUP % SPLIT == 0)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [DO_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    # P and dS of two steps, (query rows, keys)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    seq_smem = gl.allocate_shared_memory(gl.int32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    seq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if CU_Q is not None:
        mbarrier.init(seq_ready.index(0), count=1)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # released by both consumer warpgroups
    for i in gl.static_range(DO_STAGES):
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(pds_ready.index(i), count=2)
    # DETERMINISTIC: a round's staged units (count: the warpgroups with a unit in it), and each staging
    # tile's release (one per use: a warpgroup waits only for its own tile's previous use)
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if LOCK is not None:
        mbarrier.init(dq_full.index(0), count=2)
        mbarrier.init(dq_full.index(1), count=2 if D_QK == 256 else 1)
        for i in gl.static_range(2):
            mbarrier.init(dq_empty.index(i), count=1)
    problem = (nheads_k, seqlen_q, seqlen_k, n_bhk, lpt_group, left, right, CU_Q, CU_K, PLAN, STATS_ROW0)
    smems = (q_smem, do_smem, k_smem, v_smem, stats_smem, seq_smem)
    bars = (kv_bar, q_ready, q_empty, do_ready, do_empty, seq_ready)
    args = ((q_desc, do_desc, k_desc, v_desc, stats_desc), smems, bars, problem, dk_desc, dv_desc, dq_desc,
            p_smem, ds_smem, dq_smem, pds_ready, done, (qk_scale, sm_scale, cap_in, cap_out, ALIBI,
                                                         stride_alibi_b),
            (DK, DV, stride_km, stride_kh, stride_vm, stride_vh), (DK_ACC, DV_ACC), (SINK, DSINK),
            (LOCK, (stride_lock_b, stride_lock_h), dq_full, dq_empty), (d_qk, d_v))
    # registers: as attn_bwd.py's, 240 per consumer thread and 24 for the loader's (and the dQ writer's)
    if LOCK is not None:
        gl.warp_specialize([
            (_consumer0, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK)),
            (_consumer1, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK)),
            (_loader, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT)),
            (_dq_writer, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK)),
        ], [4, 1, 1], [240, 24, 24])
    else:
        gl.warp_specialize([
            (_consumer0, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK)),
            (_consumer1, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, D_QK)),
            (_loader, (args, STAGES, DO_STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT)),
        ], [4, 1], [240, 24])
