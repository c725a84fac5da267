"""Exact merge of partial attention results over disjoint key sets (split-KV, cascade, ring attention).

Partial s of a row holds its normalised output o_s and LSE l_s (natural log). With m = max_s l_s and
w_s = exp(l_s - m):  out = Σ w_s o_s / Σ w_s,  lse = m + log Σ w_s.
An empty partial (no key) has w_s = 0 and is written either way: -inf (our split partials) or +inf
(flash_attn's "row saw no key" convention, what flash_attn_func returns). A row whose partials are all empty
gets out 0 and lse +inf, the public convention again, so merged results can be merged further.

A program holds BLOCK_R rows and loads BLOCK_S partials of them at once, a (BLOCK_S, BLOCK_R, BLOCK_D) tile:
the loads of a chunk are independent, so a decode step with tens of splits costs one or two memory
round trips, not one per split. Chunks are merged online (the running max rescaled like m_i in attn_fwd.py).
"""

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
    OP, LSEP, O, LSE,
    stride_ps, stride_pb, stride_pm, stride_ph,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_ob, stride_om, stride_oh,
    stride_rb, stride_rh, stride_rm,
    nheads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # rows of one batch element, r = query position * nheads + head (adjacent heads are adjacent in memory)
    off_b = tl.program_id(1).to(tl.int64)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok_r = offs_r < seqlen_q * nheads
    offs_i = (offs_r // nheads).to(tl.int64)
    offs_h = (offs_r % nheads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    p_rows = off_b * stride_pb + offs_i * stride_pm + offs_h * stride_ph  # (BLOCK_R,)
    l_rows = off_b * stride_lb + offs_h * stride_lh + offs_i * stride_lm
    ok_rd = ok_r[:, None] & (offs_d[None, :] < HEAD_DIM)  # (BLOCK_R, BLOCK_D)

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    w = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        splits = s0 + offs_s
        ok_sr = (splits < num_splits)[:, None] & ok_r[None, :]  # (BLOCK_S, BLOCK_R)
        lse_s = tl.load(LSEP + splits[:, None].to(tl.int64) * stride_ls + l_rows[None, :], mask=ok_sr,
                        other=float("-inf")).to(tl.float32)
        lse_s = tl.where(lse_s == float("inf"), float("-inf"), lse_s)  # +inf = empty, like -inf
        # -- rescale the running state to the new max; rows with nothing yet subtract 0, not -inf
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_sub)
        beta = tl.exp(lse_s - m_sub[None, :])  # (BLOCK_S, BLOCK_R), 0 for empty partials
        o_ptrs = (OP + splits[:, None, None].to(tl.int64) * stride_ps + p_rows[None, :, None]
                  + offs_d[None, None, :])
        o_s = tl.load(o_ptrs, mask=(beta > 0.0)[:, :, None] & ok_rd[None, :, :], other=0.0)
        # an empty partial's output is never read: it may hold anything, even NaN
        acc = acc * alpha[:, None] + tl.sum(beta[:, :, None] * o_s.to(tl.float32), 0)
        w = w * alpha + tl.sum(beta, 0)
        m = m_new

    seen = w > 0.0
    w_safe = tl.where(seen, w, 1.0)
    out = acc / w_safe[:, None]
    lse = tl.where(seen, m + tl.log(w_safe), float("inf"))
    o_ptrs = O + off_b * stride_ob + offs_i[:, None] * stride_om + offs_h[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(O.dtype.element_ty), mask=ok_rd)
    tl.store(LSE + off_b * stride_rb + offs_h * stride_rh + offs_i * stride_rm, lse, mask=ok_r)
