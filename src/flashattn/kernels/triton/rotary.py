"""KV-cache append with rotary embedding: one launch rotates q and the new k and writes k, v into the cache.

Program (i, b) handles row i of batch element b, all heads at once ((heads, d) tiles):
  q[b, i]            -> QR[b, i] rotated at position cache_seqlens[b] + (i if Q_PER_ROW else 0),
  k[b, i], v[b, i]   -> cache slot of position p = cache_seqlens[b] + i, k rotated at p.
Rotary on the first ROT_DIM dims: pairs (2j, 2j+1) when INTERLEAVED (GPT-J), (j, j + ROT_DIM/2) otherwise
(GPT-NeoX), each pair turned by the angle whose cos/sin sit in column j of row p of COS/SIN:
  x'_a = x_a cos - x_b sin,   x'_b = x_b cos + x_a sin.
Computed in fp32, rounded once on store.
"""

import triton
import triton.language as tl


@triton.jit
def _rotated(ptrs, mask, offs_d, COS, SIN, pos, stride_cs,
             ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The (heads, BLOCK_D) tile at ptrs (pointer tile with d along axis 1), rotated at position pos."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROT_DIM == 0:
        return x
    rot = offs_d < ROT_DIM
    if INTERLEAVED:
        partner = offs_d ^ 1
        col = offs_d // 2
        first = (offs_d % 2) == 0
    else:
        half: tl.constexpr = ROT_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        col = tl.where(first, offs_d, offs_d - half)
    # the partner element of each pair: the same tile shifted along d
    x2 = tl.load(ptrs + (partner - offs_d)[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    cs_off = pos.to(tl.int64) * stride_cs + col
    c = tl.load(COS + cs_off, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(SIN + cs_off, mask=rot, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)
    return x * c[None, :] + x2 * s[None, :]


@triton.jit
def rotary_append_kernel(
    Q, QR, K, V, KC, VC, COS, SIN, SEQLENS, BATCH_IDX, BLOCK_TABLE,
    stride_qb, stride_qm, stride_qh,
    stride_rb, stride_rm, stride_rh,
    stride_kb, stride_km, stride_kh,
    stride_vb, stride_vm, stride_vh,
    stride_kcb, stride_kcn, stride_kch,
    stride_vcb, stride_vcn, stride_vch,
    stride_cs, stride_bt,
    nheads, nheads_k, seqlen_q, seqlen_new, cache_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr,
    ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, Q_PER_ROW: tl.constexpr,
    ROTATE_Q: tl.constexpr, APPEND: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
):
    i = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    if HAS_SEQLENS:
        start = tl.load(SEQLENS + off_b)
    else:
        start = cache_len
    offs_d = tl.arange(0, BLOCK_D)
    ok_d = offs_d < HEAD_DIM

    if ROTATE_Q:
        if i < seqlen_q:
            offs_h = tl.arange(0, BLOCK_H)
            mask = (offs_h < nheads)[:, None] & ok_d[None, :]
            q_ptrs = Q + off_b * stride_qb + i * stride_qm + offs_h[:, None] * stride_qh + offs_d[None, :]
            if Q_PER_ROW:
                pos_q = start + i
            else:
                pos_q = start
            q = _rotated(q_ptrs, mask, offs_d, COS, SIN, pos_q, stride_cs, ROT_DIM, INTERLEAVED)
            r_ptrs = QR + off_b * stride_rb + i * stride_rm + offs_h[:, None] * stride_rh + offs_d[None, :]
            tl.store(r_ptrs, q.to(QR.dtype.element_ty), mask=mask)

    if APPEND:
        if i < seqlen_new:
            pos = start + i
            offs_h = tl.arange(0, BLOCK_HK)
            mask = (offs_h < nheads_k)[:, None] & ok_d[None, :]
            if PAGED:
                page = tl.load(BLOCK_TABLE + off_b * stride_bt + pos // PAGE_SIZE).to(tl.int64)
                slot = (pos % PAGE_SIZE).to(tl.int64)
            else:
                if HAS_BATCH_IDX:
                    page = tl.load(BATCH_IDX + off_b).to(tl.int64)
                else:
                    page = off_b
                slot = pos.to(tl.int64)
            k_ptrs = K + off_b * stride_kb + i * stride_km + offs_h[:, None] * stride_kh + offs_d[None, :]
            k = _rotated(k_ptrs, mask, offs_d, COS, SIN, pos, stride_cs, ROT_DIM, INTERLEAVED)
            kc_ptrs = (KC + page * stride_kcb + slot * stride_kcn + offs_h[:, None] * stride_kch
                       + offs_d[None, :])
            tl.store(kc_ptrs, k.to(KC.dtype.element_ty), mask=mask)
            v_ptrs = V + off_b * stride_vb + i * stride_vm + offs_h[:, None] * stride_vh + offs_d[None, :]
            v = tl.load(v_ptrs, mask=mask, other=0.0)
            vc_ptrs = (VC + page * stride_vcb + slot * stride_vcn + offs_h[:, None] * stride_vch
                       + offs_d[None, :])
            tl.store(vc_ptrs, v.to(VC.dtype.element_ty), mask=mask)
