"""Block-sparse masks (flashattn.masks' kernel tensors) in the Gluon backward (attn_bwd.py): a program's key
tile walks the query blocks of its key block's column lists instead of a contiguous range of query tiles,
its full blocks unmasked and its partial ones through their bitmasks, so the (Q, dO) tiles of empty blocks
are never loaded.

`sparse` is the kernel's tuple (Q_FULL_NUM, Q_FULL_IDX, Q_PART_NUM, Q_PART_IDX, Q_PART_SLOT, K_ORDER,
PART_BITS, mask_b, mask_h, n_kblocks, n_qblocks, max_qfull, max_qpart, max_part), all None when the call has
no mask: the column lists of BlockMaskKernelTensors, its launch order of key blocks and the row-major bits
of its partial blocks, the mask's batch and head dims (1: broadcast), its key and query blocks and its
lists' widths (the column lists', then the row lists' whose slots index the bits). The mask's blocks are
MASK_BLOCK x MASK_BLOCK (the route holds them so): a key block is the program's key tile, and a query block
is MASK_BLOCK // BLOCK_M of the program's steps.

Step i of a program (of each of its query heads) is list slot p = i // (MASK_BLOCK // BLOCK_M), its full
blocks first, then its partial ones; the loader and both consumers derive the same rows. The lists are per
query head: a program over several of a group's heads takes a mask shared by the heads (mask_h 1), else
the route gives a program each head (the GQA split).

A partial step's bits, for a consumer thread of the Sᵀ accumulator (keys x query rows): it holds keys
16·warp + lane / 4 and 8 more against query rows 2·(lane % 4) + 8k + {0, 1}, so from each of its rows'
bitmask rows it needs the bytes 2·warp and 2·warp + 1 of its warpgroup's eight, the bit lane / 4 of each:
one two-byte load a row, BLOCK_M / 4 a step, in a layout whose expansion by bit is the accumulator's (no
shuffle, no shared memory), as the forward's (sparse.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MASK_BLOCK = gl.constexpr(128)  # the mask's blocks, query rows and keys: the backward's key tile


@gluon.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@gluon.constexpr_function
def bits_t_layout(block_m):
    """A [4, 16, block_m] (16-key slab, bit, query row) layout of a warpgroup's 64 keys (key 16 · slab + bit)
    which, reshaped to [64, block_m], is the Sᵀ accumulator's up to the order of a thread's registers
    (register 0: the bit 8 further, the keys 8 further; register 1: the next row; then the rows 8 · 2^i
    further; lanes: row bits 1-2, then bits 0-2; warps: the slab): a thread's two bytes of a row are one
    16-bit word of its slab, which it holds for each of its rows."""
    rows = [[0, 0, 8 << i] for i in range(_log2(block_m // 8))]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 8, 0], [0, 0, 1]] + rows,
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, block_m])


@gluon.jit
def sparse_key_tile(sparse, off_b, head0, rank_n, BLOCK_M: gl.constexpr):
    """(start_n, lists, full, n_m) of the program that key_tile (bwd_tiles.py) placed at key tile rank_n / 128
    of (off_b, head0): its key tile is the mask's key block of that launch rank (K_ORDER: the longest column
    lists first); lists: where that block's column lists (full, partial, the partial pairs' slots) and its
    heads' bits start, and the bits' slots per query block; full: its full query blocks; n_m: its steps.
    A program over several query heads has one mask for them all (mask_h 1: the route's), so head0's lists
    are each head's."""
    Q_FULL_NUM = sparse[0]
    Q_FULL_IDX = sparse[1]
    Q_PART_NUM = sparse[2]
    Q_PART_IDX = sparse[3]
    Q_PART_SLOT = sparse[4]
    K_ORDER = sparse[5]
    PART_BITS = sparse[6]
    mask_b = sparse[7]
    mask_h = sparse[8]
    n_kblocks = sparse[9]
    n_qblocks = sparse[10]
    max_part = sparse[13]
    slab = ((off_b % mask_b) * mask_h + head0 % mask_h).to(gl.int64)
    block = gl.load(K_ORDER + slab * n_kblocks + rank_n // MASK_BLOCK)
    at = slab * n_kblocks + block
    full = gl.load(Q_FULL_NUM + at)
    n_m = (full + gl.load(Q_PART_NUM + at)) * (MASK_BLOCK // BLOCK_M)
    # the bits of the slab's query blocks: (n_qblocks, max_part, MASK_BLOCK, MASK_BLOCK / 16) words
    bits = PART_BITS + slab * n_qblocks * max_part * (MASK_BLOCK * MASK_BLOCK // 16)
    lists = (Q_FULL_IDX + at * sparse[11], Q_PART_IDX + at * sparse[12], Q_PART_SLOT + at * sparse[12], bits,
             max_part)
    return block * MASK_BLOCK, lists, full, n_m


@gluon.jit
def step_block(lists, full, i, BLOCK_M: gl.constexpr):
    """(query block, its first row) of step i of the key block whose lists these are (`sparse_key_tile`),
    with `full` full query blocks: slot p = i // (MASK_BLOCK // BLOCK_M) of its full list, else slot
    p - full of its partial one (p < full + partial: one load, in bounds)."""
    SUBS: gl.constexpr = MASK_BLOCK // BLOCK_M
    p = i // SUBS
    block = gl.load(gl.where(p < full, lists[0] + p, lists[1] + (p - full)))
    return block, block * MASK_BLOCK + (i - p * SUBS) * BLOCK_M


@gluon.jit
def step_row(lists, full, i, BLOCK_M: gl.constexpr):
    """The first query row of step i (the loader's)."""
    _, m0 = step_block(lists, full, i, BLOCK_M)
    return m0


@gluon.jit
def transposed_bits(lists, full, i, block, WG: gl.constexpr, BLOCK_M: gl.constexpr):
    """(partial, words): whether step i (of query block `block`, step_block's) is a partial block's, then the
    bitmask of warpgroup WG's 64 keys for the step's BLOCK_M query rows as int16 [4, BLOCK_M] words
    (16-key slab, row) in bits_t_layout's slice (zeros for a full block's step: the loads are predicated
    off). PART_BITS is read as 16-bit words (little-endian: a word's low byte holds its first 8 keys)."""
    SUBS: gl.constexpr = MASK_BLOCK // BLOCK_M
    ROW_WORDS: gl.constexpr = MASK_BLOCK // 16
    p = i // SUBS
    partial = p >= full
    # the pair's slot in the query block's row lists, which holds its bits
    slot = gl.load(lists[2] + (p - full), mask=partial, other=0)
    base = lists[3] + ((block * lists[4] + slot) * MASK_BLOCK + (i - p * SUBS) * BLOCK_M) * ROW_WORDS + WG * 4
    layout: gl.constexpr = gl.SliceLayout(1, bits_t_layout(BLOCK_M))
    slab = gl.arange(0, 4, layout=gl.SliceLayout(1, layout))
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
    ptrs = base + slab[:, None] + rows[None, :] * ROW_WORDS
    return partial, gl.load(ptrs, mask=(slab[:, None] >= 0) & partial, other=0)


@gluon.jit
def keep_t_of(words):
    """The [64, BLOCK_M] keep mask (keys x query rows) of transposed_bits' words, in the Sᵀ accumulator's
    layout up to register order (bits_t_layout): key 16 · c + e of row r is visible iff bit e of word c of
    r's bitmask row is set."""
    BLOCK_M: gl.constexpr = words.shape[1]
    layout: gl.constexpr = bits_t_layout(BLOCK_M)
    bit = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    keep = ((gl.expand_dims(words, 1) >> bit[None, :, None]) & 1) != 0
    return keep.reshape([64, BLOCK_M])
