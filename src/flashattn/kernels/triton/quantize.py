"""FP8 quantisation of an attention input in two passes over it: the largest magnitude per (batch, head) or
per tensor, then the scaled, saturated cast to e4m3, optionally through the Hadamard rotation of incoherent
processing in both. One program = BLOCK_S rows of one (batch, head).

The rotation multiplies each row by H·diag(signs) with entries ±1 (exact in any dtype, so the tensor-core
product of 16-bit rows has exact terms and a float32 sum) and then by 1 / sqrt(d): the same arithmetic as
the torch backend's, whatever the input dtype.
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


@triton.jit
def _rows(X, R, off_b, off_h, s0, stride_xb, stride_xs, stride_xh, seqlen, inv_sqrt_d,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ROTATE: tl.constexpr,
          DOT_PREC: tl.constexpr):
    """(BLOCK_S, BLOCK_D) float32 rows [s0, s0 + BLOCK_S) of x[off_b, :, off_h] (rotated), 0 past seqlen
    and HEAD_DIM, and the mask of the rows that exist."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_s[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    base = X + off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh
    x = tl.load(base + offs_s[:, None].to(tl.int64) * stride_xs + offs_d[None, :], mask=mask, other=0.0)
    if ROTATE:
        r = tl.load(R + offs_d[:, None] * BLOCK_D + offs_d[None, :])  # (d, d) ±1 in x's dtype
        xf = tl.dot(x, r, input_precision=DOT_PREC) * inv_sqrt_d
    else:
        xf = x.to(tl.float32)
    return xf, mask, offs_s, offs_d


@triton.jit
def fp8_amax_kernel(X, R, AMAX, stride_xb, stride_xs, stride_xh, nheads, seqlen, inv_sqrt_d,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                    ROTATE: tl.constexpr, PER_HEAD: tl.constexpr, DOT_PREC: tl.constexpr):
    """AMAX (zeroed by the launcher; (batch·heads,) or (1,)) takes each program's largest |x|."""
    off_bh = tl.program_id(0)
    xf, _, _, _ = _rows(X, R, off_bh // nheads, off_bh % nheads, tl.program_id(1) * BLOCK_S, stride_xb,
                        stride_xs, stride_xh, seqlen, inv_sqrt_d, HEAD_DIM, BLOCK_D, BLOCK_S, ROTATE,
                        DOT_PREC)
    amax = tl.max(tl.max(tl.abs(xf), 1), 0)
    if PER_HEAD:
        tl.atomic_max(AMAX + off_bh, amax)
    else:
        tl.atomic_max(AMAX, amax)


@triton.jit
def fp8_cast_kernel(X, R, AMAX, Y, DESCALE, stride_xb, stride_xs, stride_xh, stride_yb, stride_ys,
                    stride_yh, stride_yd, nheads, seqlen, inv_sqrt_d,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                    ROTATE: tl.constexpr, PER_HEAD: tl.constexpr, DOT_PREC: tl.constexpr):
    """Y = clamp(x · scale, ±448) in e4m3, scale the largest power of two that keeps amax · scale <= 448
    (1 where amax is 0); DESCALE = 1 / scale,
    written by each (batch, head)'s first program (per tensor: the first program)."""
    off_bh = tl.program_id(0)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    s0 = tl.program_id(1) * BLOCK_S
    xf, mask, offs_s, offs_d = _rows(X, R, off_b, off_h, s0, stride_xb, stride_xs, stride_xh, seqlen,
                                     inv_sqrt_d, HEAD_DIM, BLOCK_D, BLOCK_S, ROTATE, DOT_PREC)
    if PER_HEAD:
        slot = off_bh
    else:
        slot = off_bh * 0
    amax = tl.load(AMAX + slot)
    # the largest power of two 2^k with amax · 2^k <= 448 (amax = m · 2^e, m in [1, 2): k = 8 - e when
    # m <= 1.75, else 7 - e), from amax's bits: exact, so every backend and device gets the same bits;
    # amax floored at 2^-100 (the scale stays a normal float), an all-zero x gets 1
    bits = tl.maximum(amax, 7.888609052210118e-31).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    k = tl.where((bits & 0x7FFFFF) <= 0x600000, 8 - e, 7 - e)
    k = tl.where(amax > 0.0, k, 0)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(xf * scale, -FP8_MAX), FP8_MAX).to(Y.dtype.element_ty)
    base = Y + off_b.to(tl.int64) * stride_yb + off_h.to(tl.int64) * stride_yh
    tl.store(base + offs_s[:, None].to(tl.int64) * stride_ys + offs_d[None, :] * stride_yd, y, mask=mask)
    first = tl.program_id(1) == 0
    if not PER_HEAD:
        first = first & (off_bh == 0)
    if first:
        tl.store(DESCALE + slot, ((127 - k) << 23).to(tl.float32, bitcast=True))
