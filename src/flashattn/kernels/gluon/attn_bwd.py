"""Warp-specialised backward for Hopper in Gluon: FlashAttention-3's schedule, 5 matmuls per tile pair.

One program per (128-key tile, batch·kv head). dV = Σ Pᵀ dO and dK = scale·Σ dSᵀ Q accumulate in registers
over the query tiles of every query head in the GQA group; dQ = scale·dS K is added tile by tile into a
float32 buffer with TMA reduce-adds (the tensor memory accelerator does the read-modify-write,
asynchronously), so no second pass recomputes S and dP (the Triton backward's dQ program: 7 matmuls per tile
pair, attn_bwd.py).
  - a loader warp brings the program's K and V once, then streams (Q, dO) tiles of BLOCK_M query rows (64, or
    128 for d = 64 without a mask), with the rows' LSE and D (the preprocess's stats planes), through a ring
    of TMA stages;
  - two consumer warpgroups own 64 keys each. Per query tile one issues Sᵀ = K Qᵀ and dPᵀ = V dOᵀ together,
    computes Pᵀ while dPᵀ runs, issues dV += Pᵀ dO and dK += dSᵀ Q, and writes its dSᵀ half to shared
    memory; once both halves are there (an mbarrier), each computes half of dQ's columns over all 128 keys
    and reduce-adds them. Each step waits for its dV, dK and dQ before the next begins: FA3's order, which
    leaves them in flight under the next step's Sᵀ and dPᵀ, measured 12-37% slower here.
    DEFER_DQ (d = 64, 64-row steps): each step computes the previous step's dQ, so the dSᵀ hand-off no
    longer holds the two warpgroups in step.
    SPLIT > 1 (GQA/MQA): SPLIT programs per key tile and kv head, each over GROUP / SPLIT of the group's
    query heads, add their dK and dV into float32 buffers with atomics (FA3's GQA scheme), which the
    launcher casts; a group of 32 heads on one program holds that program's key tile 32x as long. Under
    DETERMINISTIC each part adds into kv heads of its own (`part_heads`), which the launcher sums in a
    fixed order.
The options are compile-time variants of this one body, as in the forward (scores.py; None when off): a
window (left, right) alone or with causal at any seqlen_q and seqlen_k, each key tile visiting only the
query tiles that see it (`key_tile`) and masking only those at the band's edges; softcap (dS times
1 − tanh²); ALiBi; the packed (varlen) layout, whose key tiles of all sequences form one list (a
program per tile and kv head), a sequence's rows past its end masked and its last keys' dK and dV stored by
masked stores rather than TMA; a block-sparse mask of 128 x 128 blocks (sparse_bwd.py), each key tile
walking its key block's column lists (the query blocks that see it, full ones unmasked, partial ones
through their bits) in the mask's launch order of key blocks. A learnable sink leaves dS unchanged (P is
recomputed against the LSE that includes it); its gradient, -Σᵢ P_sink,ᵢ Σⱼ Pᵢⱼ dPᵢⱼ, is summed here from
the float32 Pᵀ and dPᵀ and added once per program and head (the preprocess's D = rowsum(dO ∘ O) comes from
the rounded output, and over the many rows of that sum its error passed plain PyTorch's several-fold).
The reduce order across programs varies, so dQ is not bitwise reproducible, except under DETERMINISTIC
(FA3's scheme): the consumers stage their dQ halves for a dQ-writer warp, which adds a step's halves only
once the programs before it in a fixed order have added theirs into that query tile (a counter per query
head and tile in global memory, LOCK), waits until its adds have landed, and counts itself in. The order:
under a right edge (causal included), the last key tile first, and the programs are launched in that order
(REVERSE), so that each step's predecessors reached that query tile a step or more earlier (a key tile's
first query tile lies 128 rows past its predecessor's); without one, the first key tile first. Each program
waits only for programs launched before it, which are running or done. Which calls come here is the routes'
choice (backends/triton/routes.py). The key tile and query tiles of a program are bwd_tiles.py's; dQ's
reduce-adds and the dQ writer, bwd_dq.py's.
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

from flashattn.kernels.gluon.bwd_dq import dq_writer, store_dq
from flashattn.kernels.gluon.bwd_tiles import (
    add_key_tile,
    key_sequence,
    key_tile,
    part_heads,
    program_sequence,
    step_rows,
    store_key_tiles,
)
from flashattn.kernels.gluon.schedule import publish_tile
from flashattn.kernels.gluon.scores import transposed_probs
from flashattn.kernels.gluon.sparse_bwd import (
    MASK_BLOCK,
    sparse_key_tile,
    step_block,
    step_row,
    transposed_bits,
)

HALF_N = gl.constexpr(64)  # keys per consumer warpgroup: the wgmma M of one warpgroup
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def dtanh(pt, lse, cap_out, slope, offs_q, offs_k, diag):
    """The softcap's derivative over c, 1 - tanh², recovered after the dPᵀ wait from Pᵀ (log2 Pᵀ + lse =
    tanh · cap_out − ALiBi's bias): tanh itself, or 1 - tanh² in 16 bits, held through the wait beside Pᵀ
    spilled 0.4-0.5 KB in the loop at d = 128. The log2 is opaque inline PTX (one MUFU.LG2 an element): as
    gl.log2, LLVM folds it into the exp2 that made Pᵀ, which keeps the score tile live through the dPᵀ wait
    and spills as much again. Where Pᵀ is 0 (masked or underflowed) log2 is -inf, and where the row saw no key
    (lse = +inf) y is NaN: the clamp's maxnum returns -1 for both, a factor 0, and dS is 0 there anyway. The
    softmax scale multiplies dK and dQ at the end."""
    log2_pt = gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [pt], dtype=gl.float32,
                                        is_pure=True, pack=1)
    y = log2_pt + lse[None, :]
    if slope is not None:
        y = y + slope * gl.abs((offs_q[None, :] + diag - offs_k[:, None]).to(gl.float32))
    t = gl.minimum(gl.maximum(y * (1.0 / cap_out), -1.0), 1.0)
    return 1.0 - t * t


@gluon.jit
def sink_step(sink_acc, pt, dpt, lse_rows, inside, SINK, DSINK, off_h, head_done,
              s_layout: gl.constexpr):
    """A learnable sink's gradient, -Σᵢ P_sink,ᵢ Σⱼ Pᵢⱼ dPᵢⱼ, from one step's float32 Pᵀ and dPᵀ (keys ×
    rows in s_layout) and its rows' LSE (base 2, as read from the stats rows; inside: varlen's rows of the
    sequence, else None): summed per key into sink_acc over the head's steps, within each warp (a sum over
    the keys would cross warps every step), and added into DSINK[off_h] once the head's last step is in
    (head_done). P_sink = exp(sink - lse) is 0 where a row saw no key (lse = +inf, varlen's rows past the
    sequence included); rows past seqlen_q in the padded layout have dO = 0, hence dPᵀ = 0."""
    if inside is not None:
        lse_rows = gl.where(inside, lse_rows, float("inf"))
    p_sink = gl.exp2(gl.load(SINK + off_h) * LOG2E - lse_rows)
    sink_acc += gl.sum(pt * dpt * p_sink[None, :], axis=1)
    if head_done:
        _add_once(DSINK + off_h, -gl.sum(sink_acc, axis=0), s_layout, pt.shape[0], pt.shape[1])
        sink_acc = gl.zeros_like(sink_acc)
    return sink_acc


@gluon.jit
def _add_once(ptr, value, layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Atomically add a scalar into *ptr, once: from the one thread that owns element (0, 0) of a tile in
    `layout`, a wgmma accumulator layout, which holds each element in exactly one thread."""
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    first = (rows[:, None] == 0) & (cols[None, :] == 0)
    offs = rows[:, None] * 0 + cols[None, :] * 0
    gl.atomic_add(ptr + offs, gl.zeros([ROWS, COLS], gl.float32, layout) + value, mask=first, sem="relaxed")


