"""Block-sparse drivers of the attention kernels: the same tile bodies as attn_fwd.py / attn_bwd.py, but each
program walks the block lists of a flashattn.BlockMask instead of a contiguous key (or query) range, so the
K/V (or Q/dO) tiles of empty blocks are never loaded.

Mask tensors (the kernel contract in flashattn/masks/_kernel.py, all contiguous): a (batch, head) slab of the
mask is slab = (b % MB)·MH + h % MH (MB, MH are 1 when the mask broadcasts). Full blocks need no predicate.
Partial blocks get their element predicate one of two ways (PART_BY): 1, from a (SPARSE_M, SPARSE_N / 8)
bitmask (any mask); 2, computed in the kernel from the mask's rule (causal, sliding-window and local +
global masks: a window around the diagonal, plus global tokens), which skips the bitmask loads. Kernel
tiles subdivide mask blocks: BLOCK_M divides SPARSE_M and BLOCK_N divides SPARSE_N.

Grids are 1D over (batch·heads) x tiles (_program): the first `hoist` tiles of every head run first, heads
interleaved, then the rest head by head; tile t of a head takes the (t // subtiles)-th block of the mask's
launch order (q_order / k_order: longest block lists first). So the heaviest programs of every head (a
local + global mask's global-token rows) start at once, and the rest keep the head-major order that lets
concurrent programs share their head's K/V (or Q/dO) in L2. The backward is one kernel with two roles
(sparse_bwd_kernel), launched once for its dK/dV programs and once for its dQ programs.
"""

import triton
import triton.language as tl

from flashattn.kernels.triton.attn_bwd import _dkdv_tile, _dq_tile
from flashattn.kernels.triton.attn_fwd import _fwd_tile, fwd_finish
from flashattn.kernels.triton.common import LOG2E, load_tile, store_tile


@triton.jit
def _first_tile(idx_base, num, SPARSE: tl.constexpr):
    """Start row of the first tile of the block list idx_base[0:num] (0 when it is empty)."""
    return tl.load(idx_base, mask=num > 0, other=0) * SPARSE


@triton.jit
def _next_tile(start, j, idx_base, num, SUBS: tl.constexpr, SPARSE: tl.constexpr, BLOCK: tl.constexpr):
    """Start row of flat iteration j + 1 from iteration j's: the next tile of the same block, or the first of
    the next listed block. Carried from one iteration to the next (as flex does), so the addresses of the
    next tiles are known before their iteration and the pipeliner can prefetch them; an index loaded inside
    the iteration that uses it leaves the tile loads waiting on it."""
    i_next = (j + 1) // SUBS
    nb_next = tl.load(idx_base + i_next, mask=i_next < num, other=0)
    return tl.where((j + 1) % SUBS == 0, nb_next * SPARSE, start + BLOCK)


