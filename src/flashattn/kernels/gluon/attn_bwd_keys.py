"""The Gluon backward for d_qk 129..192 beside d_v up to 128 on 128 keys a program (the DeepSeek prefill
shape's), attn_bwd.py's partition over 32-row steps.

attn_bwd_dsplit.py serves these head dims on 64 keys a program (its warpgroups split each step's columns):
every query tile's dQ is reduce-added once per 64 keys. Here, as in attn_bwd.py, each consumer warpgroup owns
64 of the program's 128 keys and every column of their dK and dV: dK as a 128- and a 64-column accumulator
(96 registers a thread) and dV (64). What makes that fit is the step: 32 query rows, so that Sᵀ and dPᵀ
(64 keys × 32 rows, a wgmma N of 32) take 16 registers each. Per step each warpgroup
  - computes Sᵀ = K Qᵀ over the 192 columns (a 128- and a 64-column product) and dPᵀ = V dOᵀ, recomputes
    Pᵀ and dSᵀ, and adds dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ and dSᵀ from registers (wgmma K = 32);
  - writes dS (rows: queries) for its 64 keys into the step's buffer, and once the other warpgroup's half is
    there (an mbarrier), computes dQ transposed, dQᵀ = Kᵀ dSᵀ over all 128 keys, for its 64-column units
    (the first warpgroup units 0 and 1, the second unit 2: M = 64 columns, N = 32 rows, 16 registers a
    unit), each reduce-added into the float32 buffer through a staging tile, transposed back. Two staging
    tiles per warpgroup, used in turn: a unit's store waits only for the reduce-add before the latest to
    have read its tile, so the first warpgroup's second unit does not wait on its first (H100, d 192 / d_v
    128 causal: 434 TFLOP/s against one tile's 423, and against 365 with dQ split by rows instead).
Q and K go through 256-wide tiles (TMA reads zeros past d), of which the products take the first 192
columns; dO and V through 128. The options are attn_bwd.py's compile-time variants (scores.py's band,
softcap, ALiBi; the sink's gradient; varlen; the GQA group split) and DETERMINISTIC: each step's three
dQ units staged in tiles of their own (two sets, steps in turn) for attn_bwd.py's dQ writer warp, which
adds them in the fixed order across programs, kept per 64 rows: two of these 32-row steps a count wait and
a count-in (bwd_dq.dq_writer). The loader is attn_bwd.py's. Which calls come here is the routes'
choice (routes.GluonBackward.wide_keys).
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

from flashattn.kernels.gluon.attn_bwd import HALF_N, _loader, dtanh, sink_step
from flashattn.kernels.gluon.bwd_dq import dq_writer, reduce_add
from flashattn.kernels.gluon.bwd_tiles import (
    add_key_tile,
    key_tile,
    part_heads,
    program_sequence,
    step_rows,
    store_key_tiles,
)
from flashattn.kernels.gluon.scores import transposed_probs

UNIT = gl.constexpr(64)  # dQ's columns per transposed product and reduce-add
DQ_TILES = gl.constexpr(2)  # dQ's staging tiles per warpgroup
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _stage(dqt, dq_buf, dq_desc, coord, sm_scale, PENDING: gl.constexpr, handoff, WAIT: gl.constexpr):
    """Scale dQᵀ's unit (64 columns x its rows), and reduce-add it, transposed back, at coord through dq_buf.
    The reduce-adds complete in order and a warpgroup takes its staging tiles in turn: once all but the
    latest PENDING have read theirs, the one that last used dq_buf has. DETERMINISTIC (handoff: (dq_empty,
    its phase)): stage it only, for the dQ writer (bwd_dq.dq_writer), first (WAIT: the step's first unit)
    waiting for the writer to have read the previous step's tiles."""
    if handoff is not None:
        if WAIT:
            mbarrier.wait(handoff[0], handoff[1])
    else:
        tma.store_wait(PENDING)
    dq_buf.reshape([dqt.shape[1], UNIT]).store(gl.permute(dqt * sm_scale, (1, 0)))
    fence_async_shared()
    if handoff is None:
        reduce_add(dq_desc, coord, dq_buf)


@gluon.jit
def _dq_unit(COL0: gl.constexpr, k_halves, ds_smem, b, dq_zero, dq_buf, dq_desc, coord, sm_scale, in_flight,
             handoff, WAIT: gl.constexpr):
    """dQᵀ's columns [COL0, COL0 + 64) for the step's rows over both halves' keys, its dS in buffer b,
    reduce-added at coord through dq_buf, one of the warpgroup's DQ_TILES staging tiles, used in turn
    (handoff, WAIT: `_stage`'s); returns in_flight, the step's dK and dV, done."""
    dqt = warpgroup_mma(k_halves[0].slice(COL0, UNIT, dim=1).permute((1, 0)),
                        ds_smem.index(2 * b).permute((1, 0)), dq_zero, use_acc=False, is_async=True)
    dqt = warpgroup_mma(k_halves[1].slice(COL0, UNIT, dim=1).permute((1, 0)),
                        ds_smem.index(2 * b + 1).permute((1, 0)), dqt, is_async=True)
    dka, dkb, dv = in_flight
    dqt, dka, dkb, dv = warpgroup_mma_wait(0, deps=(dqt, dka, dkb, dv))
    _stage(dqt, dq_buf, dq_desc, [coord[0], coord[1], coord[2], COL0], sm_scale, DQ_TILES - 1, handoff, WAIT)
    return dka, dkb, dv


@gluon.jit
def _consumer(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr, WG: gl.constexpr):
    (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, stats_smem, ds_smem, dq_smem, seq_smem, bars,
     scales, problem, kv_rows, kv_acc, sink, det, widths) = args
    d_qk, d_v = widths
    SINK, DSINK = sink
    kv_bar, ready, empty, ds_ready, done, seq_ready = bars
    qk_scale, sm_scale, cap_in, cap_out, ALIBI, stride_alibi_b = scales
    left = problem[5]
    right = problem[6]
    varlen: gl.constexpr = problem[7] is not None
    DET: gl.constexpr = det[0] is not None
    dq_full = det[2]
    dq_empty = det[3]
    # DETERMINISTIC under a right edge: the key tiles in reverse (the loader's and the dQ writer's order)
    off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, seqlen_q, seqlen_k = key_tile(
        problem, program_sequence(seq_smem, seq_ready, varlen), BLOCK_M, BLOCK_N, CAUSAL, SPLIT,
        DET and (CAUSAL or right is not None))
    HEADS: gl.constexpr = GROUP // SPLIT
    head0 = off_hk * GROUP + part * HEADS
    desc_b = 0 if varlen else off_b
    dtype: gl.constexpr = q_smem.dtype
    HEAD_DIM: gl.constexpr = q_smem.shape[-1]
    DV: gl.constexpr = do_smem.shape[-1]
    # dQ by columns: this warpgroup's units [U0 · 64, (U0 + NU) · 64)
    U0: gl.constexpr = 0 if WG == 0 else 2
    NU: gl.constexpr = 2 if WG == 0 else 1
    # Sᵀ, dPᵀ: (keys, query rows); dK: (keys, 128) and (keys, 64); dV: (keys, dv); dQᵀ: (64 columns, rows)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    ka_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 16])
    kb_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 64, 16])
    v_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DV, 16])
    a_ka: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ka_layout, k_width=2)
    a_kb: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kb_layout, k_width=2)
    a_v: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a vector along Sᵀ's columns (the query rows)
    diag = seqlen_k - seqlen_q
    diag_r = None  # the band's edges (scores.py), None where unbounded; CAUSAL's right edge is the diagonal
    if CAUSAL:
        diag_r = diag
    elif right is not None:
        diag_r = diag + right
    diag_l = None
    if left is not None:
        diag_l = diag - left
    key0 = start_n + WG * HALF_N
    offs_k = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    key_tail = key0 + HALF_N > seqlen_k
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    dq_zero = gl.zeros([UNIT, BLOCK_M], gl.float32, dq_layout)
    dka = warpgroup_mma_init(gl.zeros([HALF_N, 128], gl.float32, ka_layout))
    dkb = warpgroup_mma_init(gl.zeros([HALF_N, 64], gl.float32, kb_layout))
    dv = warpgroup_mma_init(gl.zeros([HALF_N, DV], gl.float32, v_layout))
    k = k_smem.index(WG).reshape([HALF_N, HEAD_DIM])
    v = v_smem.index(WG).reshape([HALF_N, DV])
    k_halves = (k_smem.index(0).reshape([HALF_N, HEAD_DIM]), k_smem.index(1).reshape([HALF_N, HEAD_DIM]))
    mbarrier.wait(kv_bar, 0)
    # the stats tiles as rows: 2s is stage s's LSE (base 2), 2s + 1 its D (attn_bwd.py's reinterpretation)
    stats_rows = stats_smem._reinterpret(gl.float32, [2 * STAGES, BLOCK_M],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    sink_acc = gl.zeros([HALF_N], gl.float32, gl.SliceLayout(1, s_layout))
    n_steps = HEADS * n_m
    steps_per_head = gl.maximum(n_m, 1)
    for c in range(n_steps):
        off_h, m0, head_done = step_rows(c, steps_per_head, head0, m_first, BLOCK_M, HEADS)
        s = c % STAGES
        b = c % 2
        offs_q = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        slope = None
        if ALIBI is not None:
            slope = gl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        q = q_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(s).reshape([BLOCK_M, DV])
        # K and V through views indexed by c >> 30 (0, which the compiler cannot know): left loop-invariant,
        # their wgmma descriptors were hoisted out of the loop and spilled (attn_bwd_dsplit.py)
        kc = k_smem.index(WG + (c >> 30)).reshape([HALF_N, HEAD_DIM])
        vc = v_smem.index(WG + (c >> 30)).reshape([HALF_N, DV])
        st = warpgroup_mma(kc.slice(0, 128, dim=1), q.slice(0, 128, dim=1).permute((1, 0)), s_zero,
                           use_acc=False, is_async=True)
        st = warpgroup_mma(kc.slice(128, 64, dim=1), q.slice(128, 64, dim=1).permute((1, 0)), st,
                           is_async=True)
        dpt = warpgroup_mma(vc, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        lse = stats_rows.index(2 * s).load(row_layout)
        inside = None
        if varlen:
            # rows past the sequence's end count as rows that saw no key, and D 0 (attn_bwd.py)
            inside = offs_q < seqlen_q
            lse = gl.where(inside, lse, float("inf"))
        st = warpgroup_mma_wait(1, deps=(st,))
        pt, lse = transposed_probs(st, lse, offs_k, offs_q, key0, m0, key_tail, seqlen_k, qk_scale, cap_in,
                                   cap_out, slope, diag, diag_r, diag_l, CAUSAL)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_v), do, dv, is_async=True)
        if SINK is not None:
            sink_acc = sink_step(sink_acc, pt, dpt, stats_rows.index(2 * s).load(row_layout), inside, SINK,
                                 DSINK, off_h, head_done, s_layout)
        delta = stats_rows.index(2 * s + 1).load(row_layout)
        if varlen:
            delta = gl.where(inside, delta, 0.0)
        dst = pt * (dpt - delta[None, :])
        if cap_in is not None:
            dst = dst * dtanh(pt, stats_rows.index(2 * s).load(row_layout), cap_out, slope, offs_q, offs_k,
                              diag)
        dst = dst.to(dtype)
        dka = warpgroup_mma(gl.convert_layout(dst, a_ka), q.slice(0, 128, dim=1), dka, is_async=True)
        dkb = warpgroup_mma(gl.convert_layout(dst, a_kb), q.slice(128, 64, dim=1), dkb, is_async=True)
        # dS (rows: queries) for this warpgroup's keys, then dQᵀ over both halves once the other's is there.
        # Two buffers: a warpgroup writes step c + 2's only after the other arrived at step c + 1's barrier,
        # which it does once its step-c dQ products (the readers of buffer c % 2) are done
        ds_smem.index(2 * b + WG).store(gl.permute(dst, (1, 0)))
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(b), count=1)
        mbarrier.wait(ds_ready.index(b), (c // 2) & 1)
        coord = (desc_b, q_start + m0, off_h)
        if DET:
            # unit u staged in tile 3 · (c % 2) + u for the dQ writer (two sets: a step's units are staged
            # while the writer adds the last step's), once it has read step c - 2's tiles
            t0 = 3 * b
            dka, dkb, dv = _dq_unit(U0 * UNIT, k_halves, ds_smem, b, dq_zero, dq_smem.index(t0 + U0), dq_desc,
                                    coord, sm_scale, (dka, dkb, dv), (dq_empty.index(b), ((c // 2) & 1) ^ 1),
                                    True)
            if NU == 2:
                dka, dkb, dv = _dq_unit((U0 + 1) * UNIT, k_halves, ds_smem, b, dq_zero,
                                        dq_smem.index(t0 + U0 + 1), dq_desc, coord, sm_scale, (dka, dkb, dv),
                                        (dq_empty.index(b), 0), False)
            mbarrier.arrive(dq_full.index(b), count=1)
        else:
            # this warpgroup's staging tiles in turn, by the count of its units so far
            dka, dkb, dv = _dq_unit(U0 * UNIT, k_halves, ds_smem, b, dq_zero,
                                    dq_smem.index(DQ_TILES * WG + c * NU % DQ_TILES), dq_desc, coord,
                                    sm_scale, (dka, dkb, dv), None, False)
            if NU == 2:
                dka, dkb, dv = _dq_unit((U0 + 1) * UNIT, k_halves, ds_smem, b, dq_zero,
                                        dq_smem.index(DQ_TILES * WG + (c * NU + 1) % DQ_TILES), dq_desc,
                                        coord, sm_scale, (dka, dkb, dv), None, False)
        # this step's Q and dO have no reader left in this warpgroup
        mbarrier.arrive(empty.index(s), count=1)
        dka = warpgroup_mma_init(dka)
        dkb = warpgroup_mma_init(dkb)
        dv = warpgroup_mma_init(dv)
    dka, dkb, dv = warpgroup_mma_wait(0, deps=(dka, dkb, dv))

    # K and V are no longer read once both warpgroups are done (the other's dQ reads this one's K): their
    # tiles stage dK and dV
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
            add_key_tile(DK_ACC, dka * sm_scale, first, d_qk, 0, ka_layout)
            add_key_tile(DK_ACC, dkb * sm_scale, first, d_qk, 128, kb_layout)
            add_key_tile(DV_ACC, dv, first, d_v, 0, v_layout)
    else:
        k.slice(0, 128, dim=1).store((dka * sm_scale).to(dtype))
        k.slice(128, 64, dim=1).store((dkb * sm_scale).to(dtype))
        v.store(dv.to(dtype))
        store_key_tiles(k_smem.index(WG), v_smem.index(WG), dk_desc, dv_desc, kv_rows,
                        (off_b, k_start, key0, seqlen_k, start_n, off_hk), widths, varlen)
    tma.store_wait(0)


@gluon.jit
def _consumer0(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, 0)


@gluon.jit
def _consumer1(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT, 1)


@gluon.jit
def attn_bwd_keys_kernel(
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, stats_desc, nheads_k, seqlen_q, seqlen_k,
    qk_scale, sm_scale, n_bhk, lpt_group, left, right, cap_in, cap_out, d_qk, d_v, ALIBI, stride_alibi_b,
    CU_Q, CU_K, PLAN, STATS_ROW0, DK, DV, stride_km, stride_kh, stride_vm, stride_vh, DK_ACC, DV_ACC, SINK,
    DSINK, LOCK, stride_lock_b, stride_lock_h,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, SPLIT: gl.constexpr = 1,
):
    # attn_bwd.py's arguments; Q's, K's and dK's descriptors 256 wide, dO's, V's and dV's DV (<= 128) wide,
    # dQ's 64. LOCK (DETERMINISTIC): as attn_bwd.py's; its dQ writer takes the three 64-column units from
    # staging tiles 0..2 and 3..5 in turn
    gl.static_assert(LOCK is None or SINK is None)
    gl.static_assert(BLOCK_N == 2 * HALF_N)
    gl.static_assert(q_desc.block_type.shape[3] == 256 and do_desc.block_type.shape[3] <= 128)
    gl.static_assert(GROUP % SPLIT == 0)
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    # dS (queries, keys): two steps x two warpgroups' keys; dQ staging: DQ_TILES per warpgroup
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_N], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HALF_N], ds_layout)
    # DETERMINISTIC: two sets of a step's three units
    DQ_SMEM: gl.constexpr = 2 * DQ_TILES if LOCK is None else 6
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_SMEM] + dq_desc.block_type.shape, dq_desc.layout)
    stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    seq_smem = gl.allocate_shared_memory(gl.int32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    seq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if CU_Q is not None:
        mbarrier.init(seq_ready.index(0), count=1)
    # DETERMINISTIC: a step's three staged units (both warpgroups'), and their release by the dQ writer, per
    # staging set
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if LOCK is not None:
        for i in gl.static_range(2):
            mbarrier.init(dq_full.index(i), count=2)
            mbarrier.init(dq_empty.index(i), count=1)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # released by both consumer warpgroups
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    bars = (kv_bar, ready, empty, ds_ready, done, seq_ready)
    problem = (nheads_k, seqlen_q, seqlen_k, n_bhk, lpt_group, left, right, CU_Q, CU_K, PLAN, STATS_ROW0)
    args = (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, stats_smem, ds_smem, dq_smem,
            seq_smem, bars, (qk_scale, sm_scale, cap_in, cap_out, ALIBI, stride_alibi_b), problem,
            (DK, DV, stride_km, stride_kh, stride_vm, stride_vh), (DK_ACC, DV_ACC), (SINK, DSINK),
            (LOCK, (stride_lock_b, stride_lock_h), dq_full, dq_empty), (d_qk, d_v))
    # attn_bwd.py's loader; no block-sparse mask (its variant is attn_bwd.py's alone)
    loader_args = ((q_desc, do_desc, k_desc, v_desc, stats_desc),
                   (q_smem, do_smem, k_smem, v_smem, stats_smem, seq_smem), bars, problem, LOCK, (None,))
    # registers: as attn_bwd.py's, 240 per consumer thread and 24 for the loader's (and the dQ writer's)
    if LOCK is not None:
        gl.warp_specialize([
            (_consumer0, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
            (_loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
            # the writer's HEAD_DIM: the 192 columns of its three units
            # two staging sets; the order kept per 64 rows (two steps): one count wait and one count-in
            (dq_writer, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, 3 * UNIT, GROUP, CAUSAL, False, SPLIT,
                         2, 2 * BLOCK_M)),
        ], [4, 1, 1], [240, 24, 24])
    else:
        gl.warp_specialize([
            (_consumer0, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
            (_loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
        ], [4, 1], [240, 24])