@gluon.jit
def _loader(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    descs, smems, bars, problem, _, sparse = loader_args
    q_desc, do_desc, k_desc, v_desc, stats_desc = descs
    q_smem, do_smem, k_smem, v_smem, stats_smem, seq_smem = smems
    kv_bar, ready, empty, ds_ready, done, seq_ready = bars
    nheads_k = problem[0]
    varlen: gl.constexpr = problem[7] is not None
    b = 0
    if varlen:
        t, b = key_sequence(problem, SPLIT)
        publish_tile(seq_smem, seq_ready, 0, t, b)
    reverse: gl.constexpr = loader_args[4] is not None and (CAUSAL or problem[6] is not None)
    off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, _, _ = key_tile(problem, b, BLOCK_M,
                                                                                   BLOCK_N, CAUSAL, SPLIT,
                                                                                   reverse)
    HEADS: gl.constexpr = GROUP // SPLIT  # query heads per program
    head0 = off_hk * GROUP + part * HEADS
    if sparse[0] is not None:
        # a block-sparse mask (sparse_bwd.py): its key block of this launch rank, its column lists' steps
        start_n, lists, full, n_m = sparse_key_tile(sparse, off_b, head0, start_n, BLOCK_M)
    # varlen: the packed tensors' descriptors have one batch, and a sequence's rows start at its offsets;
    # rows past its end are the next sequence's (the consumers mask them and store none)
    desc_b = 0 if varlen else off_b
    stats_row0 = 0
    if varlen:
        stats_row0 = 4 * gl.load(problem[10] + off_b)
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for w in gl.static_range(2):
        row = k_start + start_n + w * HALF_N
        tma.async_copy_global_to_shared(k_desc, [desc_b, row, off_hk, 0], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [desc_b, row, off_hk, 0], kv_bar, v_smem.index(w))
    c = 0
    for g in range(HEADS):
        off_h = head0 + g
        for mi in range(n_m):
            s = c % STAGES
            # a fresh mbarrier counts as having completed the phase before 0, so the first pass does not wait
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + stats_desc.block_type.nbytes)
            m0 = m_first + mi * BLOCK_M
            if sparse[0] is not None:
                m0 = step_row(lists, full, mi, BLOCK_M)
            landed = ready.index(s)
            tma.async_copy_global_to_shared(q_desc, [desc_b, q_start + m0, off_h, 0], landed, q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [desc_b, q_start + m0, off_h, 0], landed,
                                            do_smem.index(s))
            # the stats planes: (2, b·h, rows), or (2, h, rows) under varlen, a sequence's from stats_row0
            plane = desc_b * nheads_k * GROUP + off_h
            tma.async_copy_global_to_shared(stats_desc, [0, plane, stats_row0 + m0], landed,
                                            stats_smem.index(s))
            c += 1


