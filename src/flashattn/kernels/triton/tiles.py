"""The Gluon kernels' varlen schedules: the query (forward) or key (backward) tiles before each sequence of a
packed batch.

The persistent Gluon forward walks the query tiles of all sequences as one list (kernels/gluon/attn_fwd.py):
work item t is tile t // nheads of that list, head t % nheads. A sequence's tiles follow the sequences
before it, so the kernel finds the sequence of a tile by bisection over these offsets, and the list has no
hole: a grid over max_seqlen_q's tiles of every sequence would leave the programs an atomic take per empty
tile (most of them, for packed documents of long-tailed lengths).
"""

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(CU_SEQLENS, OFFSETS, batch, total, block, BLOCK_B: tl.constexpr):
    tl.store(OFFSETS, 0)
    carry = 0
    for start in range(0, batch, BLOCK_B):
        offs = start + tl.arange(0, BLOCK_B)
        inside = offs < batch
        first = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + offs, mask=inside, other=0), 0), total)
        end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + offs + 1, mask=inside, other=0), first), total)
        tiles = (end - first + block - 1) // block
        tl.store(OFFSETS + offs + 1, carry + tl.cumsum(tiles, 0), mask=inside)
        carry += tl.sum(tiles, 0)


@triton.jit
def varlen_tile_offsets_kernel(CU_A, OFFSETS_A, total_a, block_a, CU_B, OFFSETS_B, total_b, block_b, batch,
                               BLOCK_B: tl.constexpr):
    """Program p in {0, 1} writes list p: OFFSETS[b] = Σ_{b' < b} cdiv(len_b', block) for b in [0, batch]
    (OFFSETS[batch]: every sequence's tiles), len_b = CU[b + 1] - CU[b] clamped into the packed tensor's
    `total` rows as every kernel clamps it (common.seq_bounds, the Gluon kernels' too: the values are not
    checked on the device). A grid of one writes list 0 only; two lists in one launch serve the varlen
    backward (its stats rows per query sequence and its key tiles). BLOCK_B sequences at a time."""
    if tl.program_id(0) == 0:
        _tile_offsets(CU_A, OFFSETS_A, batch, total_a, block_a, BLOCK_B)
    else:
        _tile_offsets(CU_B, OFFSETS_B, batch, total_b, block_b, BLOCK_B)
