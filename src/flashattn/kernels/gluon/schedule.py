"""The Gluon forward's persistent schedule: which query tile a work item is, its keys, and the hand-off of
each tile from the loader warp to the consumer warpgroups (kernels/gluon/attn_fwd.py).

Padded layout: work item t is common.grouped_program's (heads in groups, every head's heaviest tile first),
the Triton forward's order. Varlen (CU_Q given): the query tiles of all sequences form one list without
holes (kernels/triton/tiles.py writes the tiles before each sequence, PLAN); work item t is tile t // nheads
of it, head t % nheads, a sequence's last tile (its heaviest under causal masking) first. The loader finds a
tile's sequence by bisection and hands it on with the tile, so the consumers do not search. The varlen
backward (kernels/gluon/attn_bwd.py) finds its key tile's sequence with the same search, and both store a
sequence's last rows with `store_rows`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from flashattn.kernels.gluon.sparse import block_lists, ordered_block
from flashattn.kernels.triton.common import (  # scalar arithmetic: Gluon calls triton.jit helpers
    grouped_program,
    seq_bounds,
)


@gluon.jit
def sequence_of_tile(g, PLAN, batch):
    """The sequence b of tile g of a varlen list (the forward's query tiles, the backward's key tiles):
    PLAN[b] <= g < PLAN[b + 1], by bisection (a sequence without tiles has PLAN[b] = PLAN[b + 1], so the
    search never stops on one; a g past the list gives the last sequence with PLAN[b] <= g)."""
    lo = 0
    hi = batch  # PLAN[lo] <= g < PLAN[hi] throughout
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if gl.load(PLAN + mid) <= g:
            lo = mid
        else:
            hi = mid
    return lo


@gluon.jit
def sequence_of(t, problem):
    """The sequence of work item t (the loader's search; 0 in the padded layout, which derives it in
    `tile`)."""
    (nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter, left, right, CU_Q, CU_K, PLAN,
     PAGE_CAP, SPARSE) = problem
    b = 0
    if CU_Q is not None:
        b = sequence_of_tile(t // nheads, PLAN, n_bh // nheads)
    return b


@gluon.jit
def tile(t, b, problem, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         CAUSAL: gl.constexpr, PACK: gl.constexpr = 1):
    """(batch, head, kv head, first query row, first key, key tiles, the sequence's first query and key rows
    in the packed tensors, its query and key lengths) of work item t, of sequence b under varlen. Rows and
    keys count from the sequence's start; the key tiles are those some row of the tile sees: [n_start,
    n_start + n_k · BLOCK_N).
    PACK > 1 (FA3's pack_gqa): a tile's rows are a GQA group's query heads side by side, row r holding
    position r // PACK of head `head` + r % PACK (PACK: the group padded to a power of two, its rows past
    the group computed and never stored); work items count (batch or sequence, kv head) pairs (problem's
    nheads is the kv heads'), the returned head is the group's first and the first query row is a packed
    row (varlen: PLAN counts each sequence's tiles of packed rows).
    SPARSE (a block-sparse mask, sparse.py; padded layout, no band): the query tile of rank r is the mask's
    r-th in its launch order, and its key tiles are its block lists' (n_start 0, n_k their steps)."""
    (nheads, seqlen_q, seqlen_k, n_bh, lpt_group, n_work, tile_counter, left, right, CU_Q, CU_K, PLAN,
     PAGE_CAP, SPARSE) = problem
    if CU_Q is not None:
        # seqlen_q / seqlen_k: the packed tensors' rows, into which each sequence is clamped as the Triton
        # kernels clamp it (cu_seqlens' values are not checked on the device)
        q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q, True)
        if PAGE_CAP is not None:
            # paged keys (the loader maps them through the block table): they count from 0 in the
            # sequence's pages, at most the table's capacity, so every key maps to one of its entries
            k_start = 0
            seqlen_k = gl.minimum(gl.maximum(gl.load(CU_K + b + 1) - gl.load(CU_K + b), 0), PAGE_CAP)
        else:
            k_start, seqlen_k = seq_bounds(CU_K, b, seqlen_k, True)
        n_tiles = gl.cdiv(seqlen_q * PACK, BLOCK_M)
        rank = t // nheads - gl.load(PLAN + b)
        off_b = b
        off_h = t % nheads
    else:
        q_start = 0
        k_start = 0
        n_tiles = gl.cdiv(seqlen_q * PACK, BLOCK_M)
        off_bh, rank = grouped_program(t, n_bh, n_tiles, lpt_group)
        off_b = off_bh // nheads
        off_h = off_bh % nheads
    off_hk = off_h // GROUP
    if PACK > 1:
        off_hk = off_h
        off_h = off_hk * GROUP
    # rank 0 is the last query tile, the one with the most keys under causal masking
    start_m = (n_tiles - 1 - rank) * BLOCK_M
    # the tile's positions [pos0, pos_end): its rows', or under PACK its packed rows' (a position's heads are
    # adjacent rows)
    pos0 = start_m // PACK
    pos_end = (start_m + BLOCK_M - 1) // PACK + 1
    # the last row's last key (+ 1), and the first row's first key
    if CAUSAL:
        n_end = gl.minimum(gl.maximum(pos_end + seqlen_k - seqlen_q, 0), seqlen_k)
    elif right is not None:
        n_end = gl.minimum(gl.maximum(pos_end + seqlen_k - seqlen_q + right, 0), seqlen_k)
    else:
        n_end = seqlen_k
    n_k = gl.cdiv(n_end, BLOCK_N)
    n_start = 0
    if left is not None:
        # clamped before dividing: // truncates toward 0
        first = gl.maximum(pos0 + seqlen_k - seqlen_q - left, 0) // BLOCK_N
        n_k = gl.maximum(n_k - first, 0)
        n_start = first * BLOCK_N
    if SPARSE[0] is not None:
        # no band (the launcher's): the mask's lists replace the key range
        mq = ordered_block(SPARSE, off_b, off_h, rank)
        _, full, part = block_lists(SPARSE, off_b, off_h, mq)
        start_m = mq * BLOCK_M
        n_k = (full + part) * SPARSE[12]
    return off_b, off_h, off_hk, start_m, n_start, n_k, q_start, k_start, seqlen_q, seqlen_k


@gluon.jit
def publish_tile(tile_smem, tile_ready, qb, t, b):
    """Write work item t (and under varlen its sequence b) into slot qb and release it to the consumers (the
    loader warp). The slot has its own barrier, arrived by this warp alone, so the index does not wait for
    Q's bytes to land (q_ready's phase ends with the TMA's). racecheck reports this hand-off all the same,
    and not the same protocol in a kernel that does nothing but this hand-off: its reports here say nothing
    about a race."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_smem.index(qb).store(gl.full([1], t, gl.int32, one))
    if tile_smem.shape[0] > 2:  # varlen: the sequences in a second pair of slots
        tile_smem.index(2 + qb).store(gl.full([1], b, gl.int32, one))
    # every lane's store before the one lane's arrive
    gl.thread_barrier()
    mbarrier.arrive(tile_ready.index(qb), count=1)


@gluon.jit
def next_tile(tile_smem, tile_ready, i):
    """The consumers' i-th work item (n_work: none left) and under varlen its sequence (else 0), from the
    loader's slot."""
    qb = i % 2
    mbarrier.wait(tile_ready.index(qb), (i // 2) & 1)
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t = gl.max(tile_smem.index(qb).load(rows), 0)
    b = 0
    if tile_smem.shape[0] > 2:
        b = gl.max(tile_smem.index(2 + qb).load(rows), 0)
    return t, b


@gluon.jit
def store_rows(tile, O, row, n_rows, off_h, stride_om, stride_oh, n_cols=None, PACK: gl.constexpr = 1,
               GROUP: gl.constexpr = 1):
    """Rows [0, n_rows) of a warpgroup's staged [rows, d] tile (shared memory) to O's rows from `row` on, of
    head off_h: 16 bytes a thread and store, no row past n_rows (and no column past n_cols, where given: a
    tile wider than what is left of the row's columns); where a packed sequence ends inside a tile,
    whose TMA store would write the next sequence's rows (the forward's O, the backward's dK and dV). Masked
    stores straight from the accumulator's registers, with a 64-bit address per element, spilled 0.4 KB at
    d = 128. PACK > 1 (the forward's packed GQA tiles, their first row a position's first head): tile row r
    is O's row `row` + r // PACK of head off_h + r % PACK, n_rows counting positions, heads past GROUP
    not stored."""
    ROWS: gl.constexpr = tile.shape[0]
    D: gl.constexpr = tile.shape[1]
    VEC: gl.constexpr = 16 // tile.dtype.primitive_bitwidth * 8  # elements in 16 bytes
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (D // VEC), D // VEC], [4, 1], [1, 0])
    # every warp's rows staged before any thread reads another's
    gl.thread_barrier()
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    pos = rows // PACK
    heads = off_h + rows % PACK
    ptrs = O + (row + pos).to(gl.int64)[:, None] * stride_om + heads[:, None] * stride_oh + cols[None, :]
    inside = (pos[:, None] < n_rows) & (cols[None, :] < D)
    if PACK > GROUP:
        inside = inside & (rows[:, None] % PACK < GROUP)
    if n_cols is not None:
        inside = inside & (cols[None, :] < n_cols)
    gl.store(ptrs, tile.load(layout), mask=inside)
    # these generic-proxy reads before a later TMA (async-proxy) write into the buffer (the forward's next Q)
    fence_async_shared()
