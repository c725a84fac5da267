"""@triton.jit helpers shared by the forward and backward kernels: tile I/O, visible ranges, scores, dropout.

Visibility (design.md): query i sees key j iff j < seqlen_k and, with diag = seqlen_k - seqlen_q,
  j >= i + diag - left   when the window has a left bound (WINDOW_LEFT),
  j <= i + diag + right  when it has a right bound (WINDOW_RIGHT; causal is right = 0).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2): scores live in base 2 inside the kernels


@triton.jit
def load_tile(base, offs_rows, offs_d, stride_row, n_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr, stride_col=1):
    """(rows, BLOCK_D) tile; rows past n_rows and columns past HEAD_DIM read as 0. stride_col: 1 but for
    an FP8 V whose seqlen dim is contiguous (a kernel argument equal to 1 compiles as the constant)."""
    ptrs = base + offs_rows[:, None] * stride_row + offs_d[None, :] * stride_col
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
def load_rows(base, desc, desc_b, desc_h, start, offs_rows, offs_d, stride_row, n_rows,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr, USE_TMA: tl.constexpr,
              stride_col=1):
    """load_tile of the rows [start, start + len(offs_rows)) of a K/V/Q/dO stream, through the tensor memory
    accelerator when USE_TMA: desc is a (batch, seqlen, heads, d) descriptor of block (1, rows, 1, BLOCK_D)
    (padded layout, HEAD_DIM == BLOCK_D), whose out-of-range rows read as zero like the masked load's."""
    if USE_TMA:
        tile = desc.load([desc_b, start, desc_h, 0]).reshape(offs_rows.shape[0], BLOCK_D)
    else:
        tile = load_tile(base, offs_rows, offs_d, stride_row, n_rows, HEAD_DIM, BLOCK_D, MASK_ROWS,
                         stride_col)
    return tile


@triton.jit
def store_tile(base, tile, offs_rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr):
    ptrs = base + offs_rows[:, None] * stride_row + offs_d[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty),
             mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def seq_bounds(cu_seqlens, off_b, seqlen, IS_VARLEN: tl.constexpr):
    """(start row in the packed tensor, length) of sequence off_b. seqlen: the padded length, or (varlen) the
    rows of the packed tensor: cu_seqlens' values are not trusted (checking them would cost a device sync),
    so the sequence is clamped into [0, seqlen) and every row derived from it stays inside the tensor."""
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + off_b), 0), seqlen)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + off_b + 1), start), seqlen)
        seqlen = end - start
    else:
        start = tl.zeros([], dtype=tl.int32)
    return start, seqlen


@triton.jit
def grouped_program(pid, n_bh, n_tiles, group):
    """(batch·head, tile rank) of program pid in a 1D grid of n_bh·n_tiles programs (rank 0: the heaviest
    tile). Heads go in groups of `group`; inside a group every head's rank 0 comes first, then every head's
    rank 1, and so on. Under causal masking the last programs of the launch are then the lightest of their
    group, so the final wave is short (head by head, a head's heavy tile can start just before the end and run
    alone); the group is sized on the host so that its K/V stays in L2 (ops/attention.py). group = 1 is plain
    head-major order."""
    per_group = group * n_tiles
    g = pid // per_group
    r = pid - g * per_group
    heads = tl.minimum(group, n_bh - g * group)
    return g * group + r % heads, r // heads