@triton.jit
def _program(pid, n_bh, n_tiles, hoist):
    """(batch·head, tile) of program pid: the first n_bh·hoist programs take tiles [0, hoist) of every head,
    heads fastest; the others the remaining tiles head by head (hoist < n_tiles)."""
    lead = n_bh * hoist
    rest = pid - lead
    bh = tl.where(pid < lead, pid % n_bh, rest // (n_tiles - hoist))
    tile = tl.where(pid < lead, pid // n_bh, hoist + rest % (n_tiles - hoist))
    return bh, tile


@triton.jit
def _ordered_tile(order_base, tile, SPARSE: tl.constexpr, BLOCK: tl.constexpr):
    """(block, start row) of program `tile`: its mask block from the launch order, and its sub-tile."""
    block = tl.load(order_base + tile // (SPARSE // BLOCK))
    return block, block * SPARSE + (tile % (SPARSE // BLOCK)) * BLOCK


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, offs_dv, seqlen_k,
                qk_scale, cap_in, cap_out, rng_seed, rng_offset, rng_row_base, dropout_p,
                idx_base, num, bits_base, row0, rule_diag, rule_left, rule_right, rule_glob,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, PART_BY: tl.constexpr,
                RULE_LEFT: tl.constexpr, RULE_RIGHT: tl.constexpr, RULE_GLOBAL: tl.constexpr,
                RULE_GLOBAL_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax over the key blocks idx_base[0:num]: full ones (PART_BY 0), partial ones with their
    bitmasks (1) or with the mask's rule (2)."""
    SUBS: tl.constexpr = SPARSE_N // BLOCK_N
    # one flat loop over (block, kernel tile) pairs: Triton pipelines only innermost loops, and a nested loop
    # of SUBS = 2 tiles would drain the pipeline at every block
    start_n = _first_tile(idx_base, num, SPARSE_N)
    for j in range(num * SUBS):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv,
            seqlen_k, rule_diag, rule_left, rule_right, qk_scale, cap_in, cap_out, 0.0, rng_seed, rng_offset,
            rng_row_base, seqlen_k, dropout_p, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PART_BY == 2,
            RULE_LEFT, RULE_RIGHT, HAS_SOFTCAP, False, HAS_DROPOUT, DOT_PREC,
            bits_base + (j // SUBS) * (SPARSE_M * SPARSE_N // 8), row0, start_n // SPARSE_N * SPARSE_N,
            SPARSE_N // 8, PART_BY == 1, glob=rule_glob, HAS_GLOBAL=RULE_GLOBAL,
            GLOBAL_CAUSAL=RULE_GLOBAL_CAUSAL,
        )
        start_n = _next_tile(start_n, j, idx_base, num, SUBS, SPARSE_N, BLOCK_N)
    return acc, l_i, m_i


@triton.jit
def sparse_fwd_kernel(
    Q, K, V, O, LSE, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_BITS, Q_ORDER,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh,
    nheads, seqlen_q, seqlen_k, qk_scale, cap_in, cap_out, dropout_p, rng_seed, rng_offset,
    MB, MH, n_qblocks, max_full, max_part, rule_diag, rule_left, rule_right, rule_glob, n_bh, n_tiles, hoist,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr,
    SPARSE_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
    PART_BY: tl.constexpr, RULE_LEFT: tl.constexpr, RULE_RIGHT: tl.constexpr, RULE_GLOBAL: tl.constexpr,
    RULE_GLOBAL_CAUSAL: tl.constexpr,
):
    off_bh, tile = _program(tl.program_id(0), n_bh, n_tiles, hoist)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    slab = ((off_b % MB) * MH + off_h % MH).to(tl.int64)
    mq, start_m = _ordered_tile(Q_ORDER + slab * n_qblocks, tile, SPARSE_M, BLOCK_M)
    if start_m >= seqlen_q:
        return
    off_b64 = off_b.to(tl.int64)
    off_h64 = off_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + off_b64 * stride_qb + off_h64 * stride_qh, offs_m, offs_d, stride_qm, seqlen_q,
                  HEAD_DIM, BLOCK_D, True)
    k_base = K + off_b64 * stride_kb + (off_h64 // GROUP) * stride_kh
    v_base = V + off_b64 * stride_vb + (off_h64 // GROUP) * stride_vh
    row = slab * n_qblocks + mq
    rng_row_base = off_bh.to(tl.int64) * seqlen_q
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # -- full blocks first: no predicate; then the partial ones (bitmasks or the rule)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, offs_dv, seqlen_k, qk_scale,
        cap_in, cap_out, rng_seed, rng_offset, rng_row_base, dropout_p, FULL_IDX + row * max_full,
        tl.load(FULL_NUM + row), PART_BITS, mq * SPARSE_M, rule_diag, rule_left, rule_right, rule_glob,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, SPARSE_M, SPARSE_N, HAS_SOFTCAP, HAS_DROPOUT, 0,
        RULE_LEFT, RULE_RIGHT, RULE_GLOBAL, RULE_GLOBAL_CAUSAL, DOT_PREC,
    )
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, offs_dv, seqlen_k, qk_scale,
        cap_in, cap_out, rng_seed, rng_offset, rng_row_base, dropout_p, PART_IDX + row * max_part,
        tl.load(PART_NUM + row), PART_BITS + row * max_part * (SPARSE_M * SPARSE_N // 8), mq * SPARSE_M,
        rule_diag, rule_left, rule_right, rule_glob, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV,
        SPARSE_M, SPARSE_N, HAS_SOFTCAP, HAS_DROPOUT, PART_BY, RULE_LEFT, RULE_RIGHT, RULE_GLOBAL,
        RULE_GLOBAL_CAUSAL, DOT_PREC,
    )
    out, lse = fwd_finish(acc, l_i, m_i, 0.0, dropout_p, False, HAS_DROPOUT)
    tl.store(LSE + off_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    store_tile(O + off_b64 * stride_ob + off_h64 * stride_oh, out, offs_m, offs_dv, stride_om, seqlen_q,
               HEAD_DIM_V)


@triton.jit
def _dkdv_program(
    pid, Q, K, V, DO, LSE, Delta, DK, DV,
    Q_FULL_NUM, Q_FULL_IDX, Q_PART_NUM, Q_PART_IDX, Q_PART_SLOT, PART_BITS, K_ORDER,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
    nheads, nheads_k, seqlen_q, seqlen_k, qk_scale, cap_in, cap_out, dropout_p, rng_seed, rng_offset,
    sm_scale, MB, MH, n_qblocks, n_kblocks, max_part, max_qfull, max_qpart,
    rule_diag, rule_left, rule_right, rule_glob, n_bh, n_tiles, hoist,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr,
    SPARSE_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
    PART_BY: tl.constexpr, RULE_LEFT: tl.constexpr, RULE_RIGHT: tl.constexpr, RULE_GLOBAL: tl.constexpr,
    RULE_GLOBAL_CAUSAL: tl.constexpr,
):
    """dK, dV of one key tile (program pid of the dK/dV role) over the query blocks that see it."""
    off_bhk, tile = _program(pid, n_bh, n_tiles, hoist)
    off_b = off_bhk // nheads_k
    off_hk = off_bhk % nheads_k
    # the launch order of the group's first query head (any permutation is correct; this one is its LPT)
    slab0 = ((off_b % MB) * MH + (off_hk * GROUP) % MH).to(tl.int64)
    nk, start_n = _ordered_tile(K_ORDER + slab0 * n_kblocks, tile, SPARSE_N, BLOCK_N)
    if start_n >= seqlen_k:
        return
    off_b64 = off_b.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K + off_b64 * stride_kb + off_hk * stride_kh, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM,
                  BLOCK_D, True)
    v = load_tile(V + off_b64 * stride_vb + off_hk * stride_vh, offs_n, offs_dv, stride_vn, seqlen_k,
                  HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    SUBS: tl.constexpr = SPARSE_M // BLOCK_M
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        q_base = Q + off_b64 * stride_qb + off_h * stride_qh
        do_base = DO + off_b64 * stride_dob + off_h * stride_doh
        row_base = (off_b64 * nheads + off_h) * seqlen_q
        slab = ((off_b % MB) * MH + off_h % MH).to(tl.int64)
        col = slab * n_kblocks + nk
        # -- query blocks that see this key block fully (flat loops of (block, tile) pairs, see _fwd_blocks)
        num = tl.load(Q_FULL_NUM + col)
        start_m = _first_tile(Q_FULL_IDX + col * max_qfull, num, SPARSE_M)
        for j in range(num * SUBS):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, 0, 0, 0,
                qk_scale, cap_in, cap_out, 0.0, rng_seed, rng_offset, row_base, seqlen_k, dropout_p,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, False, False, False, HAS_SOFTCAP, False,
                HAS_DROPOUT, DOT_PREC,
            )
            start_m = _next_tile(start_m, j, Q_FULL_IDX + col * max_qfull, num, SUBS, SPARSE_M, BLOCK_M)
        # -- partially: by the rule, or by the bitmask of the pair (mb, nk), in slot q_part_slot of query
        # block mb's list
        num = tl.load(Q_PART_NUM + col)
        start_m = _first_tile(Q_PART_IDX + col * max_qpart, num, SPARSE_M)
        for j in range(num * SUBS):
            mb = start_m // SPARSE_M
            if PART_BY == 1:
                slot = tl.load(Q_PART_SLOT + col * max_qpart + j // SUBS)
                bits = PART_BITS + ((slab * n_qblocks + mb) * max_part + slot) * (SPARSE_M * SPARSE_N // 8)
            else:
                bits = PART_BITS
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, rule_diag, rule_left, rule_right,
                qk_scale, cap_in, cap_out, 0.0, rng_seed, rng_offset, row_base, seqlen_k, dropout_p,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, PART_BY == 2, RULE_LEFT, RULE_RIGHT,
                HAS_SOFTCAP, False, HAS_DROPOUT, DOT_PREC, bits, mb * SPARSE_M, nk * SPARSE_N, SPARSE_N // 8,
                PART_BY == 1, glob=rule_glob, HAS_GLOBAL=RULE_GLOBAL, GLOBAL_CAUSAL=RULE_GLOBAL_CAUSAL,
            )
            start_m = _next_tile(start_m, j, Q_PART_IDX + col * max_qpart, num, SUBS, SPARSE_M, BLOCK_M)
    store_tile(DK + off_b64 * stride_dkb + off_hk * stride_dkh, dk * sm_scale, offs_n, offs_d, stride_dkn,
               seqlen_k, HEAD_DIM)
    store_tile(DV + off_b64 * stride_dvb + off_hk * stride_dvh, dv, offs_n, offs_dv, stride_dvn, seqlen_k,
               HEAD_DIM_V)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, offs_dv, seqlen_k,
               qk_scale, cap_in, cap_out, rng_seed, rng_offset, rng_row_base, dropout_p,
               idx_base, num, bits_base, row0, rule_diag, rule_left, rule_right, rule_glob,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, PART_BY: tl.constexpr,
               RULE_LEFT: tl.constexpr, RULE_RIGHT: tl.constexpr, RULE_GLOBAL: tl.constexpr,
               RULE_GLOBAL_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)  # unused: block-sparse attention has no sink
    SUBS: tl.constexpr = SPARSE_N // BLOCK_N
    start_n = _first_tile(idx_base, num, SPARSE_N)
    for j in range(num * SUBS):  # flat, the next tile's start carried: see _fwd_blocks, _next_tile
        dq, pdp = _dq_tile(
            dq, pdp, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn,
            start_n, offs_m, offs_d, offs_dv, seqlen_k, rule_diag, rule_left, rule_right, qk_scale,
            cap_in, cap_out, 0.0, rng_seed, rng_offset, rng_row_base, seqlen_k, dropout_p, HEAD_DIM,
            HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, PART_BY == 2, RULE_LEFT, RULE_RIGHT, HAS_SOFTCAP, False,
            HAS_DROPOUT, False, DOT_PREC, bits_base + (j // SUBS) * (SPARSE_M * SPARSE_N // 8), row0,
            start_n // SPARSE_N * SPARSE_N, SPARSE_N // 8, PART_BY == 1, glob=rule_glob,
            HAS_GLOBAL=RULE_GLOBAL, GLOBAL_CAUSAL=RULE_GLOBAL_CAUSAL,
        )
        start_n = _next_tile(start_n, j, idx_base, num, SUBS, SPARSE_N, BLOCK_N)
    return dq


@triton.jit
def _dq_program(
    pid, Q, K, V, DO, LSE, Delta, DQ, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_BITS, Q_ORDER,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
    nheads, seqlen_q, seqlen_k, qk_scale, cap_in, cap_out, dropout_p, rng_seed, rng_offset, sm_scale,
    MB, MH, n_qblocks, max_full, max_part, rule_diag, rule_left, rule_right, rule_glob, n_bh, n_tiles, hoist,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr,
    SPARSE_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
    PART_BY: tl.constexpr, RULE_LEFT: tl.constexpr, RULE_RIGHT: tl.constexpr, RULE_GLOBAL: tl.constexpr,
    RULE_GLOBAL_CAUSAL: tl.constexpr,
):
    """dQ of one query tile (program pid of the dQ role) over its key blocks."""
    off_bh, tile = _program(pid, n_bh, n_tiles, hoist)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    slab = ((off_b % MB) * MH + off_h % MH).to(tl.int64)
    mq, start_m = _ordered_tile(Q_ORDER + slab * n_qblocks, tile, SPARSE_M, BLOCK_M)
    if start_m >= seqlen_q:
        return
    off_b64 = off_b.to(tl.int64)
    off_h64 = off_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + off_b64 * stride_qb + off_h64 * stride_qh, offs_m, offs_d, stride_qm, seqlen_q,
                  HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + off_b64 * stride_dob + off_h64 * stride_doh, offs_m, offs_dv, stride_dom, seqlen_q,
                   HEAD_DIM_V, BLOCK_DV, True)
    row_base = off_bh.to(tl.int64) * seqlen_q
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_base = K + off_b64 * stride_kb + (off_h64 // GROUP) * stride_kh
    v_base = V + off_b64 * stride_vb + (off_h64 // GROUP) * stride_vh
    row = slab * n_qblocks + mq
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, offs_dv,
                    seqlen_k, qk_scale, cap_in, cap_out, rng_seed, rng_offset, row_base, dropout_p,
                    FULL_IDX + row * max_full, tl.load(FULL_NUM + row), PART_BITS, mq * SPARSE_M, rule_diag,
                    rule_left, rule_right, rule_glob, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D,
                    BLOCK_DV, SPARSE_M, SPARSE_N, HAS_SOFTCAP, HAS_DROPOUT, 0, RULE_LEFT, RULE_RIGHT,
                    RULE_GLOBAL, RULE_GLOBAL_CAUSAL, DOT_PREC)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, offs_dv,
                    seqlen_k, qk_scale, cap_in, cap_out, rng_seed, rng_offset, row_base, dropout_p,
                    PART_IDX + row * max_part, tl.load(PART_NUM + row),
                    PART_BITS + row * max_part * (SPARSE_M * SPARSE_N // 8), mq * SPARSE_M, rule_diag,
                    rule_left, rule_right, rule_glob, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D,
                    BLOCK_DV, SPARSE_M, SPARSE_N, HAS_SOFTCAP, HAS_DROPOUT, PART_BY, RULE_LEFT, RULE_RIGHT,
                    RULE_GLOBAL, RULE_GLOBAL_CAUSAL, DOT_PREC)
    store_tile(DQ + off_b64 * stride_dqb + off_h64 * stride_dqh, dq * sm_scale, offs_m, offs_d, stride_dqm,
               seqlen_q, HEAD_DIM)


@triton.jit
def sparse_bwd_kernel(
    Q, K, V, DO, LSE, Delta, DQ, DK, DV,
    KV_FULL_NUM, KV_FULL_IDX, KV_PART_NUM, KV_PART_IDX, PART_BITS, Q_ORDER,
    Q_FULL_NUM, Q_FULL_IDX, Q_PART_NUM, Q_PART_IDX, Q_PART_SLOT, K_ORDER,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
    nheads, nheads_k, seqlen_q, seqlen_k, qk_scale, cap_in, cap_out, dropout_p, rng_seed, rng_offset,
    sm_scale, MB, MH, n_qblocks, n_kblocks, max_full, max_part, max_qfull, max_qpart,
    rule_diag, rule_left, rule_right, rule_glob, kv_bh, kv_tiles, kv_hoist, q_bh, q_tiles, q_hoist,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr,
    DQ_BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr, PART_BY: tl.constexpr, RULE_LEFT: tl.constexpr,
    RULE_RIGHT: tl.constexpr, RULE_GLOBAL: tl.constexpr, RULE_GLOBAL_CAUSAL: tl.constexpr,
    ROLE_DKDV: tl.constexpr,
):
    """dK/dV programs of key tiles (ROLE_DKDV) or dQ programs of query tiles: one body, one launch per role.
    Both roles in one grid (flex's layout) measured within noise of two launches, but the dense backward's
    version of it failed with a timing-dependent misaligned address on the H200."""
    pid = tl.program_id(0)
    if ROLE_DKDV:
        _dkdv_program(
            pid, Q, K, V, DO, LSE, Delta, DK, DV, Q_FULL_NUM, Q_FULL_IDX, Q_PART_NUM, Q_PART_IDX, Q_PART_SLOT,
            PART_BITS, K_ORDER, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
            stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
            stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
            nheads, nheads_k, seqlen_q, seqlen_k, qk_scale, cap_in, cap_out, dropout_p, rng_seed, rng_offset,
            sm_scale, MB, MH, n_qblocks, n_kblocks, max_part, max_qfull, max_qpart,
            rule_diag, rule_left, rule_right, rule_glob, kv_bh, kv_tiles, kv_hoist,
            GROUP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DKDV_BLOCK_M, DKDV_BLOCK_N, SPARSE_M, SPARSE_N,
            HAS_SOFTCAP, HAS_DROPOUT, DOT_PREC, PART_BY, RULE_LEFT, RULE_RIGHT, RULE_GLOBAL,
            RULE_GLOBAL_CAUSAL,
        )
    else:
        _dq_program(
            pid, Q, K, V, DO, LSE, Delta, DQ, KV_FULL_NUM, KV_FULL_IDX, KV_PART_NUM, KV_PART_IDX,
            PART_BITS, Q_ORDER, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
            stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm,
            stride_dqh, nheads, seqlen_q, seqlen_k, qk_scale, cap_in, cap_out, dropout_p, rng_seed,
            rng_offset, sm_scale, MB, MH, n_qblocks, max_full, max_part, rule_diag, rule_left, rule_right,
            rule_glob, q_bh, q_tiles, q_hoist,
            GROUP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N, SPARSE_M, SPARSE_N,
            HAS_SOFTCAP, HAS_DROPOUT, DOT_PREC, PART_BY, RULE_LEFT, RULE_RIGHT, RULE_GLOBAL,
            RULE_GLOBAL_CAUSAL,
        )
