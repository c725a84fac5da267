"""Backward attention kernels: P is recomputed tile by tile from Q, K and the saved LSE, nothing N×N stored.

  attn_bwd_preprocess_kernel  D_i = rowsum(dO_i ∘ O_i)
  attn_bwd_dkdv_kernel        one program per (key tile, batch·kv head): dV += Pᵀ dO, dK += dSᵀ Q over the
                              query tiles of every query head in the GQA group (so the group sum is free)
  attn_bwd_dq_kernel          one program per (query tile, batch·head): dQ += dS K
with dS = P ∘ (dP − D) and dP = dO Vᵀ. The softmax scale multiplies dK and dQ once, at the end.

No atomics: every gradient element is written by one program, so gradients are bitwise reproducible. dQ costs
a second pass that recomputes S and dP (7 matmuls in all, against 5 with atomic dQ), and is still faster than
the atomic variant on the H200 (benchmarks/NOTES.md).
"""

import triton
import triton.language as tl

from flashattn.kernels.common import causal_bounds, causal_bounds_t, load_tile, store_tile

LOG2E = tl.constexpr(1.4426950408889634)  # the saved LSE is natural-log; the kernels work in base 2


@triton.jit
def attn_bwd_preprocess_kernel(
    O, DO, Delta,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    nheads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh, offs_m, offs_d, stride_om, seqlen_q,
                  HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_d, stride_dom, seqlen_q,
                   HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
    start_m, offs_n, offs_d, seqlen_q, diag, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q, HEAD_DIM, BLOCK_D, True)
    # rows past seqlen_q get LSE = +inf, so their P is exactly 0 without a predicate
    lse = tl.load(lse_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # (BLOCK_N, d) x (d, BLOCK_M)
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    if MASKED:
        p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + diag, p_t, 0.0)
    do = load_tile(do_base, offs_m, offs_d, stride_dom, seqlen_q, HEAD_DIM, BLOCK_D, True)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) x (BLOCK_M, d)
    delta = tl.load(delta_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, d) x (d, BLOCK_M)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) x (BLOCK_M, d)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    nheads, nheads_k, seqlen_q, seqlen_k, qk_scale, sm_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1)
    off_b = (off_bhk // nheads_k).to(tl.int64)
    off_hk = (off_bhk % nheads_k).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(K + off_b * stride_kb + off_hk * stride_kh, offs_n, offs_d, stride_kn, seqlen_k,
                  HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + off_b * stride_vb + off_hk * stride_vh, offs_n, offs_d, stride_vn, seqlen_k,
                  HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    diag = seqlen_k - seqlen_q
    m_begin, m_full = causal_bounds_t(start_n, seqlen_q, diag, BLOCK_M, BLOCK_N, CAUSAL)
    m_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        row_base = (off_b * nheads + off_h) * seqlen_q
        # -- query tiles straddling the diagonal
        for start_m in range(m_begin, m_full, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, seqlen_q, diag, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, True, DOT_PREC,
            )
        # -- query tiles that see the whole key tile
        for start_m in range(m_full, m_end, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, LSE + row_base, Delta + row_base, stride_qm, stride_dom,
                start_m, offs_n, offs_d, seqlen_q, diag, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, False,
                DOT_PREC,
            )
    store_tile(DK + off_b * stride_dkb + off_hk * stride_dkh, dk * sm_scale, offs_n, offs_d, stride_dkn,
               seqlen_k, HEAD_DIM)
    store_tile(DV + off_b * stride_dvb + off_hk * stride_dvh, dv, offs_n, offs_d, stride_dvn, seqlen_k,
               HEAD_DIM)


@triton.jit
def _dq_tile(
    dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn,
    start_n, offs_m, offs_d, seqlen_k, diag, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # keys past seqlen_k read as 0, so their dS·K term is 0 without a predicate
    k = load_tile(k_base, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D, MASKED)
    v = load_tile(v_base, offs_n, offs_d, stride_vn, seqlen_k, HEAD_DIM, BLOCK_D, MASKED)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASKED:
        if CAUSAL:
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + diag, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N) x (BLOCK_N, d)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    nheads, seqlen_q, seqlen_k, qk_scale, sm_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    start_m = (num_m - 1 - tl.program_id(0)) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    off_hk = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(Q + off_b * stride_qb + off_h * stride_qh, offs_m, offs_d, stride_qm, seqlen_q,
                  HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_d, stride_dom, seqlen_q,
                   HEAD_DIM, BLOCK_D, True)
    row_base = off_bh.to(tl.int64) * seqlen_q
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh

    diag = seqlen_k - seqlen_q
    n_full, n_end = causal_bounds(start_m, seqlen_k, diag, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d,
                      seqlen_k, diag, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, DOT_PREC)
    for start_n in range(n_full, n_end, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d,
                      seqlen_k, diag, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, DOT_PREC)
    store_tile(DQ + off_b * stride_dqb + off_h * stride_dqh, dq * sm_scale, offs_m, offs_d, stride_dqm,
               seqlen_q, HEAD_DIM)
