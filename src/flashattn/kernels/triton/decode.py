"""Split-KV decoding (flash-decoding) over a contiguous or paged KV cache.

One program = one key chunk ("split") of one (batch, kv head) for one block of packed query rows. Row r of
the tile is the pair (query position r // GROUP, query head kv_head·GROUP + r % GROUP): every query head of
a GQA group reads the same K/V tile, so each tile is loaded once per group, and the M dimension reaches the
16 rows tl.dot needs even when seqlen_q = 1.

Keys are addressed by their absolute position in the cache: position p of sequence b lives at
  contiguous: K[cache_row(b), p]              (cache_row = cache_batch_idx[b] or b)
  paged:      K[block_table[b, p // PAGE], p % PAGE]
and a tile gathers its rows one by one, so BLOCK_N and PAGE need not divide each other.

The visible keys of query i are [max(lo_b, i + diag - left), min(end_b, i + diag + right + 1)) with
end_b = cache_seqlens[b] + seqlen_new, lo_b = cache_leftpad[b] and diag = end_b - seqlen_q (causal is the
window (∞, 0), bottom-right aligned). A split that sees nothing writes the empty partial (out 0, lse -inf),
which the combine step ignores.

Online-softmax invariants as in attn_fwd.py (base 2, the scale folded into qk_scale).
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # via exp2, not libdevice, so the Triton interpreter runs it too; saturates to ±1 without NaN
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def decode_split_kernel(
    Q, K, V, O, LSE,
    SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_bt, stride_ab,
    nheads_k, seqlen_q, seqlen_new, cache_len, num_splits,
    qk_scale, softcap_in, softcap_out, window_left, window_right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI_ON: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    off_bh = tl.program_id(0)
    split = tl.program_id(1)
    start_m = tl.program_id(2) * BLOCK_M
    off_b = off_bh // nheads_k
    off_hk = off_bh % nheads_k

    # -- this sequence's key range and alignment
    if HAS_SEQLENS:
        end = tl.load(SEQLENS + off_b) + seqlen_new
    else:
        end = cache_len + seqlen_new
    if HAS_LEFTPAD:
        lo = tl.load(LEFTPAD + off_b)
    else:
        lo = 0
    diag = end - seqlen_q  # query i is aligned with key i + diag

    # -- packed rows: r = query position * GROUP + head within the group
    n_rows = seqlen_q * GROUP
    offs_r = start_m + tl.arange(0, BLOCK_M)
    ok_r = offs_r < n_rows
    offs_i = offs_r // GROUP
    offs_h = off_hk * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    ok_d = offs_d < HEAD_DIM

    hi = end
    if WINDOW:
        # keys some row of this block may see; window_left/right are huge when unbounded
        first_i = start_m // GROUP
        last_i = (tl.minimum(start_m + BLOCK_M, n_rows) - 1) // GROUP
        lo = tl.maximum(lo, first_i + diag - window_left)
        hi = tl.minimum(hi, last_i + diag + window_right + 1)

    # -- this split's share of the key tiles (tiles aligned to BLOCK_N in absolute positions)
    tile_lo = tl.maximum(lo, 0) // BLOCK_N
    n_tiles = tl.maximum(tl.cdiv(hi, BLOCK_N) - tile_lo, 0)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_lo + n_tiles)

    off_b64 = off_b.to(tl.int64)
    q_ptrs = (Q + off_b64 * stride_qb + offs_i[:, None].to(tl.int64) * stride_qm
              + offs_h[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=ok_r[:, None] & ok_d[None, :], other=0.0)
    if HAS_BATCH_IDX:
        cache_row = tl.load(BATCH_IDX + off_b).to(tl.int64)
    else:
        cache_row = off_b64
    bt_row = off_b64 * stride_bt
    k_head = K + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_hk.to(tl.int64) * stride_vh
    if ALIBI_ON:
        # slopes in log2 units: the scores are kept in base 2
        slope = tl.load(ALIBI + off_b * stride_ab + offs_h, mask=ok_r, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(t_begin * BLOCK_N, t_end * BLOCK_N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ok_n = (offs_n >= lo) & (offs_n < hi)
        if PAGED:
            # one block-table read per key row: a tile may span several pages (BLOCK_N > PAGE_SIZE)
            page = tl.load(BLOCK_TABLE + bt_row + offs_n // PAGE_SIZE, mask=ok_n, other=0).to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
        else:
            page = cache_row
            slot = tl.where(ok_n, offs_n, 0).to(tl.int64)
        k_rows = page * stride_kb + slot * stride_kn
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=ok_n[:, None] & ok_d[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N)
        if SOFTCAP:
            s = _tanh(qk * softcap_in) * softcap_out
        else:
            s = qk * qk_scale
        if ALIBI_ON:
            dist = tl.abs(offs_i[:, None] + diag - offs_n[None, :]).to(tl.float32)
            s = s - slope[:, None] * dist
        keep = ok_n[None, :] & ok_r[:, None]
        if WINDOW:
            rel = offs_n[None, :] - (offs_i[:, None] + diag)
            keep = keep & (rel >= -window_left) & (rel <= window_right)
        s = tl.where(keep, s, float("-inf"))
        # -- update m_i and l_i; a row with nothing visible yet subtracts 0 so exp2 gives 0, not NaN
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_vb + slot * stride_vn
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=ok_n[:, None] & ok_d[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N) x (BLOCK_N, d)
        m_i = m_new

    # -- epilogue: empty rows get lse -inf as a split partial (the combine skips them), +inf as a final
    # result (flash_attn's convention for a row that sees no key); out is 0 either way
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    else:
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("inf"))
    base_o = O + split.to(tl.int64) * stride_os + off_b64 * stride_ob
    o_ptrs = base_o + offs_i[:, None].to(tl.int64) * stride_om + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=ok_r[:, None] & ok_d[None, :])
    base_l = LSE + split.to(tl.int64) * stride_ls + off_b64 * stride_lb
    tl.store(base_l + offs_h * stride_lh + offs_i * stride_lm, lse, mask=ok_r)