@gluon.jit
def _dq_of(ds_smem, ds_ready, b, phase, k0_cols, k1_cols, q_zero):
    """Issue this warpgroup's dQ columns of the step whose dSᵀ halves sit in buffer b, once both are there."""
    mbarrier.wait(ds_ready.index(b), phase)
    dq = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k0_cols, q_zero, use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k1_cols, dq, is_async=True)


@gluon.jit
def _consumer(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, DEFER_DQ: gl.constexpr,
              SPLIT: gl.constexpr, WG: gl.constexpr):
    (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, stats_smem, ds_smem, dq_smem, seq_smem, bars,
     scales, problem, kv_rows, kv_acc, sink, det, widths, sparse) = args
    d_qk, d_v = widths
    SINK, DSINK = sink
    LOCK, _, dq_full, dq_empty = det
    handoff = None
    if LOCK is not None:
        handoff = (dq_full.index(0), dq_empty.index(0))
    kv_bar, ready, empty, ds_ready, done, seq_ready = bars
    qk_scale, sm_scale, cap_in, cap_out, ALIBI, stride_alibi_b = scales
    left = problem[5]
    right = problem[6]
    varlen: gl.constexpr = problem[7] is not None
    # DETERMINISTIC's launch order: each head's key tiles last first under a right edge (causal included)
    reverse: gl.constexpr = LOCK is not None and (CAUSAL or right is not None)
    off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, seqlen_q, seqlen_k = key_tile(
        problem, program_sequence(seq_smem, seq_ready, varlen), BLOCK_M, BLOCK_N, CAUSAL, SPLIT, reverse)
    HEADS: gl.constexpr = GROUP // SPLIT  # query heads per program
    head0 = off_hk * GROUP + part * HEADS
    if sparse[0] is not None:
        start_n, lists, full, n_m = sparse_key_tile(sparse, off_b, head0, start_n, BLOCK_M)
    desc_b = 0 if varlen else off_b
    dtype: gl.constexpr = q_smem.dtype
    HALF_D: gl.constexpr = HEAD_DIM // 2
    # Sᵀ, dPᵀ: (keys, queries); dK, dV: (keys, d); dQ: (queries, d / 2)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    diag = seqlen_k - seqlen_q
    # the band's edges (scores.py), None where unbounded; CAUSAL's right edge is the diagonal
    diag_r = None
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
    q_zero = gl.zeros([BLOCK_M, HALF_D], gl.float32, q_layout)
    dk = warpgroup_mma_init(gl.zeros([HALF_N, HEAD_DIM], gl.float32, o_layout))
    dv = warpgroup_mma_init(gl.zeros([HALF_N, HEAD_DIM], gl.float32, o_layout))
    k = k_smem.index(WG).reshape([HALF_N, HEAD_DIM])
    v = v_smem.index(WG).reshape([HALF_N, HEAD_DIM])
    # this warpgroup's half of dQ's columns, against each half of the keys
    k0_cols = k_smem.index(0).reshape([HALF_N, HEAD_DIM]).slice(WG * HALF_D, HALF_D, dim=1)
    k1_cols = k_smem.index(1).reshape([HALF_N, HEAD_DIM]).slice(WG * HALF_D, HALF_D, dim=1)
    dq_buf = dq_smem.index(WG)
    mbarrier.wait(kv_bar, 0)

    dq = warpgroup_mma_init(q_zero)
    NBUF: gl.constexpr = 4 if DEFER_DQ else 2
    m0_prev = m_first
    off_h_prev = head0
    n_steps = HEADS * n_m
    # n_m >= 1 wherever a step runs; the clamp is what the shipped kernel was measured with (without it, ptxas
    # allocates differently: 8 B more of spill loads in the causal build)
    steps_per_head = gl.maximum(n_m, 1)
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a vector along Sᵀ's columns (the query rows)
    # the stats tiles as rows: 2s is stage s's LSE, 2s + 1 its D. Indexing keeps a shared layout's rank (3
    # for the TMA tile), and a vector load needs rank 1: hence the reinterpretation, exact because the TMA
    # tile is unswizzled (Triton 3.6's Gluon names it _reinterpret; the project pins triton 3.6.*)
    stats_rows = stats_smem._reinterpret(gl.float32, [2 * STAGES, BLOCK_M],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # this head's share of the sink's gradient so far, per key (SINK)
    sink_acc = gl.zeros([HALF_N], gl.float32, gl.SliceLayout(1, s_layout))
    for c in range(n_steps):
        off_h, m0, head_done = step_rows(c, steps_per_head, head0, m_first, BLOCK_M, HEADS)
        if sparse[0] is not None:
            # the head's step i of its key block's column lists (m_first is 0: no band)
            i = m0 // BLOCK_M
            qblock, m0 = step_block(lists, full, i, BLOCK_M)
        s = c % STAGES
        b = c % NBUF
        offs_q = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        slope = None
        if ALIBI is not None:
            slope = gl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        q = q_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
        st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        lse = stats_rows.index(2 * s).load(row_layout)
        inside = None
        if varlen:
            # the rows past the sequence's end (the next sequence's, where padded tiles read zeros; their
            # stats rows may be unwritten) count as rows that saw no key, whose Pᵀ is 0 in either softmax
            # below, and D 0: a vector op per step rather than a predicate over the tile in every step
            # (ptxas spilled the same either way)
            inside = offs_q < seqlen_q
            lse = gl.where(inside, lse, float("inf"))
        st = warpgroup_mma_wait(1, deps=(st,))
        bits = None
        if sparse[0] is not None:
            # a partial block's bits, loaded once Sᵀ has landed (as the forward's: held across the wait
            # beside the accumulators, they would take registers the step needs)
            bits = transposed_bits(lists, full, i, qblock, WG, BLOCK_M)
        pt, lse = transposed_probs(st, lse, offs_k, offs_q, key0, m0, key_tail, seqlen_k, qk_scale, cap_in,
                                   cap_out, slope, diag, diag_r, diag_l, CAUSAL, part=bits)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do, dv, is_async=True)
        if SINK is not None:
            # the LSE read again from shared memory (ALiBi under causal masking has folded a bias into
            # `lse`; and holding `lse` this far spilled 0.4 KB more at d = 64)
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
        dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q, dk, is_async=True)
        # both halves of dSᵀ in shared memory, then dQ[:, this half of d] = dS K over all 128 keys.
        # In step order the barrier makes the warpgroups march in step (their softmaxes coincide); DEFER_DQ
        # computes the previous step's dQ instead, whose other half was written a step ago, so neither waits
        # for the other's current step. Buffers: the other warpgroup's arrival at a step's barrier means it
        # finished the step before; a buffer is rewritten NBUF steps later, after its last reader's dQ.
        ds_buf = ds_smem.index(2 * b + WG)
        ds_buf.store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(b), count=1)
        if DEFER_DQ:
            if c > 0:
                pb_ = (c - 1) % NBUF
                dq = _dq_of(ds_smem, ds_ready, pb_, ((c - 1) // NBUF) & 1, k0_cols, k1_cols, q_zero)
        else:
            dq = _dq_of(ds_smem, ds_ready, b, (c // NBUF) & 1, k0_cols, k1_cols, q_zero)
        dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        # this tile's Q and dO have no reader left
        mbarrier.arrive(empty.index(s), count=1)
        if DEFER_DQ:
            if c > 0:
                store_dq(dq, dq_buf, dq_desc, desc_b, q_start + m0_prev, off_h_prev, sm_scale, WG, BLOCK_M,
                          HALF_D, handoff, c - 1)
        else:
            store_dq(dq, dq_buf, dq_desc, desc_b, q_start + m0, off_h, sm_scale, WG, BLOCK_M, HALF_D,
                      handoff, c)
        m0_prev = m0
        off_h_prev = off_h
        dq = warpgroup_mma_init(dq)
        dk = warpgroup_mma_init(dk)
        dv = warpgroup_mma_init(dv)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    if DEFER_DQ:
        if n_steps > 0:
            # the last step's dQ
            last = n_steps - 1
            dq_last = _dq_of(ds_smem, ds_ready, last % NBUF, (last // NBUF) & 1, k0_cols, k1_cols, q_zero)
            dq_last = warpgroup_mma_wait(0, deps=(dq_last,))
            store_dq(dq_last, dq_buf, dq_desc, desc_b, q_start + m0_prev, off_h_prev, sm_scale, WG, BLOCK_M,
                      HALF_D, handoff, last)

    # K and V are no longer read once both warpgroups are done (the other one's dQ reads this one's K): their
    # shared memory stages dK and dV for the TMA stores (rows past seqlen_k are clipped)
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    if SPLIT > 1:
        # a part of the group: its share of dK and dV added into the float32 buffers (shaped like k)
        if start_n < seqlen_k:  # past the varlen list: nothing
            DK_ACC, DV_ACC = kv_acc
            key_row0 = off_b.to(gl.int64) * seqlen_k
            if varlen:
                key_row0 = k_start.to(gl.int64)
            head_k, heads_k = part_heads(off_hk, part, problem[0], SPLIT, LOCK)
            first = (key_row0, key0, seqlen_k, head_k, heads_k)
            add_key_tile(DK_ACC, dk * sm_scale, first, d_qk, 0, o_layout)
            add_key_tile(DV_ACC, dv, first, d_v, 0, o_layout)
    else:
        k.store((dk * sm_scale).to(dtype))
        v.store(dv.to(dtype))
        store_key_tiles(k_smem.index(WG), v_smem.index(WG), dk_desc, dv_desc, kv_rows,
                        (off_b, k_start, key0, seqlen_k, start_n, off_hk), widths, varlen)
    tma.store_wait(0)


@gluon.jit
def _consumer0(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, DEFER_DQ: gl.constexpr,
               SPLIT: gl.constexpr):
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ, SPLIT, 0)


@gluon.jit
def _consumer1(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, DEFER_DQ: gl.constexpr,
               SPLIT: gl.constexpr):
    # a worker partition: the loader's signature
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ, SPLIT, 1)


@gluon.jit
def attn_bwd_ws_kernel(
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, stats_desc, nheads_k, seqlen_q, seqlen_k,
    qk_scale, sm_scale, n_bhk, lpt_group, left, right, cap_in, cap_out, d_qk, d_v, ALIBI, stride_alibi_b,
    CU_Q, CU_K, PLAN, STATS_ROW0, DK, DV, stride_km, stride_kh, stride_vm, stride_vh, DK_ACC, DV_ACC, SINK,
    DSINK, LOCK, stride_lock_b, stride_lock_h, Q_FULL_NUM, Q_FULL_IDX, Q_PART_NUM, Q_PART_IDX, Q_PART_SLOT,
    K_ORDER, PART_BITS, mask_b, mask_h, n_kblocks, n_qblocks, max_qfull, max_qpart, max_part,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DEFER_DQ: gl.constexpr = False, SPLIT: gl.constexpr = 1,
    ORDER_M: gl.constexpr = 0,
):
    # options, None when off, as the forward's: left / right, the window's sides (CAUSAL: right = 0, and
    # `right` is None); cap_in = softmax_scale / softcap, cap_out = softcap / ln 2; ALIBI: float32 slopes at
    # b · stride_alibi_b + h. d_qk, d_v: the head dims, up to HEAD_DIM (the tiles' width, to which TMA pads
    # them with zeros and at which it clips the stores). Varlen: CU_Q, CU_K the sequences' offsets in the
    # packed tensors, PLAN the key tiles before each sequence (n_bhk = sequences · nheads_k), STATS_ROW0 where
    # each sequence's rows start in the stats planes (in 4-row units: a TMA start must be 16-byte aligned),
    # DK / DV (stride_km, stride_kh and stride_vm, stride_vh: their row and head strides) for the masked
    # stores of a sequence's last keys; all None in the padded layout. SPLIT > 1: DK_ACC / DV_ACC, zeroed
    # float32 buffers shaped like k and v (contiguous), into
    # which the programs add (None otherwise); n_bhk counts batch · kv heads · SPLIT. SINK: a learnable
    # sink's float32 values (h,), and DSINK the zeroed (h,) float32 its gradient is added into (None without).
    # LOCK (DETERMINISTIC; else None): zeroed int32 counters, query tile m0 of head h of batch b at
    # b · stride_lock_b + h · stride_lock_h + m0 (varlen: b's packed first row + m0, stride_lock_b 0);
    # ORDER_M: the rows over which the dQ writer keeps the order (a multiple of BLOCK_M; 0: BLOCK_M).
    # SPLIT > 1 under DETERMINISTIC: DK_ACC / DV_ACC have SPLIT times the kv heads (`part_heads`).
    # Q_FULL_NUM .. max_part: a block-sparse mask (sparse_bwd.py; None when off)
    gl.static_assert(BLOCK_N == 2 * HALF_N)
    # a block-sparse mask: the padded layout, its key blocks the key tiles, no band (its lists stand for it),
    # no ALiBi or sink (the block-sparse call has neither) and the adds of dQ in any order
    gl.static_assert((Q_FULL_NUM is None) or ((CU_Q is None) and (not CAUSAL) and (left is None)
                                              and (right is None) and (BLOCK_N == MASK_BLOCK)
                                              and (MASK_BLOCK % BLOCK_M == 0) and (ALIBI is None)
                                              and (SINK is None) and (LOCK is None)))
    # the sink's add in no fixed order: not with DETERMINISTIC
    gl.static_assert(LOCK is None or SINK is None)
    gl.static_assert(GROUP % SPLIT == 0)
    # dSᵀ buffers per warpgroup: 2 when both compute a step's dQ in that step, 4 when it is deferred a step
    NBUF: gl.constexpr = 4 if DEFER_DQ else 2
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    # dSᵀ (keys, queries): NBUF steps x two warpgroups; dQ staging for the reduce-adds: one per warpgroup
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2 * NBUF, HALF_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    # each (Q, dO) stage's LSE (base 2) and D rows, read from shared memory where they are used: held in
    # registers for the whole step (prefetched a step ahead), their 32 values per thread were what spilled
    stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # varlen: the program's tile and sequence, from the loader's search (schedule.publish_tile's slots;
    # 32 bytes, allocated in the padded layout too, where nothing uses them)
    seq_smem = gl.allocate_shared_memory(gl.int32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    seq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if CU_Q is not None:
        mbarrier.init(seq_ready.index(0), count=1)
    # DETERMINISTIC: the staged dQ halves of both warpgroups, and their release by the dQ writer
    dq_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    if LOCK is not None:
        mbarrier.init(dq_full.index(0), count=2)
        mbarrier.init(dq_empty.index(0), count=1)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # released by both consumer warpgroups
    for i in gl.static_range(NBUF):
        mbarrier.init(ds_ready.index(i), count=2)
    bars = (kv_bar, ready, empty, ds_ready, done, seq_ready)
    problem = (nheads_k, seqlen_q, seqlen_k, n_bhk, lpt_group, left, right, CU_Q, CU_K, PLAN, STATS_ROW0)
    sparse = (Q_FULL_NUM, Q_FULL_IDX, Q_PART_NUM, Q_PART_IDX, Q_PART_SLOT, K_ORDER, PART_BITS, mask_b, mask_h,
              n_kblocks, n_qblocks, max_qfull, max_qpart, max_part)
    args = (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, stats_smem, ds_smem, dq_smem,
            seq_smem, bars, (qk_scale, sm_scale, cap_in, cap_out, ALIBI, stride_alibi_b), problem,
            (DK, DV, stride_km, stride_kh, stride_vm, stride_vh), (DK_ACC, DV_ACC), (SINK, DSINK),
            (LOCK, (stride_lock_b, stride_lock_h), dq_full, dq_empty), (d_qk, d_v), sparse)
    loader_args = ((q_desc, do_desc, k_desc, v_desc, stats_desc),
                   (q_smem, do_smem, k_smem, v_smem, stats_smem, seq_smem), bars, problem, LOCK, sparse)
    # registers: the launch's maxnreg (168 x 12 warps fills the register file) moved by setmaxnreg to 240 per
    # consumer thread and 24 for the loader's; DETERMINISTIC's dQ writer is a second one-warp partition, in
    # the loader's warpgroup
    if LOCK is not None:
        gl.warp_specialize([
            (_consumer0, (args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ, SPLIT)),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ,
                          SPLIT)),
            (_loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
            (dq_writer, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ,
                          SPLIT, 1, ORDER_M)),
        ], [4, 1, 1], [240, 24, 24])
    else:
        gl.warp_specialize([
            (_consumer0, (args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ, SPLIT)),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_DQ,
                          SPLIT)),
            (_loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, SPLIT)),
        ], [4, 1], [240, 24])
