"""Backward attention kernels: P is recomputed tile by tile from Q, K and the saved LSE, nothing N×N stored.

  attn_bwd_preprocess_kernel  D_i = rowsum(dO_i ∘ O_i)
  attn_bwd_kernel             two roles, one launch each, 1D grids (common.grouped_program orders them):
    _dkdv_program             one per (key tile, batch·kv head): dV += (P∘Z)ᵀ dO, dK += dSᵀ Q over the
                              query tiles of every query head in the GQA group (so the group sum is free)
    _dq_program               one per (query tile, batch·head): dQ += dS K
with Z the dropout keep mask scaled by 1/(1-p) (regenerated, never stored), dP = dO Vᵀ, dS = P ∘ (dP∘Z − D),
times 1 − tanh² under softcap. The softmax scale multiplies dK and dQ once, at the end.

No atomics: every gradient element is written by one program, so gradients are bitwise reproducible. dQ costs
a second pass that recomputes S and dP (7 matmuls in all, against 5 with atomic dQ), and is still faster than
the atomic variant on the H200 (docs/tuning-log.md).
"""

import triton
import triton.language as tl

from flashattn.kernels.triton.common import (
    LOG2E,
    bits_keep,
    dropout_keep,
    grouped_program,
    key_range,
    load_rows,
    load_tile,
    query_range,
    seq_bounds,
    store_tile,
    tile_scores,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    O, DO, Delta, CU_Q, DQ_ACC, LSE, LSE2, STATS_ROW0,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h,
    nheads, seqlen_q, delta_rows,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    GLUON: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # GLUON: the Gluon backward's inputs (kernels/gluon/attn_bwd.py). D goes with the LSE in base 2 (LSE2)
    # into its TMA-read stats planes, whose rows are padded to delta_rows >= seqlen_q (the padding rows get
    # D = 0 and LSE2 = 0: their Q and dO rows read as zeros, so they add nothing; varlen: sequence b's rows
    # start at 4 · STATS_ROW0[b], 16-byte aligned for the kernel's TMA, and the rows between sequences are
    # not written), and the float32 dQ buffer (contiguous like q: HEAD_DIM columns, BLOCK_D a power of two
    # covering them) is zeroed here, which saves a launch of its own: ~15-30 us of host time on the H200
    # machine. Otherwise D is shaped like the LSE (delta_rows = seqlen_q, ignored) and LSE, LSE2 and DQ_ACC
    # are not read. (A learnable sink's gradient is not taken from this D, the rounded output's rowsum with
    # dO: both backward kernels sum it from their float32 P and dP)
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = (off_bh % nheads).to(tl.int64)
    q_start, seqlen_q = seq_bounds(CU_Q, off_b, seqlen_q, IS_VARLEN)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row0 = q_start.to(tl.int64)
    off_b64 = off_b.to(tl.int64)
    o = load_tile(O + off_b64 * stride_ob + row0 * stride_om + off_h * stride_oh, offs_m, offs_d, stride_om,
                  seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
    do = load_tile(DO + off_b64 * stride_dob + row0 * stride_dom + off_h * stride_doh, offs_m, offs_d,
                   stride_dom, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    stats_row0 = row0
    if GLUON and IS_VARLEN:
        stats_row0 = 4 * tl.load(STATS_ROW0 + off_b).to(tl.int64)
    delta_offs = off_b64 * stride_delta_b + off_h * stride_delta_h + stats_row0 + offs_m
    # seqlen_q is this sequence's own length from here (varlen); the Gluon planes' padding rows get zeros
    n_rows = delta_rows if GLUON and not IS_VARLEN else seqlen_q
    tl.store(Delta + delta_offs, delta, mask=offs_m < n_rows)
    if GLUON:
        lse_offs = off_b64 * stride_lse_b + off_h * stride_lse_h + row0 + offs_m
        lse = tl.load(LSE + lse_offs, mask=offs_m < seqlen_q, other=0.0)
        tl.store(LSE2 + delta_offs, lse * LOG2E, mask=offs_m < n_rows)
        # q's rows: (b, sq) in the padded layout, the packed ones under varlen
        rows = ((row0 + offs_m) if IS_VARLEN else (off_b64 * seqlen_q + offs_m)) * nheads + off_h
        offs_dq = tl.arange(0, BLOCK_D)
        ptrs = DQ_ACC + rows[:, None] * HEAD_DIM + offs_dq[None, :]
        tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=(offs_m[:, None] < seqlen_q) & (offs_dq[None, :] < HEAD_DIM))


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
    start_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
    rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
    bits_base=None, bits_row0=0, bits_col0=0, BITS_BYTES: tl.constexpr = 1, MASK_BITS: tl.constexpr = False,
    glob=0, HAS_GLOBAL: tl.constexpr = False, GLOBAL_CAUSAL: tl.constexpr = False,
):
    # MASK_BITS: a partial block of a block-sparse mask, its predicate read from a bitmask (attn_sparse.py);
    # HAS_GLOBAL: the global tokens of a block-sparse local + global rule (tile_scores)
    # Q/dO come through pointer loads: with tensor descriptors the ptxas of Triton 3.6 crashed (SIGSEGV) on
    # this program at some lengths and head counts
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q, HEAD_DIM, BLOCK_D, True)
    # rows past seqlen_q get LSE = +inf, so their P is exactly 0 without a predicate
    lse = tl.load(lse_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # (BLOCK_N, d) x (d, BLOCK_M)
    if MASKED or HAS_SOFTCAP or HAS_ALIBI or MASK_BITS:
        s_t, t_t = tile_scores(qk_t, offs_m[None, :], offs_n[:, None], seqlen_k, diag, left, right, qk_scale,
                               cap_in, cap_out, slope, MASKED, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP,
                               HAS_ALIBI, False, glob, HAS_GLOBAL, GLOBAL_CAUSAL)
        if MASK_BITS:
            keep_t = bits_keep(bits_base, offs_m[None, :], offs_n[:, None], bits_row0, bits_col0, BITS_BYTES)
            s_t = tl.where(keep_t, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse[None, :])
    else:
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    do = load_tile(do_base, offs_m, offs_dv, stride_dom, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
    if HAS_DROPOUT:
        keep_t = dropout_keep(rng_seed, rng_offset, rng_row_base, offs_m[None, :], offs_n[:, None],
                              max_seqlen_k, dropout_p)
        pz_t = tl.where(keep_t, p_t * (1.0 / (1.0 - dropout_p)), 0.0)
    else:
        pz_t = p_t
    dv = tl.dot(pz_t.to(do.dtype), do, dv, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) x (BLOCK_M, dv)
    delta = tl.load(delta_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, dv) x (dv, BLOCK_M)
    if HAS_DROPOUT:
        dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - dropout_p)), 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) x (BLOCK_M, d)
    return dk, dv


