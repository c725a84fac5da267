"""Warp-specialised Hopper forward in Gluon (Triton's explicit-layout dialect), FlashAttention-3's schedule.

Why a second forward body: Triton 3.6 gives no warp specialisation on sm_90 (its automatic pass leaves our
loop unchanged) and its pipeliner waits for every QK^T right after issuing it, so the tensor
cores idle during the softmax. Here the roles are explicit:
  - a loader warp streams K and V tiles through a ring of shared-memory stages with TMA, one mbarrier pair
    (ready: bytes landed; empty: every consumer done) per stage and operand;
  - two consumer warpgroups each own 64 query rows of the 128-row tile (or three of a 192-row tile, whose
    steps run serially for lack of registers). Inside one, each key tile's QK^T is issued with the
    previous tile's PV, and the tile's softmax runs while that PV is in flight (wgmma is asynchronous; we
    wait explicitly); QK_AHEAD (the route's qk_ahead) also issues the next tile's QK^T before the softmax
    (fwd_steps.ahead_steps: two S tiles in registers, so 64-key steps). The two warpgroups never
    synchronise with each other, so one's softmax overlaps the other's matmuls.
The grid is persistent (one program per SM): after its first tile, the loader takes the program's next
one from a counter in global memory (an atomic add) and hands its index to the consumers through shared
memory, then fetches its Q (double-buffered) and K/V during the current tile's epilogue, so short sequences
do not pay a prologue and an epilogue per tile and causal tiles of unequal weight even out across programs.
With one program per tile (a grid of every tile) the counter hands out nothing. The K/V ring's slot and
phase come from a counter that runs on across tiles, identical in every partition. A tile's O is staged in
its Q buffer for a TMA store; DEFER_RELEASE waits for that store, and returns the buffer to the loader,
under the next tile's first QK^T rather than at the tile's end.
The options are compile-time variants of this one body (scores.py): a sliding window (left, right) alone
or with causal, any seqlen_q and seqlen_k (bottom-right aligned), softcap, ALiBi and a learnable sink. A
query tile's key tiles are [n_start, n_start + n_k · BLOCK_N), those that some row of the tile sees: the
loader and every consumer take the same range (schedule.py's `tile`), so the ring's counters agree; per
warpgroup, only the tiles at the band's edges run the masked softmax. The launcher passes None for each
option that is off.
The packed (varlen) layout is a variant too: its query tiles form one list for the persistent schedule
(schedule.py), and a sequence's last rows are stored by masked stores rather than TMA. Q's and K's head
dim is the padded width the route names: 64, 128 and 256 as one tile, 192 as three 64-wide column chunks
(a tile's shape is a power of two), QK^T one wgmma per chunk (`fwd_steps.qk`); V's and O's 64, 128 or
256. Q_BUFS = 1 (where two Q tiles and the K/V ring pass the shared memory: d = 192 beside 128-key steps,
d = 256 beside 64-key ones) loads a tile's Q once the previous tile's O is stored. Dropout, fp32 and other
head dims keep the Triton kernel (kernels/triton/attn_fwd.py), whose online-softmax invariants this body
shares.
A block-sparse mask is a variant too (sparse.py; the launcher passes its tensors, else None): a query tile
is a mask's query block, its key steps that block's lists (full blocks unmasked, partial ones through their
bitmasks), with no band and one query head a tile.
FP8 (e4m3 q, k, v with descales, inference; the launcher passes Q_SCALE etc., else None) is a variant too:
both products on e4m3 wgmma (K = 32 per instruction), V held K-major in shared memory ([dv, BLOCK_N] tiles
of a seqlen-contiguous V, read through a transposed view), q's and k's descales folded into each tile's
score scale, P rounded to e4m3, v's descale on the output, and O (16-bit, twice Q's bytes) staged in a
buffer of its own.
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

from flashattn.kernels.gluon.fwd_loader import loader
from flashattn.kernels.gluon.fwd_steps import (
    ahead_steps,
    half_last_step,
    halves,
    last_pv,
    qk,
    release_q,
    serial_step,
    v_tile,
)
from flashattn.kernels.gluon.schedule import next_tile, store_rows, tile
from flashattn.kernels.gluon.scores import HALF_M, ROW_PARTS, softmax_step
from flashattn.kernels.gluon.sparse import block_lists, partial_bits

LN2 = gl.constexpr(0.6931471805599453)  # the kernel works in base 2; LSE leaves it as a natural log
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _consumer(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, DEFER_RELEASE: gl.constexpr,
              HALF_DIAG: gl.constexpr, TREES: gl.constexpr, PACK: gl.constexpr, QK_AHEAD: gl.constexpr,
              WG: gl.constexpr):
    (o_desc, q_smem, k_smem, v_smem, tile_smem, bars, LSE, stride_lse_b, stride_lse_h, features, problem,
     out_rows, fp8) = args
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ready = bars
    (nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter, left, right, CU_Q, CU_K, PLAN,
     PAGE_CAP, SPARSE) = problem
    scores, ALIBI, stride_alibi_b, SINK = features
    O, stride_om, stride_oh, d_v = out_rows  # varlen only: O's rows past a sequence's end go by masked stores
    # FP8: O's own staging buffers and the descales (per (batch, head), strides 0 for one per tensor; q's
    # may be per kv head: q_scale_group query heads share one), all None otherwise
    (o_smem, Q_SCALE, K_SCALE, V_SCALE, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb,
     stride_vsh, q_scale_group) = fp8
    dtype: gl.constexpr = q_smem.dtype
    KW: gl.constexpr = 256 // dtype.primitive_bitwidth  # wgmma's K: 16 (16-bit), 32 (e4m3)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, KW])
    # V's and O's head dim: HEAD_DIM or narrower (HEAD_DIM is Q's and K's, padded to the tile's width)
    HEAD_DIM_V: gl.constexpr = o_desc.block_type.shape[4 if PACK > 1 else 3]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM_V, KW])
    # P from registers: 32 bits of it per register lane (two 16-bit values, four e4m3 ones)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // dtype.primitive_bitwidth)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    NCH: gl.constexpr = HEAD_DIM // k_smem.shape[4]  # Q's and K's column chunks (fwd_steps.qk)
    Q_BUFS: gl.constexpr = q_smem.shape[0] // (CONSUMERS * NCH)

    c = 0  # K/V tiles consumed so far, across query tiles: the loader's counter
    i = 0
    t, b = next_tile(tile_smem, tile_ready, i)
    while t < n_work:
        # rows, keys and lengths count within the tile's sequence (varlen: q_start is its first row in the
        # packed tensors)
        off_b, off_h, off_hk, start_m, n_start, n_k, q_start, _, len_q, len_k = tile(t, b, problem, GROUP,
                                                                                   BLOCK_M, BLOCK_N, CAUSAL,
                                                                                   PACK)
        diag = len_k - len_q
        # the band's edges (scores.py), None where unbounded; CAUSAL's right edge is the diagonal
        diag_r = None
        if CAUSAL:
            diag_r = diag
        elif right is not None:
            diag_r = diag + right
        diag_l = None
        if left is not None:
            diag_l = diag - left
        row0 = start_m + WG * HALF_M
        rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
        # each row's position (the masks' query index) and its head's offset from off_h: under PACK a
        # position's heads are adjacent rows, the padded group's last ones (past GROUP) computed, not stored
        offs_q = rows // PACK
        heads = rows % PACK
        # tiles in [unmasked_from, unmasked_to) need no predicate for any row of this warpgroup: the first
        # row sees every key before unmasked_to, the last every key from unmasked_from
        unmasked_to = len_k
        if diag_r is not None:
            unmasked_to = gl.minimum(unmasked_to, row0 // PACK + diag_r + 1)
        unmasked_from = None
        if diag_l is not None:
            unmasked_from = (row0 + HALF_M - 1) // PACK + diag_l
        slope = None
        if ALIBI is not None:
            if PACK > 1:
                # a slope per row ([HALF_M, 1], beside the scores): the rows are of several heads
                slope = (gl.load(ALIBI + off_b * stride_alibi_b + off_h + gl.minimum(heads, GROUP - 1))
                         * LOG2E)[:, None]
            else:
                slope = gl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
        tile_scores = scores
        if Q_SCALE is not None:
            # q's and k's descales scale every score of this (batch, head)
            ds = (gl.load(Q_SCALE + off_b * stride_qsb + (off_h // q_scale_group) * stride_qsh)
                  * gl.load(K_SCALE + off_b * stride_ksb + off_hk * stride_ksh))
            qk_scale, cap_in, cap_out = scores
            if cap_in is not None:
                cap_in = cap_in * ds
            tile_scores = (qk_scale * ds, cap_in, cap_out)
        if SPARSE[0] is not None:
            # a block-sparse mask: its query block's lists (the tile's rows are its rows)
            at, full, _ = block_lists(SPARSE, off_b, off_h, start_m // BLOCK_M)
        qb = i % Q_BUFS
        qi = CONSUMERS * qb + WG  # this warpgroup's Q buffer: chunks qi * NCH ..
        acc = gl.zeros([HALF_M, HEAD_DIM_V], gl.float32, o_layout)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF_M, 4], gl.float32, ROW_PARTS)
        mbarrier.wait(q_ready.index(qb), (i // Q_BUFS) & 1)

        if BLOCK_M // HALF_M == 3:
            # three consumers: serial steps (fwd_steps.serial_step)
            if DEFER_RELEASE:
                release_q(q_empty, i)
            n_loop = n_k
            if HALF_DIAG:
                # the last step on its key tile's first half only (below)
                n_loop = n_k - halves(n_start, n_k, row0, diag_r, BLOCK_N).to(gl.int32)
            for j in range(0, n_loop):
                acc, m_i, l_i = serial_step(q_smem, qi, acc, m_i, l_i, k_smem, v_smem, k_ready, v_ready,
                                             k_empty, v_empty, c + j, n_start + j * BLOCK_N, offs_q, len_k,
                                             tile_scores, slope, diag, diag_r, diag_l, unmasked_from,
                                             unmasked_to, p_layout, BLOCK_N, STAGES, BLOCK_N, HEAD_DIM,
                                             HEAD_DIM_V, TREES)
            if HALF_DIAG:
                if halves(n_start, n_k, row0, diag_r, BLOCK_N):
                    acc, m_i, l_i = serial_step(q_smem, qi, acc, m_i, l_i, k_smem, v_smem, k_ready, v_ready,
                                                 k_empty, v_empty, c + n_k - 1,
                                                 n_start + (n_k - 1) * BLOCK_N, offs_q, len_k, tile_scores,
                                                 slope, diag, diag_r, diag_l, unmasked_from, unmasked_to,
                                                 p_layout, BLOCK_N // 2, STAGES, BLOCK_N, HEAD_DIM,
                                                 HEAD_DIM_V, TREES)
        elif QK_AHEAD:
            if n_k > 0:
                acc, m_i, l_i = ahead_steps(q_smem, qi, acc, m_i, l_i, k_smem, v_smem, k_ready, k_empty,
                                            v_ready, v_empty, q_empty, i, c, n_k, n_start, offs_q, len_k,
                                            tile_scores, slope, diag, diag_r, diag_l, unmasked_from,
                                            unmasked_to, s_layout, p_layout, STAGES, BLOCK_N, HEAD_DIM_V,
                                            NCH, TREES, DEFER_RELEASE)
            elif DEFER_RELEASE:
                release_q(q_empty, i)
        elif n_k > 0:
            # key tile 0: QK^T alone
            s0 = c % STAGES
            mbarrier.wait(k_ready.index(s0), (c // STAGES) & 1)
            s = qk(q_smem, qi, k_smem, s0, s_zero, BLOCK_N, BLOCK_N, NCH)
            part0 = None  # not `part`: a name the loop below assigns would be carried through it
            if SPARSE[0] is not None:
                part0 = partial_bits(SPARSE, at, full, 0, WG * HALF_M, HALF_M, BLOCK_M, BLOCK_N)
            if DEFER_RELEASE:
                # while it runs: the previous tile's O store and the release of its buffer
                release_q(q_empty, i)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(s0), count=1)
            p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, offs_q, n_start, len_k, tile_scores, slope, diag,
                                              diag_r, diag_l, unmasked_from, unmasked_to, s_layout, BLOCK_N,
                                              TREES, part=part0)
            n_loop = n_k
            if HALF_DIAG:
                # the last key tile's upper half is masked for every row of this warpgroup
                # (fwd_steps.halves): that step runs on the tile's first half only
                n_loop = n_k - halves(n_start, n_k, row0, diag_r, BLOCK_N).to(gl.int32)
            for j in range(1, n_loop):
                cur = (c + j) % STAGES
                prev = (c + j - 1) % STAGES
                # issue this key tile's QK^T, then the previous one's PV; the softmax below runs while they do
                mbarrier.wait(k_ready.index(cur), ((c + j) // STAGES) & 1)
                s = qk(q_smem, qi, k_smem, cur, s_zero, BLOCK_N, BLOCK_N, NCH)
                mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p_op, v_tile(v_smem, prev, BLOCK_N, BLOCK_N, HEAD_DIM_V), acc,
                                    is_async=True)
                # wgmma groups retire in order: one left outstanding means QK^T is done, PV may still run
                s = warpgroup_mma_wait(1, deps=(s,))
                mbarrier.arrive(k_empty.index(cur), count=1)
                part = None
                if SPARSE[0] is not None:
                    # the step's bits if its block is partial, loaded here rather than under QK^T: held
                    # across the wait beside S, O and P, they spilled 45 more words a thread at d = 128
                    part = partial_bits(SPARSE, at, full, j, WG * HALF_M, HALF_M, BLOCK_M, BLOCK_N)
                p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, offs_q, n_start + j * BLOCK_N, len_k,
                                                  tile_scores, slope, diag, diag_r, diag_l, unmasked_from,
                                                  unmasked_to, s_layout, BLOCK_N, TREES, part=part)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(v_empty.index(prev), count=1)
                # the PV just finished was in the previous max's units
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            if HALF_DIAG:
                if halves(n_start, n_k, row0, diag_r, BLOCK_N):
                    acc, m_i, l_i = half_last_step(q_smem, qi, p, acc, m_i, l_i, k_smem, v_smem, k_ready,
                                                    k_empty, v_ready, v_empty, c + n_k - 1,
                                                    n_start + (n_k - 1) * BLOCK_N, offs_q, len_k, tile_scores,
                                                    slope, diag, diag_r, diag_l, unmasked_from, unmasked_to,
                                                    s_layout, p_layout, STAGES, BLOCK_N, HEAD_DIM, HEAD_DIM_V,
                                                    TREES)
                else:
                    acc = last_pv(p, acc, v_smem, v_ready, v_empty, c + n_k - 1, p_layout, STAGES, BLOCK_N,
                                   HEAD_DIM_V)
            else:
                acc = last_pv(p, acc, v_smem, v_ready, v_empty, c + n_k - 1, p_layout, STAGES, BLOCK_N,
                               HEAD_DIM_V)
        elif DEFER_RELEASE:
            release_q(q_empty, i)
        c += n_k

        l_tot = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, s_layout))
        if SINK is not None:
            # the sink is one more logit in every row's denominator, with no value
            if PACK > 1:
                sink = gl.load(SINK + off_h + gl.minimum(heads, GROUP - 1)) * LOG2E
            else:
                sink = gl.load(SINK + off_h) * LOG2E
            m_fin = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_fin)
            l_tot = l_tot * alpha + gl.exp2(sink - m_fin)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            m_i = m_fin
        # rows that saw no key: out = 0 and lse = +inf (flash_attn's convention; with a sink, lse = sink)
        seen = l_tot > 0.0
        l_safe = gl.where(seen, l_tot, 1.0)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        if V_SCALE is not None:
            out = out * gl.load(V_SCALE + off_b * stride_vsb + off_hk * stride_vsh)
        if CU_Q is not None:
            # the (nheads, total_q) LSE of the packed layout
            lse_ptrs = LSE + (off_h + heads).to(gl.int64) * stride_lse_h + q_start + offs_q
            gl.store(lse_ptrs, lse, mask=(offs_q < len_q) & (heads < GROUP))
        else:
            lse_rows = LSE + off_b.to(gl.int64) * stride_lse_b
            lse_ptrs = lse_rows + (off_h + heads).to(gl.int64) * stride_lse_h + offs_q
            gl.store(lse_ptrs, lse, mask=(offs_q < len_q) & (heads < GROUP))
        # the Q rows are no longer read: their shared memory stages O for the TMA store, which clips rows
        # past seqlen_q; the buffer returns to the loader once the store has read it. DEFER_RELEASE waits
        # for that under the next tile's first QK^T instead of here (the loader needs the buffer back only
        # for the tile after that). An O narrower than Q takes the buffer's first bytes in O's layout: a wide
        # tile's shared layout holds its 64-column (128-byte swizzle) chunks one after another, so O over Q's
        # chunks is the same bytes whether Q came as one tile or as chunks
        if o_smem is not None:
            # FP8: a 16-bit O has twice Q's bytes, so it has buffers of its own; the previous tile's store
            # from this one has completed (release_q, or the wait below, waited for it)
            o_buf = o_smem.index(WG)
        else:
            q_buf = q_smem.index(qi * NCH)
            o_buf = q_buf
            if HEAD_DIM_V != HEAD_DIM:
                o_buf = q_buf._reinterpret(dtype, o_desc.block_type.shape, o_desc.layout)
        o_tile = o_buf.reshape([HALF_M, HEAD_DIM_V])
        o_tile.store(out.to(o_desc.dtype))
        first = row0 // PACK  # the warpgroup's first position
        if CU_Q is not None and (row0 + HALF_M - 1) // PACK >= len_q:
            # the sequence ends inside this warpgroup's rows, and a TMA store would write the next
            # sequence's: the rows inside go from the staging buffer by masked stores
            store_rows(o_tile, O, q_start + first, len_q - first, off_h, stride_om, stride_oh, d_v, PACK,
                       GROUP)
        else:
            # varlen: the packed tensors' descriptor has one batch (q_start is 0 in the padded layout)
            desc_b = 0 if CU_Q is not None else off_b
            fence_async_shared()
            if PACK > 1:
                # O as (batch, seqlen, heads_k, the group, dv): the store clips the padded group's rows
                tma.async_copy_shared_to_global(o_desc, [desc_b, q_start + first, off_hk, row0 % PACK, 0],
                                                o_buf)
            else:
                tma.async_copy_shared_to_global(o_desc, [desc_b, q_start + first, off_h, 0], o_buf)
        if not DEFER_RELEASE:
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(qb), count=1)
        i += 1
        t, b = next_tile(tile_smem, tile_ready, i)
    if DEFER_RELEASE:
        release_q(q_empty, i)


@gluon.jit
def _consumer0(args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               DEFER_RELEASE: gl.constexpr, HALF_DIAG: gl.constexpr, TREES: gl.constexpr,
               PACK: gl.constexpr, QK_AHEAD: gl.constexpr):
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG, TREES, PACK,
              QK_AHEAD, 0)


@gluon.jit
def _consumer1(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               DEFER_RELEASE: gl.constexpr, HALF_DIAG: gl.constexpr, TREES: gl.constexpr,
               PACK: gl.constexpr, QK_AHEAD: gl.constexpr):
    # a worker partition: the loader's arguments first
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG, TREES, PACK,
              QK_AHEAD, 1)


@gluon.jit
def _consumer2(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               DEFER_RELEASE: gl.constexpr, HALF_DIAG: gl.constexpr, TREES: gl.constexpr,
               PACK: gl.constexpr, QK_AHEAD: gl.constexpr):
    # the third consumer warpgroup of 192-row tiles
    _consumer(args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG, TREES, PACK,
              QK_AHEAD, 2)


@gluon.jit
def attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, stride_lse_b, stride_lse_h,
    nheads, seqlen_q, seqlen_k, qk_scale, n_bh, lpt_group, left, right, cap_in, cap_out, tile_counter, ALIBI,
    stride_alibi_b, SINK, CU_Q, CU_K, PLAN, O, stride_om, stride_oh, d_v, PAGES, stride_pages, num_pages,
    page_size, page_cap,
    Q_SCALE, K_SCALE, V_SCALE, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    q_scale_group, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_BITS, Q_ORDER, mask_b, mask_h, n_qblocks,
    max_full, max_part, sparse_n, subs, row_bytes,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, DEFER_RELEASE: gl.constexpr = False,
    HALF_DIAG: gl.constexpr = False, TREES: gl.constexpr = 3,  # bit 0: the max's tree, 1: the sums'
    Q_BUFS: gl.constexpr = 2, PACK: gl.constexpr = 1, QK_AHEAD: gl.constexpr = False,
):
    # options, None when off: left / right, the window's sides (CAUSAL: right = 0, and `right` is None);
    # cap_in = softmax_scale / softcap, cap_out = softcap / ln 2; ALIBI: float32 slopes at b · stride_alibi_b
    # + h; SINK: float32 (nheads,) logits. Varlen: CU_Q, CU_K the sequences' offsets in the packed tensors
    # (whose descriptors have one batch), PLAN the query tiles before each sequence (kernels/triton/tiles.py;
    # its last entry, times nheads, is the work), O with its row and head strides and its head dim d_v (O's
    # tile may be wider: TMA pads V with zeros) for the rows of a sequence's last tile; seqlen_q and seqlen_k
    # are then the packed tensors' rows, into which each sequence
    # is clamped (common.seq_bounds, as in the Triton kernels).
    # Paged keys (varlen only; None when off): k_desc / v_desc over page pools (num_pages, page_size,
    # heads_k, d), sequence b's key p in page PAGES[b · stride_pages + p // page_size] at row p % page_size,
    # page_cap = the table's pages per sequence · page_size bounding each sequence's keys, and BLOCK_N
    # dividing page_size (a key tile lies in one page: fwd_loader.py)
    # FP8: Q_SCALE, K_SCALE, V_SCALE float32 descales at b · stride_*sb + head · stride_*sh (q's head divided
    # by q_scale_group), v_desc over V as (batch, heads_k, dv, seqlen) with [1, 1, dv, BLOCK_N] blocks
    # Block-sparse (None when off): FULL_NUM .. row_bytes, a BlockMaskKernelTensors' lists, bits and launch
    # order with its dims (sparse.py's tuple, gluon.sparse_args)
    gl.static_assert(not HALF_DIAG or CAUSAL or right is not None, "the half step needs a right edge")
    # an FP8 V is K-major: the half step would slice its tiles through their swizzled rows
    gl.static_assert(not HALF_DIAG or q_desc.dtype.primitive_bitwidth != 8, "no half step with FP8")
    # O is staged in Q's buffer (FP8: its own): its head dim (V's) at most Q's
    gl.static_assert(o_desc.block_type.shape[4 if PACK > 1 else 3] <= HEAD_DIM)
    # the flags go to the partitions inline: a tuple bound to a name holds tensors, not constexprs
    # two consumer warpgroups of 64 rows, or three (BLOCK_M = 192, FA3's choice at d = 64). Three
    # have 160 registers each (ptxas holds each partition to its setmaxnreg share): not enough for QK^T, P and
    # O in flight at once, so they run serial steps
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    gl.static_assert((CONSUMERS == 2) | (CONSUMERS == 3))
    # PACK > 1 (FA3's pack_gqa, schedule.tile): q_desc and o_desc are over (batch, seqlen, heads_k, the
    # group, d) views, each warpgroup's tile HALF_M // PACK positions x PACK heads of the group (PACK: GROUP
    # padded to a power of two), or HALF_M heads of one position where PACK is larger (padded layout only:
    # a varlen sequence's last rows are stored a position's heads at a time); nheads and n_bh count kv
    # heads. 16-bit, no half step (its halves assume one row a position)
    gl.static_assert((PACK == 1) or ((not HALF_DIAG) and q_desc.dtype.primitive_bitwidth == 16
                                     and (CU_Q is None or PACK <= HALF_M)))
    # a block-sparse mask (sparse.py; None when off): the padded layout, two consumers of one query block
    # (BLOCK_M rows: the mask's block), no band and no half step (its lists stand for both), a head a tile
    gl.static_assert((FULL_NUM is None) or ((CU_Q is None) and (CONSUMERS == 2) and (not CAUSAL)
                                            and (not HALF_DIAG) and (PACK == 1)))
    # QK_AHEAD holds two S tiles beside O: two consumers' 240 registers, and none of the steps apart
    gl.static_assert((not QK_AHEAD) or ((CONSUMERS == 2) and (not HALF_DIAG) and (FULL_NUM is None)))
    if CU_Q is not None:
        n_work = gl.load(PLAN + n_bh // nheads) * nheads
    else:
        n_work = gl.cdiv(seqlen_q * PACK, BLOCK_M) * n_bh

    dtype: gl.constexpr = q_desc.dtype
    # Q_BUFS query tiles (2: the current one and the next one's prefetch; 1 where shared memory is short,
    # the next tile's Q then loading once this one's O is stored) x the consumers' rows x the column chunks
    # of Q and K: HEAD_DIM // the descriptors' width (3 at d = 192, else 1)
    NCH: gl.constexpr = HEAD_DIM // k_desc.block_type.shape[3]
    gl.static_assert(NCH * k_desc.block_type.shape[3] == HEAD_DIM)
    # DEFER_RELEASE returns a Q buffer under the next tile's first QK^T, which needs the next tile's Q loaded
    gl.static_assert((Q_BUFS == 2) | ((Q_BUFS == 1) & (not DEFER_RELEASE)))
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * CONSUMERS * NCH] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * NCH] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    # the work item of each Q buffer, written by the loader (tile_counter's scheduling), with its sequence
    # under varlen
    tile_smem = gl.allocate_shared_memory(gl.int32, [2 if CU_Q is None else 4, 1],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
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
    sparse = (FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_BITS, Q_ORDER, mask_b, mask_h, n_qblocks, max_full,
              max_part, sparse_n, subs, row_bytes)
    problem = (nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter, left, right, CU_Q, CU_K,
               PLAN, page_cap, sparse)
    features = ((qk_scale, cap_in, cap_out), ALIBI, stride_alibi_b, SINK)

    if Q_SCALE is not None:
        # FP8: O's staging buffers of their own
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        fp8 = (o_smem, Q_SCALE, K_SCALE, V_SCALE, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb,
               stride_vsh, q_scale_group)
    else:
        # None in place of the buffers: a tuple takes a None argument (a constexpr), not a None literal
        fp8 = (Q_SCALE, Q_SCALE, K_SCALE, V_SCALE, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb,
               stride_vsh, q_scale_group)
    args = (o_desc, q_smem, k_smem, v_smem, tile_smem, bars, LSE, stride_lse_b, stride_lse_h, features,
            problem, (O, stride_om, stride_oh, d_v), fp8)
    loader_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_smem, bars, problem,
                   (PAGES, stride_pages, num_pages, page_size))
    if CONSUMERS == 2:
        # registers: the launch's maxnreg (168 x 12 warps fills the register file) moved by setmaxnreg to 240
        # per consumer thread and 24 for the loader's
        gl.warp_specialize([
            (_consumer0, (args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG,
                          TREES, PACK, QK_AHEAD)),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE,
                          HALF_DIAG, TREES, PACK, QK_AHEAD)),
            (loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, PACK)),
        ], [4, 1], [240, 24])
    else:
        # 128 x 16 warps fills the register file: 160 for the two worker consumers, 24 for the loader, and
        # what is left (168) for the default partition's consumer
        gl.warp_specialize([
            (_consumer0, (args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE, HALF_DIAG,
                          TREES, PACK, QK_AHEAD)),
            (_consumer1, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE,
                          HALF_DIAG, TREES, PACK, QK_AHEAD)),
            (_consumer2, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, DEFER_RELEASE,
                          HALF_DIAG, TREES, PACK, QK_AHEAD)),
            (loader, (args, loader_args, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM, GROUP, CAUSAL, PACK)),
        ], [4, 4, 1], [160, 160, 24])
