"""Warp-specialised Hopper forward in Gluon (Triton's explicit-layout dialect), FlashAttention-3's schedule.

Why a second forward body: Triton 3.6 gives no warp specialisation on sm_90 (its automatic pass leaves our
loop unchanged) and its pipeliner waits for every QK^T right after issuing it, so the tensor
cores idle during the softmax. Here the roles are explicit:
  - a loader warp streams K and V tiles through a ring of shared-memory stages with TMA, one mbarrier pair
    (ready: bytes landed; empty: every consumer done) per stage and operand;
  - two consumer warpgroups each own 64 query rows of the 128-row tile (or three of a 192-row tile, whose
    steps run serially for lack of registers). Inside one, the next tile's QK^T and
    the previous tile's PV are in flight while the softmax runs (wgmma is asynchronous; we wait explicitly),
    and the two warpgroups never synchronise with each other, so one's softmax overlaps the other's matmuls.
The grid is persistent (one program per SM): after its first tile, the loader takes the program's next
one from a counter in global memory (an atomic add) and hands its index to the consumers through shared
memory, then fetches its Q (double-buffered) and K/V during the current tile's epilogue, so short sequences
do not pay a prologue and an epilogue per tile and causal tiles of unequal weight even out across programs.
With one program per tile (a grid of every tile) the counter hands out nothing. The K/V ring's slot and
phase come from a counter that runs on across tiles, identical in every partition. A tile's O is staged in
its Q buffer for a TMA store; DEFER_RELEASE waits for that store, and returns the buffer to the loader,
under the next tile's first QK^T rather than at the tile's end.
Only the plain case comes here (16-bit, padded layout, causal or not, GQA, head dims 64 and 128: the
launcher decides): every other feature keeps the Triton kernel (attn_fwd.py), whose online-softmax
invariants this body shares.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashattn.kernels.triton.common import (
    grouped_program,  # scalar arithmetic: Gluon calls triton.jit helpers
)

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup: the wgmma M of one warpgroup
LN2 = gl.constexpr(0.6931471805599453)  # the kernel works in base 2; LSE leaves it as a natural log
# A row's columns in a wgmma accumulator: column 8 j + 2 q + e sits in register (j, e) of lane q of the row's
# quad (4 lanes). ROW_PARTS lays out [HALF_M, 4] per-lane partials of the rows of one warpgroup: row bit 3 in
# a register, the quad's lanes along axis 1, the other row bits in lanes 2-4 and the warps, as the
# accumulator has them (so converting between the two is free)
ROW_PARTS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]],
    block_bases=[], shape=[64, 4]))


@gluon.jit
def _tile(t, nheads, seqlen_q, seqlen_k, n_bh, lpt_group, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch, head, kv head, first query row, key tiles) of tile t in common.grouped_program's order (heads
    in groups, every head's heaviest tile first), the Triton forward's."""
    n_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    off_bh, rank = grouped_program(t, n_bh, n_tiles, lpt_group)
    # rank 0 is the last query tile, the one with the most keys under causal masking
    start_m = (n_tiles - 1 - rank) * BLOCK_M
    if CAUSAL:
        n_end = gl.minimum(gl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0), seqlen_k)
    else:
        n_end = seqlen_k
    off_h = off_bh % nheads
    return off_bh // nheads, off_h, off_h // GROUP, start_m, gl.cdiv(n_end, BLOCK_N)


@gluon.jit
def _combine(x, axis: gl.constexpr, MAX: gl.constexpr):
    if MAX:
        y = gl.max(x, axis)
    else:
        y = gl.sum(x, axis)
    return y