@triton.jit
def _dkdv_program(
    pid, Q, K, V, DO, LSE, Delta, DK, DV, CU_Q, CU_K, ALIBI,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, nheads_k, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset, sm_scale, n_bh, lpt_group,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dK, dV of one key tile of one (batch, kv head): program pid of the dK/dV role."""
    off_bhk, rank = grouped_program(pid, n_bh, tl.cdiv(max_seqlen_k, BLOCK_N), lpt_group)
    # rank 0 is the first key tile, the one every query sees under causal masking
    start_n = rank * BLOCK_N
    off_b = off_bhk // nheads_k
    off_hk = off_bhk % nheads_k
    q_start, seqlen_q = seq_bounds(CU_Q, off_b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, off_b, seqlen_k, IS_VARLEN)
    if start_n >= seqlen_k:
        return
    off_b64 = off_b.to(tl.int64)
    q_row0 = q_start.to(tl.int64)
    k_row0 = k_start.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K + off_b64 * stride_kb + k_row0 * stride_kn + off_hk * stride_kh, offs_n, offs_d,
                  stride_kn, seqlen_k, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + off_b64 * stride_vb + k_row0 * stride_vn + off_hk * stride_vh, offs_n, offs_dv,
                  stride_vn, seqlen_k, HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    diag = seqlen_k - seqlen_q
    m_start, m_lo, m_hi, m_end = query_range(start_n, seqlen_q, diag, left, right, BLOCK_M, BLOCK_N,
                                             WINDOW_LEFT, WINDOW_RIGHT)
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        q_base = Q + off_b64 * stride_qb + q_row0 * stride_qm + off_h * stride_qh
        do_base = DO + off_b64 * stride_dob + q_row0 * stride_dom + off_h * stride_doh
        row_base = off_b64 * stride_lse_b + off_h * stride_lse_h + q_row0
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
        rng_row_base = (off_b64 * nheads + off_h) * max_seqlen_q
        # -- query tiles cut by the right edge / the diagonal
        for start_m in range(m_start, m_lo, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale, cap_in,
                cap_out, slope, rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, True, WINDOW_LEFT, WINDOW_RIGHT,
                HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PREC,
            )
        # -- query tiles that see the whole key tile
        for start_m in range(m_lo, tl.minimum(m_hi, m_end), BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale, cap_in,
                cap_out, slope, rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, False, WINDOW_LEFT, WINDOW_RIGHT,
                HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PREC,
            )
        # -- query tiles cut by the window's left edge
        for start_m in range(tl.maximum(m_hi, m_lo), m_end, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, diag, left, right, qk_scale, cap_in,
                cap_out, slope, rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, True, WINDOW_LEFT, WINDOW_RIGHT,
                HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PREC,
            )
    store_tile(DK + off_b64 * stride_dkb + k_row0 * stride_dkn + off_hk * stride_dkh, dk * sm_scale, offs_n,
               offs_d, stride_dkn, seqlen_k, HEAD_DIM)
    store_tile(DV + off_b64 * stride_dvb + k_row0 * stride_dvn + off_hk * stride_dvh, dv, offs_n, offs_dv,
               stride_dvn, seqlen_k, HEAD_DIM_V)


@triton.jit
def _dq_tile(
    dq, pdp, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn,
    start_n, offs_m, offs_d, offs_dv, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
    rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_PREC: tl.constexpr,
    bits_base=None, bits_row0=0, bits_col0=0, BITS_BYTES: tl.constexpr = 1, MASK_BITS: tl.constexpr = False,
    k_desc=None, v_desc=None, desc_b=0, desc_h=0, USE_TMA: tl.constexpr = False,
    glob=0, HAS_GLOBAL: tl.constexpr = False, GLOBAL_CAUSAL: tl.constexpr = False,
):
    # MASK_BITS: a partial block of a block-sparse mask, its predicate read from a bitmask (attn_sparse.py);
    # HAS_GLOBAL: the global tokens of a block-sparse local + global rule (tile_scores)
    # USE_TMA: K/V tiles come through tensor descriptors (load_rows), the padded layout only
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_BITS:
        k = load_tile(k_base, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D, True)
        v = load_tile(v_base, offs_n, offs_dv, stride_vn, seqlen_k, HEAD_DIM_V, BLOCK_DV, True)
    else:
        k = load_rows(k_base, k_desc, desc_b, desc_h, start_n, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM,
                      BLOCK_D, MASKED, USE_TMA)
        v = load_rows(v_base, v_desc, desc_b, desc_h, start_n, offs_n, offs_dv, stride_vn, seqlen_k,
                      HEAD_DIM_V, BLOCK_DV, MASKED, USE_TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N)
    if MASKED or HAS_SOFTCAP or HAS_ALIBI or MASK_BITS:
        s, t = tile_scores(qk, offs_m[:, None], offs_n[None, :], seqlen_k, diag, left, right, qk_scale,
                           cap_in, cap_out, slope, MASKED, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                           True, glob, HAS_GLOBAL, GLOBAL_CAUSAL)
        if MASK_BITS:
            keep = bits_keep(bits_base, offs_m[:, None], offs_n[None, :], bits_row0, bits_col0, BITS_BYTES)
            s = tl.where(keep, s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # (BLOCK_M, dv) x (dv, BLOCK_N)
    if HAS_DROPOUT:
        keep = dropout_keep(rng_seed, rng_offset, rng_row_base, offs_m[:, None], offs_n[None, :],
                            max_seqlen_k, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    if HAS_SINK:
        # D = Σ_j P dP in fp32, for the sink gradient: rowsum(dO∘O) would carry O's rounding to 16 bits
        pdp += tl.sum(p * dp, 1)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N) x (BLOCK_N, d)
    return dq, pdp


@triton.jit
def _dq_program(
    pid, Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K, ALIBI, SINK, DSINK_ROWS, K_DESC, V_DESC,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset, sm_scale, n_bh, lpt_group,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dQ (and the sink gradient's row shares) of one query tile of one (batch, head): program pid of the dQ
    role."""
    n_tiles = tl.cdiv(max_seqlen_q, BLOCK_M)
    off_bh, rank = grouped_program(pid, n_bh, n_tiles, lpt_group)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    q_start, seqlen_q = seq_bounds(CU_Q, off_b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, off_b, seqlen_k, IS_VARLEN)
    # rank 0 is the last query tile, the one with the most keys under causal masking
    start_m = (n_tiles - 1 - rank) * BLOCK_M
    if start_m >= seqlen_q:
        return
    off_b64 = off_b.to(tl.int64)
    off_h64 = off_h.to(tl.int64)
    off_hk64 = off_h64 // GROUP
    q_row0 = q_start.to(tl.int64)
    k_row0 = k_start.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + off_b64 * stride_qb + q_row0 * stride_qm + off_h64 * stride_qh, offs_m, offs_d,
                  stride_qm, seqlen_q, HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + off_b64 * stride_dob + q_row0 * stride_dom + off_h64 * stride_doh, offs_m, offs_dv,
                   stride_dom, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
    row_base = off_b64 * stride_lse_b + off_h64 * stride_lse_h + q_row0
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_base = K + off_b64 * stride_kb + k_row0 * stride_kn + off_hk64 * stride_kh
    v_base = V + off_b64 * stride_vb + k_row0 * stride_vn + off_hk64 * stride_vh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
    rng_row_base = off_bh.to(tl.int64) * max_seqlen_q

    diag = seqlen_k - seqlen_q
    n_start, n_lo, n_hi, n_end = key_range(start_m, seqlen_k, diag, left, right, BLOCK_M, BLOCK_N,
                                           WINDOW_LEFT, WINDOW_RIGHT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(n_start, tl.minimum(n_lo, n_end), BLOCK_N):
        dq, pdp = _dq_tile(dq, pdp, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start_n, offs_m,
                           offs_d, offs_dv, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
                           rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, WINDOW_LEFT, WINDOW_RIGHT,
                           HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HAS_SINK, DOT_PREC,
                           k_desc=K_DESC, v_desc=V_DESC, desc_b=off_b, desc_h=off_h // GROUP, USE_TMA=USE_TMA)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        dq, pdp = _dq_tile(dq, pdp, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start_n, offs_m,
                           offs_d, offs_dv, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
                           rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, WINDOW_LEFT, WINDOW_RIGHT,
                           HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HAS_SINK, DOT_PREC,
                           k_desc=K_DESC, v_desc=V_DESC, desc_b=off_b, desc_h=off_h // GROUP, USE_TMA=USE_TMA)
    for start_n in range(tl.maximum(n_hi, n_lo), n_end, BLOCK_N):
        dq, pdp = _dq_tile(dq, pdp, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start_n, offs_m,
                           offs_d, offs_dv, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
                           rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, WINDOW_LEFT, WINDOW_RIGHT,
                           HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HAS_SINK, DOT_PREC,
                           k_desc=K_DESC, v_desc=V_DESC, desc_b=off_b, desc_h=off_h // GROUP, USE_TMA=USE_TMA)
    store_tile(DQ + off_b64 * stride_dqb + q_row0 * stride_dqm + off_h64 * stride_dqh, dq * sm_scale, offs_m,
               offs_d, stride_dqm, seqlen_q, HEAD_DIM)
    if HAS_SINK:
        # this row's share of d loss / d sink = -P_sink · D (the softmax gradient of a logit with no value)
        p_sink = tl.math.exp2(tl.load(SINK + off_h) * LOG2E - lse)
        tl.store(DSINK_ROWS + row_base + offs_m, -p_sink * pdp, mask=offs_m < seqlen_q)


@triton.jit
def attn_bwd_kernel(
    Q, K, V, DO, LSE, Delta, DQ, DK, DV, CU_Q, CU_K, ALIBI, SINK, DSINK_ROWS, K_DESC, V_DESC,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    nheads, nheads_k, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset, sm_scale,
    batch, kv_group, q_group,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr, ROLE_DKDV: tl.constexpr,
    IS_VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dK/dV programs (ROLE_DKDV) or dQ programs: one body, launched once per role. Both roles in one launch
    failed on the H200 with a misaligned address at d=64, batch >= 2, 16+ heads, and passed under
    compute-sanitizer: a timing-dependent fault not understood, so each role has its own launch."""
    pid = tl.program_id(0)
    if ROLE_DKDV:
        _dkdv_program(
            pid, Q, K, V, DO, LSE, Delta, DK, DV, CU_Q, CU_K, ALIBI,
            stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
            stride_vb, stride_vn, stride_vh,
            stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh,
            stride_dvb, stride_dvn, stride_dvh, stride_lse_b, stride_lse_h, stride_alibi_b,
            nheads, nheads_k, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k,
            qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset, sm_scale,
            batch * nheads_k, kv_group, GROUP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
            DKDV_BLOCK_M, DKDV_BLOCK_N, IS_VARLEN, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, DOT_PREC,
        )
    else:
        _dq_program(
            pid, Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K, ALIBI, SINK, DSINK_ROWS, K_DESC, V_DESC,
            stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
            stride_vb, stride_vn, stride_vh,
            stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
            stride_lse_b, stride_lse_h, stride_alibi_b,
            nheads, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k,
            qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset, sm_scale,
            batch * nheads, q_group, GROUP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
            DQ_BLOCK_M, DQ_BLOCK_N, IS_VARLEN, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, HAS_SINK, DOT_PREC, USE_TMA,
        )
