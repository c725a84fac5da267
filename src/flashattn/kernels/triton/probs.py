"""The attention probabilities in flash_attn's S_dmask form: one program per (query tile, batch·head).

flash_attn 2.x returns them from its forward kernel when asked (return_attn_probs=True with dropout), and its
tests decode them (convert_flash_attn_S_to_softmax, normalize_flash_attn_S), so the form is fixed:
  - the key tiles, BLOCK_N wide from key 0, are visited last to first, as flash_attn's forward does;
  - entry (i, j) holds exp(s_ij - m_i), with m_i the running row max over the tiles visited so far (this
    one included): the max over the tiles at and after j's, the reverse cumulative max the tests undo;
  - a dropped entry has its sign bit set (-p; -0.0 for p = 0); an entry the query does not see is +0;
  - rows and columns past the sequence (up to the tensor's 128-rounded size) are 0.
The scores are the forward's (tile_scores: scale, softcap, ALiBi, masks) and the keep mask its dropout_keep,
so the probabilities and the mask are the ones the forward used. A learnable sink is not a key and has no
entry.
"""

import triton
import triton.language as tl

from flashattn.kernels.triton.common import LOG2E, dropout_keep, load_tile, seq_bounds, tile_scores


@triton.jit
def attn_probs_kernel(
    Q, K, P, CU_Q, CU_K, ALIBI,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_pb, stride_ph, stride_pm, stride_alibi_b,
    nheads, seqlen_q, seqlen_k, max_seqlen_q, max_seqlen_k, n_cols,
    qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # P: (batch, nheads, rows, n_cols), rows and n_cols multiples of BLOCK_M and BLOCK_N (128-rounded
    # max_seqlen_q / max_seqlen_k); the grid covers every row, and every column is written below
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    q_start, seqlen_q = seq_bounds(CU_Q, off_b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, off_b, seqlen_k, IS_VARLEN)
    diag = seqlen_k - seqlen_q
    # a varlen sequence longer than max_seqlen (unchecked values) has no columns past n_cols: clamp the
    # tiles written to the tensor's width
    n_blocks = tl.cdiv(tl.minimum(seqlen_k, max_seqlen_k), BLOCK_N)
    off_b64 = off_b.to(tl.int64)
    off_h64 = off_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    p_base = P + off_b64 * stride_pb + off_h64 * stride_ph
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # a tile past the sequence: zeros only
    n_blocks = tl.where(start_m < tl.minimum(seqlen_q, max_seqlen_q), n_blocks, 0)
    # -- the columns past the last key tile
    for start_n in range(n_blocks * BLOCK_N, n_cols, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tl.store(p_base + offs_m[:, None] * stride_pm + offs_n[None, :], zeros.to(P.dtype.element_ty))
    if n_blocks > 0:
        q_base = Q + off_b64 * stride_qb + q_start.to(tl.int64) * stride_qm + off_h64 * stride_qh
        k_base = K + off_b64 * stride_kb + k_start.to(tl.int64) * stride_kn + (off_h64 // GROUP) * stride_kh
        q = load_tile(q_base, offs_m, offs_d, stride_qm, seqlen_q, HEAD_DIM, BLOCK_D, True)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * LOG2E
        rng_row_base = off_bh.to(tl.int64) * max_seqlen_q
        row_in = offs_m[:, None] < seqlen_q
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        # -- key tiles last to first, the running max including each tile
        for i in range(0, n_blocks):
            start_n = (n_blocks - 1 - i) * BLOCK_N
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_tile(k_base, offs_n, offs_d, stride_kn, seqlen_k, HEAD_DIM, BLOCK_D, True)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N)
            s, _ = tile_scores(qk, offs_m[:, None], offs_n[None, :], seqlen_k, diag, left, right, qk_scale,
                               cap_in, cap_out, slope, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP,
                               HAS_ALIBI, True)
            m_i = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: exponentiate against 0 so exp2 gives 0, not NaN
            m_sub = tl.where(m_i == float("-inf"), 0.0, m_i)
            p = tl.math.exp2(s - m_sub[:, None])
            if HAS_DROPOUT:
                keep = dropout_keep(rng_seed, rng_offset, rng_row_base, offs_m[:, None], offs_n[None, :],
                                    max_seqlen_k, dropout_p)
                # the sign marks a dropped entry the query sees; unseen ones stay +0
                p = tl.where(keep | (s == float("-inf")), p, -p)
            p = tl.where(row_in, p, 0.0)
            tl.store(p_base + offs_m[:, None] * stride_pm + offs_n[None, :], p.to(P.dtype.element_ty))