@triton.jit
def key_range(start_m, seqlen_k, diag, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Key tiles of the query rows [start_m, start_m + BLOCK_M), as BLOCK_N multiples n_start <= n_lo, n_hi.

    [n_start, n_lo) and [max(n_hi, n_lo), n_end) need the element predicate (left window edge; right edge,
    diagonal and key tail); every row of the block sees every key of the tiles in [n_lo, n_hi).
    """
    n_tail = (seqlen_k // BLOCK_N) * BLOCK_N
    if WINDOW_RIGHT:
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + diag + right, 0), seqlen_k)
        # keys the first row sees, in whole tiles (clamped before dividing: // truncates toward 0)
        n_hi = tl.minimum((tl.maximum(start_m + diag + right + 1, 0) // BLOCK_N) * BLOCK_N, n_tail)
    else:
        n_end = seqlen_k
        n_hi = n_tail
    if WINDOW_LEFT:
        n_start = (tl.maximum(start_m + diag - left, 0) // BLOCK_N) * BLOCK_N
        # the last row's first key, rounded up to a tile
        n_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + diag - left, 0), BLOCK_N) * BLOCK_N
        n_lo = tl.maximum(n_lo, n_start)
    else:
        n_start = 0
        n_lo = 0
    return n_start, n_lo, n_hi, n_end


@triton.jit
def query_range(start_n, seqlen_q, diag, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Query tiles that see the keys [start_n, start_n + BLOCK_N), for the dK/dV pass (BLOCK_M multiples).

    [m_start, m_lo) and [max(m_hi, m_lo), m_end) need the predicate; [m_lo, m_hi) see the whole key tile.
    Rows past seqlen_q are made harmless by their LSE of +inf, not by a predicate.
    """
    m_tail = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if WINDOW_RIGHT:
        # row i sees key j only if i >= j - diag - right
        m_start = (tl.maximum(start_n - diag - right, 0) // BLOCK_M) * BLOCK_M
        m_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag - right, 0), BLOCK_M) * BLOCK_M
    else:
        m_start = 0
        m_lo = 0
    if WINDOW_LEFT:
        # row i sees key j only if i <= j - diag + left
        m_end = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - diag + left, 0), BLOCK_M) * BLOCK_M, m_tail)
        m_hi = (tl.maximum(start_n - diag + left + 1, 0) // BLOCK_M) * BLOCK_M
    else:
        m_end = m_tail
        m_hi = m_tail
    m_start = tl.minimum(m_start, m_end)
    m_lo = tl.minimum(tl.maximum(m_lo, m_start), m_end)
    return m_start, m_lo, m_hi, m_end


@triton.jit
def tile_scores(qk, qi, kj, seqlen_k, diag, left, right, qk_scale, cap_in, cap_out, slope,
                MASKED: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, CHECK_KEYS: tl.constexpr,
                glob=0, HAS_GLOBAL: tl.constexpr = False, GLOBAL_CAUSAL: tl.constexpr = False):
    """Base-2 scores of a tile of raw q·k products, and tanh(·) of the softcap (for its derivative).

    qi, kj: query and key indices broadcastable to qk's shape (either orientation, so the dK/dV pass can work
    on transposed tiles). Masked entries are -inf. softcap: s = c·tanh(scale·qk / c), cap_in = scale / c,
    cap_out = c / ln 2. ALiBi subtracts slope·|i + diag - j| (slope already in base 2).
    HAS_GLOBAL (block-sparse local + global masks): the first `glob` keys and queries are also visible,
    only where j <= i + diag when GLOBAL_CAUSAL.
    """
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): one exp2, saturates to ±1 without NaN
        t = 1.0 - 2.0 / (tl.math.exp2(qk * (cap_in * 2.0 * LOG2E)) + 1.0)
        s = t * cap_out
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        s = s - slope * tl.abs(qi + diag - kj).to(tl.float32)
    if MASKED:
        # keys past seqlen_k read as zero rows; they must not reach the forward's softmax nor dQ (where
        # exp2(0 - lse) can overflow against a very negative lse), but the dK/dV pass never stores their rows
        if WINDOW_RIGHT or WINDOW_LEFT:
            if WINDOW_RIGHT:
                keep = kj <= qi + diag + right
                if WINDOW_LEFT:
                    keep = keep & (kj >= qi + diag - left)
            else:
                keep = kj >= qi + diag - left
            if HAS_GLOBAL:
                seen = (kj < glob) | (qi < glob)
                if GLOBAL_CAUSAL:
                    seen = seen & (kj <= qi + diag)
                keep = keep | seen
            if CHECK_KEYS:
                keep = keep & (kj < seqlen_k)
        else:
            keep = kj < seqlen_k
        s = tl.where(keep, s, float("-inf"))
    return s, t


@triton.jit
def dropout_keep(seed, offset, row_base, qi, kj, max_seqlen_k, dropout_p):
    """Keep mask of dropout: element (b, h, i, j) is kept iff rand(seed, counter) >= p, with
    counter = offset + ((b·nheads + h)·max_seqlen_q + i)·max_seqlen_k + j; row_base is
    (b·nheads + h)·max_seqlen_q. flashattn.dropout reproduces it bit for bit in torch."""
    counter = offset + (row_base + qi.to(tl.int64)) * max_seqlen_k + kj.to(tl.int64)
    return tl.rand(seed, counter) >= dropout_p


@triton.jit
def bits_keep(bits_base, qi, kj, row0, col0, BITS_BYTES: tl.constexpr):
    """Element predicate of a partial block-sparse block: bit (kj - col0) % 8 of byte
    (qi - row0, (kj - col0) // 8) of its (block_m, block_n / 8) bitmask (flashattn.masks kernel contract)."""
    r = qi - row0
    c = kj - col0
    byte = tl.load(bits_base + r * BITS_BYTES + c // 8)
    return ((byte.to(tl.int32) >> (c % 8)) & 1) != 0
