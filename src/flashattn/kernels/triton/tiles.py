"""The Gluon forward's varlen schedule: the query tiles before each sequence of a packed batch.

The persistent Gluon forward walks the query tiles of all sequences as one list (kernels/gluon/attn_fwd.py):
work item t is tile t // nheads of that list, head t % nheads. A sequence's tiles follow the sequences
before it, so the kernel finds the sequence of a tile by bisection over these offsets, and the list has no
hole: a grid over max_seqlen_q's tiles of every sequence would leave the programs an atomic take per empty
tile (most of them, for packed documents of long-tailed lengths).
"""

import triton
import triton.language as tl


@triton.jit
def varlen_tile_offsets_kernel(CU_SEQLENS, OFFSETS, batch, total, BLOCK_M: tl.constexpr,
                               BLOCK_B: tl.constexpr):
    """OFFSETS[b] = Σ_{b' < b} cdiv(len_b', BLOCK_M) for b in [0, batch] (OFFSETS[batch]: every sequence's
    tiles), len_b = CU_SEQLENS[b + 1] - CU_SEQLENS[b] clamped into the packed tensor's `total` rows as every
    kernel clamps it (common.seq_bounds, the Gluon kernels' too: the values are not checked on the device).
    One program, BLOCK_B sequences at a time."""
    tl.store(OFFSETS, 0)
    carry = 0
    for start in range(0, batch, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        inside = offs < batch
        first = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + offs, mask=inside, other=0), 0), total)
        end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + offs + 1, mask=inside, other=0), first), total)
        tiles = (end - first + BLOCK_M - 1) // BLOCK_M
        tl.store(OFFSETS + offs + 1, carry + tl.cumsum(tiles, 0), mask=inside)
        carry += tl.sum(tiles, 0)
