"""Forward attention kernel: one program per (query tile, batch·head), K/V tiles streamed through SRAM.

Invariants of the online softmax (base 2, the scale folded into ``qk_scale``):
  m_i  running row max of the scaled scores seen so far,
  l_i  sum of exp2(s - m_i) over those scores,
  acc  sum of exp2(s - m_i) · v.
Only O = acc / l_i and LSE = (m_i + log2 l_i)·ln 2 reach HBM.
"""

import triton
import triton.language as tl

from flashattn.kernels.common import causal_bounds, load_tile, store_tile

LN2 = tl.constexpr(0.6931471805599453)  # the kernel works in base 2; LSE leaves it as a natural log


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
    start_n, offs_m, offs_d, seqlen_k, diag, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D, MASKED)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N) -> (BLOCK_M, BLOCK_N)
    if MASKED:
        # only the diagonal band and the key tail pay for the predicate
        keep = offs_n[None, :] < seqlen_k
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + diag)
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
    # -- rescale the running state to the new max
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_tile(v_base, offs_n, offs_d, stride_vn, seqlen_k, HEAD_DIM, BLOCK_D, MASKED)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N) x (BLOCK_N, d)
    return acc, l_i, m_new


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    nheads, seqlen_q, seqlen_k, qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # the last query tiles carry the most keys under causal masking: launch them first
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    start_m = (num_m - 1 - tl.program_id(0)) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    off_hk = off_h // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q, HEAD_DIM, BLOCK_D, True)

    # query i sees key j iff j <= i + diag (bottom-right aligned causal)
    diag = seqlen_k - seqlen_q
    n_full, n_end = causal_bounds(start_m, seqlen_k, diag, BLOCK_M, BLOCK_N, CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # -- tiles every row of this block sees entirely: no predicate
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d,
            seqlen_k, diag, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, DOT_PREC,
        )
    # -- the diagonal band and the key tail
    for start_n in range(n_full, n_end, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start_n, offs_m, offs_d,
            seqlen_k, diag, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, DOT_PREC,
        )

    # -- epilogue: rows that saw no key get out = 0 and lse = +inf (flash_attn's convention)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("inf"))
    tl.store(LSE + off_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    store_tile(O + off_b * stride_ob + off_h * stride_oh, out, offs_m, offs_d, stride_om, seqlen_q, HEAD_DIM)
