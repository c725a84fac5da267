"""Rotary embedding of a tile as it is loaded, for the decode kernel (kernels/triton/decode.py): it rotates q
and the new keys in registers, so no rotated copy is ever written but the appended keys in the cache.

Rotary on the first ROT_DIM dims: pairs (2j, 2j+1) when INTERLEAVED (GPT-J), (j, j + ROT_DIM/2) otherwise
(GPT-NeoX), each pair turned by the angle whose cos/sin sit in column j of row `pos` of COS/SIN:
  x'_a = x_a cos - x_b sin,   x'_b = x_b cos + x_a sin.
Computed in fp32; the caller rounds once, to the tensor's dtype.
"""

import triton
import triton.language as tl


@triton.jit
def rotated(ptrs, mask, offs_d, COS, SIN, pos, stride_cs, stride_ss, seqlen_ro,
            ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The (rows, BLOCK_D) tile at ptrs (d along axis 1) in fp32, row r rotated at position pos[r]; pos is
    clamped into the table ([0, seqlen_ro)), so no position can read outside COS/SIN."""
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
    rot_mask = mask & rot[None, :]
    # the partner element of each pair: the same tile shifted along d
    x2 = tl.load(ptrs + (partner - offs_d)[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    pos = tl.minimum(tl.maximum(pos, 0), seqlen_ro - 1)
    pos = pos[:, None].to(tl.int64)
    c = tl.load(COS + pos * stride_cs + col[None, :], mask=rot_mask, other=1.0).to(tl.float32)
    s = tl.load(SIN + pos * stride_ss + col[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    s = tl.where(first[None, :], -s, s)
    return x * c + x2 * s
