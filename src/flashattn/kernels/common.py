"""Small @triton.jit helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl


@triton.jit
def load_tile(base, offs_rows, offs_d, stride_row, n_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """(rows, BLOCK_D) tile; rows past n_rows and columns past HEAD_DIM read as 0."""
    ptrs = base + offs_rows[:, None] * stride_row + offs_d[None, :]
    if MASK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def store_tile(base, tile, offs_rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr):
    ptrs = base + offs_rows[:, None] * stride_row + offs_d[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty),
             mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def causal_bounds(start_m, seqlen_k, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """Key range of the query rows [start_m, start_m + BLOCK_M), split at a BLOCK_N multiple.

    Returns (n_full, n_end): tiles in [0, n_full) are visible to every row of the block and hold no key past
    seqlen_k, so they need no predicate; tiles in [n_full, n_end) need one. Query i sees key j iff
    j <= i + diag (diag = seqlen_k - seqlen_q).
    """
    n_tail = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), seqlen_k)
        # keys the first row sees, rounded down to whole tiles (clamped before dividing: // truncates)
        n_full = tl.minimum((tl.maximum(start_m + diag + 1, 0) // BLOCK_N) * BLOCK_N, n_tail)
    else:
        n_end = seqlen_k
        n_full = n_tail
    return n_full, n_end


@triton.jit
def causal_bounds_t(start_n, seqlen_q, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Query range that sees the keys [start_n, start_n + BLOCK_N), for the dK/dV pass.

    Returns (m_begin, m_full): query tiles in [m_begin, m_full) (BLOCK_M multiples) straddle the diagonal and
    need the causal predicate; tiles from m_full to seqlen_q see every key of the block. Rows past seqlen_q
    are made harmless by their LSE of +inf, not by a predicate.
    """
    if CAUSAL:
        # the first row that sees key start_n is start_n - diag
        m_begin = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        # every row from start_n + BLOCK_N - 1 - diag on sees the whole key block
        first_full = tl.maximum(start_n + BLOCK_N - 1 - diag, 0)
        m_full = tl.minimum(tl.cdiv(first_full, BLOCK_M) * BLOCK_M, tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M)
        m_begin = tl.minimum(m_begin, m_full)
    else:
        m_begin = 0
        m_full = 0
    return m_begin, m_full
