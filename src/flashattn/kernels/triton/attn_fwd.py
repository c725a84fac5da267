"""Forward attention kernel: one program per (query tile, batch·head) in a 1D grid (common.grouped_program),
K/V tiles streamed through SRAM.

Invariants of the online softmax (base 2, the scale folded into the scores):
  m_i  running row max of the scores seen so far,
  l_i  sum of exp2(s - m_i) over those scores (dropout does not touch it: the LSE is of the undropped row),
  acc  sum of exp2(s - m_i)·keep·v.
Only O = acc / l_i / (1 - p) and LSE = (m_i + log2 l_i)·ln 2 reach HBM. Features are constexpr flags; a
disabled one compiles to nothing.

FP8 (inference): q, k, v in e4m3 with float32 descales (x = x_fp8 · descale, one per program's (batch, head)
or per tensor). Both products run on FP8 operands with fp32 accumulation: q·k's descales fold into the
score scale, P is rounded to e4m3 for P·V (its values lie in [0, 1]) and v's descale multiplies the output.
V is addressed with a column stride, so a V whose seqlen dim is contiguous (the K-major operand FP8 P·V
wants) is read in place.
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
    seq_bounds,
    store_tile,
    tile_scores,
)

LN2 = tl.constexpr(0.6931471805599453)  # the kernel works in base 2; LSE leaves it as a natural log


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
    start_n, offs_m, offs_d, offs_dv, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
    rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
    bits_base=None, bits_row0=0, bits_col0=0, BITS_BYTES: tl.constexpr = 1, MASK_BITS: tl.constexpr = False,
    k_desc=None, v_desc=None, desc_b=0, desc_h=0, USE_TMA: tl.constexpr = False,
    glob=0, HAS_GLOBAL: tl.constexpr = False, GLOBAL_CAUSAL: tl.constexpr = False, stride_vd=1,
):
    # MASK_BITS: a partial block of a block-sparse mask, its predicate read from a bitmask (attn_sparse.py);
    # HAS_GLOBAL: the global tokens of a block-sparse local + global rule (tile_scores)
    # USE_TMA: K/V tiles come through tensor descriptors (load_rows), the padded layout only
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_BITS:
        k = load_tile(k_base, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D, True)
    else:
        k = load_rows(k_base, k_desc, desc_b, desc_h, start_n, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM,
                      BLOCK_D, MASKED, USE_TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N) -> (BLOCK_M, BLOCK_N)
    if MASKED or HAS_SOFTCAP or HAS_ALIBI or MASK_BITS:
        s, _ = tile_scores(qk, offs_m[:, None], offs_n[None, :], seqlen_k, diag, left, right, qk_scale,
                           cap_in, cap_out, slope, MASKED, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                           True, glob, HAS_GLOBAL, GLOBAL_CAUSAL)
        if MASK_BITS:
            keep = bits_keep(bits_base, offs_m[:, None], offs_n[None, :], bits_row0, bits_col0, BITS_BYTES)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        # plain tiles: the max of the raw products, scaled once per row (scale > 0)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
    # -- rescale the running state to the new max
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = dropout_keep(rng_seed, rng_offset, rng_row_base, offs_m[:, None], offs_n[None, :],
                            max_seqlen_k, dropout_p)
        p = tl.where(keep, p, 0.0)
    if MASK_BITS:
        v = load_tile(v_base, offs_n, offs_dv, stride_vn, seqlen_k, HEAD_DIM_V, BLOCK_DV, True, stride_vd)
    else:
        v = load_rows(v_base, v_desc, desc_b, desc_h, start_n, offs_n, offs_dv, stride_vn, seqlen_k,
                      HEAD_DIM_V, BLOCK_DV, MASKED, USE_TMA, stride_vd)
    acc = acc * alpha[:, None]
    # (BLOCK_M, BLOCK_N) x (BLOCK_N, dv); FP8: P in e4m3 (l_i keeps the unrounded sum)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def fwd_finish(acc, l_i, m_i, sink, dropout_p, HAS_SINK: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """(out, lse) of a query tile from the final online-softmax state. HAS_SINK: `sink` is the sink's logit
    (base 2), where the running max m_i started, so m_i >= sink."""
    if HAS_SINK:
        # the sink is one more logit in every row's denominator, with no value
        l_i = l_i + tl.math.exp2(sink - m_i)
    # rows that saw no key: out = 0 and lse = +inf (flash_attn's convention); with a sink lse = sink
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("inf"))
    if HAS_DROPOUT:
        l_safe = l_safe * (1.0 - dropout_p)  # kept probabilities are scaled by 1/(1 - p)
    return acc / l_safe[:, None], lse


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, ALIBI, SINK, K_DESC, V_DESC, Q_SCALE, K_SCALE, V_SCALE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh, q_scale_group,
    nheads, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k,
    qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset, n_bh, lpt_group,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr,
):
    n_tiles = tl.cdiv(max_seqlen_q, BLOCK_M)
    off_bh, rank = grouped_program(tl.program_id(0), n_bh, n_tiles, lpt_group)
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

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + off_b64 * stride_qb + q_start.to(tl.int64) * stride_qm + off_h64 * stride_qh
    k_base = K + off_b64 * stride_kb + k_start.to(tl.int64) * stride_kn + off_hk64 * stride_kh
    v_base = V + off_b64 * stride_vb + k_start.to(tl.int64) * stride_vn + off_hk64 * stride_vh
    q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q, HEAD_DIM, BLOCK_D, True)

    if FP8:
        # the descales of q (per head, or per kv head: q_scale_group heads share one) and k scale every score
        q_ds = tl.load(Q_SCALE + off_b64 * stride_qsb + (off_h64 // q_scale_group) * stride_qsh)
        k_ds = tl.load(K_SCALE + off_b64 * stride_ksb + off_hk64 * stride_ksh)
        qk_scale = qk_scale * (q_ds * k_ds)
        cap_in = cap_in * (q_ds * k_ds)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
    rng_row_base = off_bh.to(tl.int64) * max_seqlen_q

    diag = seqlen_k - seqlen_q
    n_start, n_lo, n_hi, n_end = key_range(start_m, seqlen_k, diag, left, right, BLOCK_M, BLOCK_N,
                                           WINDOW_LEFT, WINDOW_RIGHT)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    sink = 0.0
    if HAS_SINK:
        # the running max starts at the sink's logit: every numerator exp(s - m) is then taken against the
        # max over the keys and the sink, as the softmax over both defines it (an FP8 P is rounded there)
        sink = tl.load(SINK + off_h) * LOG2E
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # -- tiles cut by the window's left edge
    for start_n in range(n_start, tl.minimum(n_lo, n_end), BLOCK_N):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv,
            seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
            rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, WINDOW_LEFT, WINDOW_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PREC,
            k_desc=K_DESC, v_desc=V_DESC, desc_b=off_b, desc_h=off_h // GROUP, USE_TMA=USE_TMA,
            stride_vd=stride_vd,
        )
    # -- tiles every row of this block sees entirely: no predicate
    for start_n in range(n_lo, n_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv,
            seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
            rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, WINDOW_LEFT, WINDOW_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PREC,
            k_desc=K_DESC, v_desc=V_DESC, desc_b=off_b, desc_h=off_h // GROUP, USE_TMA=USE_TMA,
            stride_vd=stride_vd,
        )
    # -- the diagonal band / right window edge and the key tail
    for start_n in range(tl.maximum(n_hi, n_lo), n_end, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d, offs_dv,
            seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
            rng_seed, rng_offset, rng_row_base, max_seqlen_k, dropout_p,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, WINDOW_LEFT, WINDOW_RIGHT,
            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PREC,
            k_desc=K_DESC, v_desc=V_DESC, desc_b=off_b, desc_h=off_h // GROUP, USE_TMA=USE_TMA,
            stride_vd=stride_vd,
        )

    out, lse = fwd_finish(acc, l_i, m_i, sink, dropout_p, HAS_SINK, HAS_DROPOUT)
    if FP8:
        out = out * tl.load(V_SCALE + off_b64 * stride_vsb + off_hk64 * stride_vsh)
    lse_base = LSE + off_b64 * stride_lse_b + off_h64 * stride_lse_h + q_start
    tl.store(lse_base + offs_m, lse, mask=offs_m < seqlen_q)
    o_base = O + off_b64 * stride_ob + q_start.to(tl.int64) * stride_om + off_h64 * stride_oh
    store_tile(o_base, out, offs_m, offs_dv, stride_om, seqlen_q, HEAD_DIM_V)