@gluon.jit
def _lane_parts(x, MAX: gl.constexpr, TREE: gl.constexpr):
    """[M, N] in a wgmma accumulator layout -> [M, 4] in ROW_PARTS: the max (MAX) or the sum of each row's
    columns held by each lane of its quad. TREE: as a tree of log2(N / 4) levels; gl.max / gl.sum over a
    thread's registers chain each instruction on the last (at N = 128, 32 dependent FMNMX or FADD per row,
    each waiting out the previous one's latency), and halving the columns level by level keeps each level's
    instructions independent. Two consumers gain 5% from the trees at d=64 1K causal; three, which run
    serial steps, lose 2-4%, and keep the chains."""
    M: gl.constexpr = x.shape[0]
    J: gl.constexpr = x.shape[1] // 8
    if TREE:
        y = _combine(x.reshape([M, J, 4, 2]), 3, MAX)  # e
        for _ in gl.static_range(4):  # j: columns j and j + J/2 paired, while J > 1 (J <= 16)
            if y.shape[1] > 1:
                y = _combine(y.reshape([M, 2, y.shape[1] // 2, 4]), 1, MAX)
        y = gl.convert_layout(y.reshape([M, 4]), ROW_PARTS)
    else:
        # one chain per lane and row
        y = _combine(x.reshape([M, J, 4, 2]).permute((0, 2, 1, 3)).reshape([M, 4, 2 * J]), 2, MAX)
        y = gl.convert_layout(y, ROW_PARTS)
    return y


@gluon.jit
def _new_max(x, m_i, qk_scale, TREES: gl.constexpr):
    """max(m_i, each row's max of x * qk_scale) for x [M, N] in a wgmma accumulator layout (qk_scale > 0): the
    lanes' partial maxima, then two shuffles across the quad."""
    return gl.maximum(m_i, gl.convert_layout(gl.max(_lane_parts(x, True, (TREES & 1) != 0), 1),
                                             m_i.type.layout) * qk_scale)


@gluon.jit
def _publish_tile(tile_smem, tile_ready, qb, t):
    """Write tile index t into slot qb and release it to the consumers (the loader warp). The slot has its
    own barrier, arrived by this warp alone, so the index does not wait for Q's bytes to land (q_ready's
    phase ends with the TMA's). racecheck reports this hand-off all the same, and not the same protocol in a
    kernel that does nothing but this hand-off: its reports here say nothing about a race."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_smem.index(qb).store(gl.full([1], t, gl.int32, one))
    # every lane's store before the one lane's arrive
    gl.thread_barrier()
    mbarrier.arrive(tile_ready.index(qb), count=1)


@gluon.jit
def _loader(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr):
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_smem, bars, problem = loader_args
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ready = bars
    nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter = problem
    c = 0  # K/V tiles loaded so far, across query tiles: the ring slot and its phase
    i = 0  # query tiles taken so far: the Q buffer and its phase
    t = gl.program_id(0)
    while t < n_work:
        off_b, off_h, off_hk, start_m, n_k = _tile(t, nheads, seqlen_q, seqlen_k, n_bh, lpt_group, GROUP,
                                                   BLOCK_M, BLOCK_N, CAUSAL)
        qb = i % 2
        # a fresh mbarrier counts as having completed the phase before 0, so the first pass does not wait
        mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
        _publish_tile(tile_smem, tile_ready, qb, t)
        mbarrier.expect(q_ready.index(qb), CONSUMERS * q_desc.block_type.nbytes)
        for w in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(q_desc, [off_b, start_m + w * HALF_M, off_h, 0],
                                            q_ready.index(qb), q_smem.index(CONSUMERS * qb + w))
        for j in range(n_k):
            s = c % STAGES
            phase = ((c // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [off_b, j * BLOCK_N, off_hk, 0], k_ready.index(s),
                                            k_smem.index(s))
            mbarrier.wait(v_empty.index(s), phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [off_b, j * BLOCK_N, off_hk, 0], v_ready.index(s),
                                            v_smem.index(s))
            c += 1
        i += 1
        # the next tile goes to whichever program asks first (the first num_programs are taken by program
        # id): a static walk gave some programs 15% more causal work than the mean
        t = gl.atomic_add(tile_counter, 1, sem="relaxed") + gl.num_programs(0)
    # no tile left: a slot holding n_work tells the consumers to stop
    qb = i % 2
    mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
    _publish_tile(tile_smem, tile_ready, qb, n_work)
    # the last program to get here zeroes the counter for the next launch, which saves the host a zeroing
    # launch per call: every program's last take precedes its arrival (release), and the last
    # arrival sees them all (acquire), so no take can follow the reset
    arrived = gl.atomic_add(tile_counter + 1, 1, sem="acq_rel")
    if arrived == gl.num_programs(0) - 1:
        gl.atomic_xchg(tile_counter, 0, sem="relaxed")
        gl.atomic_xchg(tile_counter + 1, 0, sem="relaxed")


@gluon.jit
def _masked_exp(s, m_i, qk_scale, offs_q, start_n, seqlen_k, diag, s_layout: gl.constexpr,
                BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TREES: gl.constexpr):
    """The masked tile's exponentials (keys past seqlen_k, and under CAUSAL past each row's diagonal, get 0):
    (p, m_new, m_sub)."""
    offs_k = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = offs_k[None, :] < seqlen_k
    if CAUSAL:
        keep = keep & (offs_k[None, :] <= offs_q[:, None] + diag)
    # masked before the scale (qk_scale > 0): -inf * qk_scale - m_sub is -inf, so the exponent is one FFMA
    # as the unmasked body's, not a multiply and a subtraction (64 instructions fewer per step)
    sm = gl.where(keep, s, float("-inf"))
    m_new = _new_max(sm, m_i, qk_scale, TREES)
    # a row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    return gl.exp2(sm * qk_scale - m_sub[:, None]), m_new, m_sub


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, offs_q, start_n, seqlen_k, diag, unmasked_to, s_layout: gl.constexpr,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TREES: gl.constexpr,
             MASKED: gl.constexpr = False):
    """One tile of the online softmax (base 2): (p, m_new, l_new, alpha). MASKED: the tile is known to need
    the mask (the half-diagonal step: its keys reach past the diagonal of every row but the last), so the
    unmasked body, dead there, is not compiled (224 SASS instructions fewer at d=64 causal)."""
    if MASKED:
        p, m_new, m_sub = _masked_exp(s, m_i, qk_scale, offs_q, start_n, seqlen_k, diag, s_layout, BLOCK_N,
                                      CAUSAL, TREES)
    elif start_n + BLOCK_N > unmasked_to:
        p, m_new, m_sub = _masked_exp(s, m_i, qk_scale, offs_q, start_n, seqlen_k, diag, s_layout, BLOCK_N,
                                      CAUSAL, TREES)
    else:
        m_new = _new_max(s, m_i, qk_scale, TREES)
        m_sub = m_new
        p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    # l_i: each lane's partial sums ([HALF_M, 4], ROW_PARTS), reduced across the quad at the query tile's end
    # only, as FlashAttention-3's: the exponents need the row's max, never its sum, so no step waits for a
    # shuffle of it
    l_new = (l_i * gl.convert_layout(alpha, gl.SliceLayout(1, ROW_PARTS))[:, None]
             + _lane_parts(p, False, (TREES & 2) != 0))
    return p, m_new, l_new, alpha


@gluon.jit
def _release_q(q_empty, i):
    """Return the previous query tile's Q buffer (tile i - 1's, none for i = 0) to the loader once the TMA
    store of its O, staged there, has read it."""
    if i > 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index((i - 1) % 2), count=1)


@gluon.jit
def _halves(n_k, row0, diag, BLOCK_N: gl.constexpr):
    """Whether this warpgroup's last key tile (of n_k > 1) has its upper half masked for all its rows: its
    last row, row0 + HALF_M - 1, sees keys up to row0 + HALF_M - 1 + diag (HALF_DIAG)."""
    return (n_k > 1) & (row0 + diag <= (n_k - 1) * BLOCK_N)


@gluon.jit
def _last_pv(p, acc, v_smem, v_ready, v_empty, step, p_layout: gl.constexpr, STAGES: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A query tile's last PV (key step `step` of the K/V ring), alone: nothing is left to overlap it."""
    last = step % STAGES
    mbarrier.wait(v_ready.index(last), (step // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc


@gluon.jit
def _half_last_step(q, p, acc, m_i, l_i, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, step, start_n,
                    qk_scale, offs_q, seqlen_k, diag, unmasked_to, s_layout: gl.constexpr,
                    p_layout: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, TREES: gl.constexpr):
    """The last key step of a query tile whose last key tile (ring step `step`) has its upper half masked
    for every row of this warpgroup (HALF_DIAG): QK^T, the softmax and PV over the tile's first
    BLOCK_N / 2 keys (wgmma N and K of 64; start_n: the tile's first key), with the previous step's PV in
    flight as in the main loop. Returns (acc, m_i, l_i) with the last PV done."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_N, 16])
    rows_h: gl.constexpr = gl.SliceLayout(1, h_layout)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    cur = step % STAGES
    prev = (step - 1) % STAGES
    mbarrier.wait(k_ready.index(cur), (step // STAGES) & 1)
    k_half = k_smem.index(cur).reshape([BLOCK_N, HEAD_DIM]).slice(0, HALF_N)
    s = warpgroup_mma(q, k_half.permute((1, 0)), gl.zeros([HALF_M, HALF_N], gl.float32, h_layout),
                      use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((step - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    mbarrier.arrive(k_empty.index(cur), count=1)
    # the row statistics change layout with S's width only in type: the rows sit in the same registers
    p_h, m_h, l_h, alpha = _softmax(s, gl.convert_layout(m_i, rows_h), l_i, qk_scale,
                                    gl.convert_layout(offs_q, rows_h), start_n, seqlen_k, diag, unmasked_to,
                                    h_layout, HALF_N, CAUSAL, TREES, True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(cur), (step // STAGES) & 1)
    ph_op = gl.convert_layout(p_h.to(v_smem.dtype), p_layout)
    acc = warpgroup_mma(ph_op, v_smem.index(cur).reshape([BLOCK_N, HEAD_DIM]).slice(0, HALF_N), acc,
                        is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(cur), count=1)
    return acc, gl.convert_layout(m_h, rows), l_h


@gluon.jit
def _serial_step(q, acc, m_i, l_i, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, step, start_n,
                 qk_scale, offs_q, seqlen_k, diag, unmasked_to, p_layout: gl.constexpr, N: gl.constexpr,
                 STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                 TREES: gl.constexpr):
    """One key step (ring step `step`, keys start_n..start_n + N) with nothing else of this warpgroup in
    flight (three consumer warpgroups): QK^T, the softmax, PV. Holds S or P, never both, beside
    O, so three consumer warpgroups fit their 160 registers; the other warpgroups' matmuls run during this
    one's softmax. N < BLOCK_N takes the K and V tiles' first N keys (the half-diagonal step, always
    masked)."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, N, 16])
    rows: gl.constexpr = m_i.type.layout
    rows_n: gl.constexpr = gl.SliceLayout(1, st_layout)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    if N < BLOCK_N:
        k_tile = k_tile.slice(0, N)
        v_tile = v_tile.slice(0, N)
    mbarrier.wait(k_ready.index(stage), phase)
    s = warpgroup_mma(q, k_tile.permute((1, 0)), gl.zeros([HALF_M, N], gl.float32, st_layout), use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(stage), count=1)
    p, m_n, l_n, alpha = _softmax(s, gl.convert_layout(m_i, rows_n), l_i, qk_scale,
                                  gl.convert_layout(offs_q, rows_n), start_n, seqlen_k, diag, unmasked_to,
                                  st_layout, N, CAUSAL, TREES, N < BLOCK_N)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(stage), phase)
    acc = warpgroup_mma(gl.convert_layout(p.to(v_smem.dtype), p_layout), v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(stage), count=1)
    return acc, gl.convert_layout(m_n, rows), l_n


@gluon.jit
def _next_tile(tile_smem, tile_ready, i):
    """The consumers' i-th query tile, from the loader's slot (n_work: none left)."""
    qb = i % 2
    mbarrier.wait(tile_ready.index(qb), (i // 2) & 1)
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(tile_smem.index(qb).load(rows), 0)


@gluon.jit
def _consumer(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, DEFER_RELEASE: gl.constexpr,
              HALF_DIAG: gl.constexpr, TREES: gl.constexpr, WG: gl.constexpr):
    o_desc, q_smem, k_smem, v_smem, tile_smem, bars, LSE, stride_lse_b, stride_lse_h, qk_scale, problem = args
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ready = bars
    nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter = problem
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    diag = seqlen_k - seqlen_q
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)

    c = 0  # K/V tiles consumed so far, across query tiles: the loader's counter
    i = 0
    t = _next_tile(tile_smem, tile_ready, i)
    while t < n_work:
        off_b, off_h, off_hk, start_m, n_k = _tile(t, nheads, seqlen_q, seqlen_k, n_bh, lpt_group, GROUP,
                                                   BLOCK_M, BLOCK_N, CAUSAL)
        row0 = start_m + WG * HALF_M
        offs_q = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
        # tiles ending at or before unmasked_to need no predicate for any row of this warpgroup
        unmasked_to = seqlen_k
        if CAUSAL:
            unmasked_to = gl.minimum(unmasked_to, row0 + diag + 1)
        qb = i % 2
        q_buf = q_smem.index((BLOCK_M // HALF_M) * qb + WG)
        q = q_buf.reshape([HALF_M, HEAD_DIM])
        acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF_M, 4], gl.float32, ROW_PARTS)
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)

        if BLOCK_M // HALF_M == 3:
            # three consumers: serial steps (_serial_step)
            if DEFER_RELEASE:
                _release_q(q_empty, i)
            n_loop = n_k
            if HALF_DIAG:
                # the last step on its key tile's first half only (below)
                n_loop = n_k - _halves(n_k, row0, diag, BLOCK_N).to(gl.int32)
            for j in range(0, n_loop):
                acc, m_i, l_i = _serial_step(q, acc, m_i, l_i, k_smem, v_smem, k_ready, v_ready, k_empty,
                                             v_empty, c + j, j * BLOCK_N, qk_scale, offs_q, seqlen_k, diag,
                                             unmasked_to, p_layout, BLOCK_N, STAGES, BLOCK_N, HEAD_DIM,
                                             CAUSAL, TREES)
            if HALF_DIAG:
                if _halves(n_k, row0, diag, BLOCK_N):
                    acc, m_i, l_i = _serial_step(q, acc, m_i, l_i, k_smem, v_smem, k_ready, v_ready, k_empty,
                                                 v_empty, c + n_k - 1, (n_k - 1) * BLOCK_N, qk_scale, offs_q,
                                                 seqlen_k, diag, unmasked_to, p_layout, BLOCK_N // 2, STAGES,
                                                 BLOCK_N, HEAD_DIM, CAUSAL, TREES)
        elif n_k > 0:
            # key tile 0: QK^T alone
            s0 = c % STAGES
            mbarrier.wait(k_ready.index(s0), (c // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(s0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            if DEFER_RELEASE:
                # while it runs: the previous tile's O store and the release of its buffer
                _release_q(q_empty, i)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(s0), count=1)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, offs_q, 0, seqlen_k, diag, unmasked_to,
                                          s_layout, BLOCK_N, CAUSAL, TREES)
            n_loop = n_k
            if HALF_DIAG:
                # the last key tile's upper half is masked for every row of this warpgroup (_halves): that
                # step runs on the tile's first half only
                n_loop = n_k - _halves(n_k, row0, diag, BLOCK_N).to(gl.int32)
            for j in range(1, n_loop):
                cur = (c + j) % STAGES
                prev = (c + j - 1) % STAGES
                # issue this key tile's QK^T, then the previous one's PV; the softmax below runs while they do
                mbarrier.wait(k_ready.index(cur), ((c + j) // STAGES) & 1)
                s = warpgroup_mma(q, k_smem.index(cur).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                # wgmma groups retire in order: one left outstanding means QK^T is done, PV may still run
                s = warpgroup_mma_wait(1, deps=(s,))
                mbarrier.arrive(k_empty.index(cur), count=1)
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, offs_q, j * BLOCK_N, seqlen_k, diag,
                                              unmasked_to, s_layout, BLOCK_N, CAUSAL, TREES)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(v_empty.index(prev), count=1)
                # the PV just finished was in the previous max's units
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            if HALF_DIAG:
                if _halves(n_k, row0, diag, BLOCK_N):
                    acc, m_i, l_i = _half_last_step(q, p, acc, m_i, l_i, k_smem, v_smem, k_ready, k_empty,
                                                    v_ready, v_empty, c + n_k - 1, (n_k - 1) * BLOCK_N,
                                                    qk_scale, offs_q, seqlen_k, diag, unmasked_to,
                                                    s_layout, p_layout, STAGES, BLOCK_N, HEAD_DIM,
                                                    CAUSAL, TREES)
                else:
                    acc = _last_pv(p, acc, v_smem, v_ready, v_empty, c + n_k - 1, p_layout, STAGES, BLOCK_N,
                                   HEAD_DIM)
            else:
                acc = _last_pv(p, acc, v_smem, v_ready, v_empty, c + n_k - 1, p_layout, STAGES, BLOCK_N,
                               HEAD_DIM)
        elif DEFER_RELEASE:
            _release_q(q_empty, i)
        c += n_k

        # rows that saw no key: out = 0 and lse = +inf (flash_attn's convention)
        l_tot = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, s_layout))
        seen = l_tot > 0.0
        l_safe = gl.where(seen, l_tot, 1.0)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        gl.store(LSE + off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h + offs_q, lse,
                 mask=offs_q < seqlen_q)
        # the Q rows are no longer read: their shared memory stages O for the TMA store, which clips rows
        # past seqlen_q; the buffer returns to the loader once the store has read it. DEFER_RELEASE waits
        # for that under the next tile's first QK^T instead of here (the loader needs the buffer back only
        # for the tile after that)
        q.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, 0], q_buf)
        if not DEFER_RELEASE:
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(qb), count=1)
        i += 1
        t = _next_tile(tile_smem, tile_ready, i)
    if DEFER_RELEASE:
        _release_q(q_empty, i)


