"""The Gluon forward's key steps (attn_fwd.py's consumers): QK^T and PV on the K/V ring's slots, and the steps
that run apart from the main loop (a query tile's last PV, the half-diagonal step, the three-consumer serial
step). Each waits on and releases the ring's mbarriers as the loader expects (attn_fwd.py's docstring)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashattn.kernels.gluon.scores import HALF_M, softmax_step


@gluon.jit
def v_tile(v_smem, stage, N: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_V: gl.constexpr):
    """Keys [0, N) of ring slot `stage` as the [N, HEAD_DIM_V] B operand of PV: in place, or, for an FP8 V
    (held K-major as [HEAD_DIM_V, BLOCK_N], as e4m3 wgmma takes its B), through a transposed view."""
    t = v_smem.index(stage)
    if v_smem.dtype.primitive_bitwidth == 8:
        t = t.reshape([HEAD_DIM_V, BLOCK_N])
        if N < BLOCK_N:
            t = t.slice(0, N, 1)
        t = t.permute((1, 0))
    else:
        t = t.reshape([BLOCK_N, HEAD_DIM_V])
        if N < BLOCK_N:
            t = t.slice(0, N)
    return t


@gluon.jit
def qk(q_smem, qi, k_smem, stage, s_zero, N: gl.constexpr, BLOCK_N: gl.constexpr, NCH: gl.constexpr):
    """Issue S = Q Kᵀ (asynchronous) for Q buffer qi against the first N keys of K ring slot `stage`: one
    wgmma per column chunk of Q and K, into one accumulator. A head dim that is not a power of two (192) is
    held as 64-wide chunks (a tile's shape must be a power of two); the others as one chunk. Each wgmma is
    its own group: a wait that leaves one group outstanding after a later PV has retired all of them."""
    CW: gl.constexpr = k_smem.shape[4]  # K's chunks: Q's may be 5-D (the packed GQA tiles)
    s = s_zero
    for ch in gl.static_range(NCH):
        k = k_smem.index(stage * NCH + ch).reshape([BLOCK_N, CW])
        if N < BLOCK_N:
            k = k.slice(0, N)
        s = warpgroup_mma(q_smem.index(qi * NCH + ch).reshape([HALF_M, CW]), k.permute((1, 0)), s,
                          use_acc=ch > 0, is_async=True)
    return s


@gluon.jit
def release_q(q_empty, i):
    """Return the previous query tile's Q buffer (tile i - 1's, none for i = 0) to the loader once the TMA
    store of its O, staged there, has read it."""
    if i > 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index((i - 1) % 2), count=1)


@gluon.jit
def halves(n_start, n_k, row0, diag_r, BLOCK_N: gl.constexpr):
    """Whether this warpgroup's last key tile (of n_k > 1 from key n_start) has its upper half masked for all
    its rows: its last row, row0 + HALF_M - 1, sees keys up to row0 + HALF_M - 1 + diag_r (HALF_DIAG)."""
    return (n_k > 1) & (row0 + diag_r <= n_start + (n_k - 1) * BLOCK_N)


@gluon.jit
def last_pv(p, acc, v_smem, v_ready, v_empty, step, p_layout: gl.constexpr, STAGES: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM_V: gl.constexpr):
    """A query tile's last PV (key step `step` of the K/V ring), alone: nothing is left to overlap it."""
    last = step % STAGES
    mbarrier.wait(v_ready.index(last), (step // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_tile(v_smem, last, BLOCK_N, BLOCK_N, HEAD_DIM_V), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc


@gluon.jit
def half_last_step(q_smem, qi, p, acc, m_i, l_i, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, step,
                    start_n, offs_q, seqlen_k, scores, slope, diag, diag_r, diag_l, unmasked_from,
                    unmasked_to, s_layout: gl.constexpr, p_layout: gl.constexpr,
                    STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    HEAD_DIM_V: gl.constexpr, TREES: gl.constexpr):
    """The last key step of a query tile whose last key tile (ring step `step`) has its upper half masked
    for every row of this warpgroup (HALF_DIAG): QK^T, the softmax and PV over the tile's first
    BLOCK_N / 2 keys (wgmma N and K of 64; start_n: the tile's first key), with the previous step's PV in
    flight as in the main loop. Returns (acc, m_i, l_i) with the last PV done."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    KW: gl.constexpr = 256 // q_smem.dtype.primitive_bitwidth  # wgmma's K: 16 (16-bit), 32 (e4m3)
    NCH: gl.constexpr = HEAD_DIM // k_smem.shape[4]
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_N, KW])
    rows_h: gl.constexpr = gl.SliceLayout(1, h_layout)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    cur = step % STAGES
    prev = (step - 1) % STAGES
    mbarrier.wait(k_ready.index(cur), (step // STAGES) & 1)
    s = qk(q_smem, qi, k_smem, cur, gl.zeros([HALF_M, HALF_N], gl.float32, h_layout), HALF_N, BLOCK_N,
            NCH)
    mbarrier.wait(v_ready.index(prev), ((step - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_tile(v_smem, prev, BLOCK_N, BLOCK_N, HEAD_DIM_V), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    mbarrier.arrive(k_empty.index(cur), count=1)
    # the row statistics change layout with S's width only in type: the rows sit in the same registers
    p_h, m_h, l_h, alpha = softmax_step(s, gl.convert_layout(m_i, rows_h), l_i,
                                        gl.convert_layout(offs_q, rows_h), start_n, seqlen_k, scores, slope,
                                        diag, diag_r, diag_l, unmasked_from, unmasked_to, h_layout, HALF_N,
                                        TREES, True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(cur), (step // STAGES) & 1)
    ph_op = gl.convert_layout(p_h.to(v_smem.dtype), p_layout)
    acc = warpgroup_mma(ph_op, v_tile(v_smem, cur, HALF_N, BLOCK_N, HEAD_DIM_V), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(cur), count=1)
    return acc, gl.convert_layout(m_h, rows), l_h


@gluon.jit
def serial_step(q_smem, qi, acc, m_i, l_i, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, step, start_n,
                 offs_q, seqlen_k, scores, slope, diag, diag_r, diag_l, unmasked_from, unmasked_to,
                 p_layout: gl.constexpr, N: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, TREES: gl.constexpr):
    """One key step (ring step `step`, keys start_n..start_n + N) with nothing else of this warpgroup in
    flight (three consumer warpgroups): QK^T, the softmax, PV. Holds S or P, never both, beside
    O, so three consumer warpgroups fit their 160 registers; the other warpgroups' matmuls run during this
    one's softmax. N < BLOCK_N takes the K and V tiles' first N keys (the half-diagonal step, always
    masked)."""
    KW: gl.constexpr = 256 // q_smem.dtype.primitive_bitwidth  # wgmma's K: 16 (16-bit), 32 (e4m3)
    NCH: gl.constexpr = HEAD_DIM // k_smem.shape[4]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, N, KW])
    rows: gl.constexpr = m_i.type.layout
    rows_n: gl.constexpr = gl.SliceLayout(1, st_layout)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    vt = v_tile(v_smem, stage, N, BLOCK_N, HEAD_DIM_V)
    mbarrier.wait(k_ready.index(stage), phase)
    s = qk(q_smem, qi, k_smem, stage, gl.zeros([HALF_M, N], gl.float32, st_layout), N, BLOCK_N, NCH)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(stage), count=1)
    p, m_n, l_n, alpha = softmax_step(s, gl.convert_layout(m_i, rows_n), l_i,
                                      gl.convert_layout(offs_q, rows_n), start_n, seqlen_k, scores, slope,
                                      diag, diag_r, diag_l, unmasked_from, unmasked_to, st_layout, N, TREES,
                                      N < BLOCK_N)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(stage), phase)
    acc = warpgroup_mma(gl.convert_layout(p.to(v_smem.dtype), p_layout), vt, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(stage), count=1)
    return acc, gl.convert_layout(m_n, rows), l_n


@gluon.jit
def ahead_steps(q_smem, qi, acc, m_i, l_i, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_empty, i, c,
                n_k, n_start, offs_q, seqlen_k, scores, slope, diag, diag_r, diag_l, unmasked_from,
                unmasked_to, s_layout: gl.constexpr, p_layout: gl.constexpr, STAGES: gl.constexpr,
                BLOCK_N: gl.constexpr, HEAD_DIM_V: gl.constexpr, NCH: gl.constexpr, TREES: gl.constexpr,
                DEFER_RELEASE: gl.constexpr):
    """A query tile's n_k > 0 key steps (ring steps c .. c + n_k - 1, from key n_start) with each next tile's
    QK^T issued before this one's softmax (the route's qk_ahead): the softmax of step j runs while step
    j + 1's QK^T and step j - 1's PV are in flight, where the main loop overlaps it with the PV alone. Two S
    tiles live at once (the one in the softmax, the next one accumulating) beside O and P. Each step waits
    for both before it ends, so nothing is in flight across the loop's back edge: an accumulator in flight
    there makes ptxas serialise every wgmma of the kernel (read in the SASS: a wait after each). wgmma
    groups retire in order, and a QK^T is NCH groups (qk): with the PV issued before the next QK^T, NCH
    left outstanding means the PV is done. Returns (acc, m_i, l_i) with the last PV done."""
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
    s = qk(q_smem, qi, k_smem, c % STAGES, s_zero, BLOCK_N, BLOCK_N, NCH)
    if DEFER_RELEASE:
        # while it runs: the previous tile's O store and the release of its buffer
        release_q(q_empty, i)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(c % STAGES), count=1)
    if n_k > 1:
        mbarrier.wait(k_ready.index((c + 1) % STAGES), ((c + 1) // STAGES) & 1)
        s_next = qk(q_smem, qi, k_smem, (c + 1) % STAGES, s_zero, BLOCK_N, BLOCK_N, NCH)
        # the first step's alpha rescales nothing: O is still zero
        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, offs_q, n_start, seqlen_k, scores, slope, diag, diag_r,
                                          diag_l, unmasked_from, unmasked_to, s_layout, BLOCK_N, TREES)
        s = warpgroup_mma_wait(0, deps=(s_next,))
        mbarrier.arrive(k_empty.index((c + 1) % STAGES), count=1)
        for j in range(1, n_k - 1):
            # s: step j's scores, p: step j - 1's probabilities (float32, converted just before their PV)
            prev = (c + j - 1) % STAGES
            nxt = (c + j + 1) % STAGES
            mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
            acc = warpgroup_mma(p_op, v_tile(v_smem, prev, BLOCK_N, BLOCK_N, HEAD_DIM_V), acc, is_async=True)
            mbarrier.wait(k_ready.index(nxt), ((c + j + 1) // STAGES) & 1)
            s_next = qk(q_smem, qi, k_smem, nxt, s_zero, BLOCK_N, BLOCK_N, NCH)
            p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, offs_q, n_start + j * BLOCK_N, seqlen_k, scores,
                                              slope, diag, diag_r, diag_l, unmasked_from, unmasked_to,
                                              s_layout, BLOCK_N, TREES)
            acc = warpgroup_mma_wait(NCH, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            # the PV just finished was in the previous max's units
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
            s = warpgroup_mma_wait(0, deps=(s_next,))
            mbarrier.arrive(k_empty.index(nxt), count=1)
        # the last step: its scores are in; the previous PV runs under its softmax
        prev = (c + n_k - 2) % STAGES
        mbarrier.wait(v_ready.index(prev), ((c + n_k - 2) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_tile(v_smem, prev, BLOCK_N, BLOCK_N, HEAD_DIM_V), acc, is_async=True)
        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, offs_q, n_start + (n_k - 1) * BLOCK_N, seqlen_k,
                                          scores, slope, diag, diag_r, diag_l, unmasked_from, unmasked_to,
                                          s_layout, BLOCK_N, TREES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    else:
        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, offs_q, n_start, seqlen_k, scores, slope, diag, diag_r,
                                          diag_l, unmasked_from, unmasked_to, s_layout, BLOCK_N, TREES)
    acc = last_pv(p, acc, v_smem, v_ready, v_empty, c + n_k - 1, p_layout, STAGES, BLOCK_N, HEAD_DIM_V)
    return acc, m_i, l_i
