"""Block-sparse masks (flashattn.masks' kernel tensors) in the Gluon forward (attn_fwd.py): a query tile walks
its block lists instead of a contiguous key range, its full blocks unmasked and its partial ones through
their bitmasks, so the K/V tiles of empty blocks are never loaded.

`sparse` is the kernel's tuple (FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, PART_BITS, Q_ORDER, mask_b, mask_h,
n_qblocks, max_full, max_part, sparse_n, subs, row_bytes), all None when the call has no mask: the count
and list tensors of BlockMaskKernelTensors, the mask's batch and head dims (1: broadcast), its query
blocks, its lists' widths, its key block (sparse_n keys), the kernel's key tiles in one (subs = sparse_n //
BLOCK_N) and a bitmask row's bytes (sparse_n // 8, an argument of its own so that the compiler sees it a
multiple of 16 and vectorises the loads).
The mask's query block is the kernel's query tile (BLOCK_M rows: the route holds them equal).

Key step j of a query tile is list slot p = j // subs, sub-tile j % subs: the full blocks first, then the
partial ones; the loader (fwd_loader.py) and every consumer derive the same sequence, so the K/V ring's
counters agree. A partial step's bits are loaded once its QK^T has landed (`partial_bits`; held across
that wait they spilled) and expanded in the scores' registers (`keep_of`): a byte holds 8 keys of a row, and
a lane of the wgmma
accumulator holds two of a row's keys in each of its bytes, so each thread reads its two rows' bytes with
two 16-byte loads (BLOCK_N = 128) and expands them without a shuffle or shared memory.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@gluon.constexpr_function
def bytes_layout(rows, block_n):
    """The layout in which a thread loads its rows' bytes of a [rows, block_n // 8] bitmask tile (rows: a
    consumer warpgroup's 64): each of its two rows' bytes in consecutive registers (block_n // 8
    contiguous bytes: one vector load), a quad's four lanes reading the same bytes (each needs every byte
    of the row)."""
    cols = [[0, 1 << i] for i in range(_log2(block_n // 8))]
    return gl.DistributedLinearLayout(reg_bases=cols + [[8, 0]],
                                      lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                      shape=[rows, block_n // 8])


@gluon.constexpr_function
def bits_layout(rows, block_n):
    """A [rows, block_n // 8, 8] (row, byte, bit) layout that, reshaped to [rows, block_n], is the wgmma
    accumulator's (register 0: column bit 0, register 1: row + 8, then the column's byte; lanes: column bits
    1-2 and the row; warps: 16-row slabs), so the keep mask expanded in it converts to the scores' layout for
    free."""
    byte_cols = [[0, 1 << i, 0] for i in range(_log2(block_n // 8))]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0]] + byte_cols,
        lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[rows, block_n // 8, 8])


@gluon.jit
def _slab(sparse, off_b, off_h):
    """The index of (batch off_b, query head off_h)'s mask in the (B, H) dims (1 broadcasts)."""
    mask_b = sparse[6]
    mask_h = sparse[7]
    return (off_b % mask_b) * mask_h + off_h % mask_h


@gluon.jit
def ordered_block(sparse, off_b, off_h, rank):
    """The query block of launch rank `rank` (0: the longest block lists) of (off_b, off_h)."""
    Q_ORDER = sparse[5]
    n_qblocks = sparse[8]
    return gl.load(Q_ORDER + _slab(sparse, off_b, off_h).to(gl.int64) * n_qblocks + rank)


@gluon.jit
def block_lists(sparse, off_b, off_h, mq):
    """(at, full, partial): query block mq's row in the mask's (B, H, n_qblocks) arrays and its full and
    partial block counts."""
    FULL_NUM = sparse[0]
    PART_NUM = sparse[2]
    n_qblocks = sparse[8]
    at = _slab(sparse, off_b, off_h).to(gl.int64) * n_qblocks + mq
    return at, gl.load(FULL_NUM + at), gl.load(PART_NUM + at)


@gluon.jit
def key_of_step(sparse, at, full, j, BLOCK_N: gl.constexpr):
    """The first key of key step j of the query block at row `at` with `full` full blocks (the loader's)."""
    FULL_IDX = sparse[1]
    PART_IDX = sparse[3]
    max_full = sparse[9]
    max_part = sparse[10]
    sparse_n = sparse[11]
    subs = sparse[12]
    p = j // subs
    # both slots clamped into their lists (each at least one wide), the one that applies kept
    from_full = gl.load(FULL_IDX + at * max_full + gl.minimum(p, max_full - 1))
    from_part = gl.load(PART_IDX + at * max_part + gl.minimum(gl.maximum(p - full, 0), max_part - 1))
    block = gl.where(p < full, from_full, from_part)
    return block * sparse_n + (j - p * subs) * BLOCK_N


@gluon.jit
def partial_bits(sparse, at, full, j, row0, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(partial, bytes): whether key step j is a partial block's, and then its bitmask bytes for this
    warpgroup's ROWS rows (from row0 within the block) as int32 [ROWS, BLOCK_N // 8] in bits_layout's slice
    (zeros for a full block's step: the load is predicated off)."""
    PART_BITS = sparse[4]
    max_part = sparse[10]
    subs = sparse[12]
    row_bytes = sparse[13]
    p = j // subs
    partial = p >= full
    # slot p - full of the row's partial list: its (BLOCK_M, sparse_n / 8) bytes
    base = (PART_BITS + ((at * max_part + (p - full)) * BLOCK_M + row0) * row_bytes
            + (j - p * subs) * (BLOCK_N // 8))
    layout: gl.constexpr = bytes_layout(ROWS, BLOCK_N)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_N // 8, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows[:, None] * row_bytes + cols[None, :]
    by = gl.load(ptrs, mask=(rows[:, None] >= 0) & partial, other=0)
    return partial, gl.convert_layout(by, gl.SliceLayout(2, bits_layout(ROWS, BLOCK_N))).to(gl.int32)


@gluon.jit
def keep_of(by, s_layout: gl.constexpr):
    """The [rows, BLOCK_N] keep mask in s_layout of partial_bits' bytes: key c of row r is visible iff bit
    c % 8 of byte c // 8 is set."""
    ROWS: gl.constexpr = by.shape[0]
    BLOCK_N: gl.constexpr = by.shape[1] * 8
    layout: gl.constexpr = bits_layout(ROWS, BLOCK_N)
    bit = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    keep = ((gl.expand_dims(by, 2) >> bit[None, None, :]) & 1) != 0
    return gl.convert_layout(keep.reshape([ROWS, BLOCK_N]), s_layout)