@gluon.jit
def _consumer0(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               DEFER_RELEASE: gl.constexpr, HALF_DIAG: gl.constexpr, TREES: gl.constexpr):
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG, TREES, 0)


@gluon.jit
def _consumer1(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               DEFER_RELEASE: gl.constexpr, HALF_DIAG: gl.constexpr, TREES: gl.constexpr):
    # a worker partition: the loader's arguments first
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG, TREES, 1)


@gluon.jit
def _consumer2(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               DEFER_RELEASE: gl.constexpr, HALF_DIAG: gl.constexpr, TREES: gl.constexpr):
    # the third consumer warpgroup of 192-row tiles
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG, TREES, 2)


@gluon.jit
def attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, stride_lse_b, stride_lse_h,
    nheads, seqlen_q, seqlen_k, qk_scale, n_bh, lpt_group, tile_counter,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DEFER_RELEASE: gl.constexpr = False,
    HALF_DIAG: gl.constexpr = False, TREES: gl.constexpr = 3,  # bit 0: the max's tree, 1: the sums'
):
    # two consumer warpgroups of 64 rows, or three (BLOCK_M = 192, FA3's choice at d = 64). Three
    # have 160 registers each (ptxas holds each partition to its setmaxnreg share): not enough for QK^T, P and
    # O in flight at once, so they run serial steps
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    gl.static_assert((CONSUMERS == 2) | (CONSUMERS == 3))
    n_work = gl.cdiv(seqlen_q, BLOCK_M) * n_bh

    dtype: gl.constexpr = q_desc.dtype
    # two query tiles (the current one, the next one's prefetch) x the consumers' rows
    q_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    # the query tile of each Q buffer, written by the loader (tile_counter's scheduling)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # released by every consumer warpgroup
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ready)
    problem = (nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter)

    args = (o_desc, q_smem, k_smem, v_smem, tile_smem, bars, LSE, stride_lse_b, stride_lse_h, qk_scale,
            problem)
    loader_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_smem, bars, problem)
    flags = (DEFER_RELEASE, HALF_DIAG, TREES)
    if CONSUMERS == 2:
        # registers: the launch's maxnreg (168 x 12 warps fills the register file) moved by setmaxnreg to 240
        # per consumer thread and 24 for the loader's
        gl.warp_specialize([
            (_consumer0, (args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL) + flags),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL) + flags),
            (_loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL)),
        ], [4, 1], [240, 24])
    else:
        # 128 x 16 warps fills the register file: 160 for the two worker consumers, 24 for the loader, and
        # what is left (168) for the default partition's consumer
        gl.warp_specialize([
            (_consumer0, (args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL) + flags),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL) + flags),
            (_consumer2, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL) + flags),
            (_loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL)),
        ], [4, 4, 1], [160, 160, 24])
