"""The Gluon forward's loader warp (attn_fwd.py): takes the program's work items from the persistent
schedule (schedule.py), publishes each to the consumers, and streams each tile's Q (its buffers, one per
consumer warpgroup and column chunk) and its K/V tiles through the ring of TMA stages, one mbarrier pair
(ready / empty) per stage and operand; an FP8 V is read K-major; under a block-sparse mask, the K/V tiles
of the tile's block lists (sparse.py). Last, it resets the tile counter for the
next launch."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from flashattn.kernels.gluon.schedule import publish_tile, sequence_of, tile
from flashattn.kernels.gluon.scores import HALF_M
from flashattn.kernels.gluon.sparse import block_lists, key_of_step


@gluon.jit
def _page_of(pages, page_cap, off_b, pos):
    """(page, row) of sequence off_b's key pos in the page pools: its block-table entry, clamped into the
    pool (a bad entry reads another page, never outside the pool), and the row within it. pos may be one tile
    past the sequence's visited keys (the loader's read-ahead): its column is clamped into the table."""
    PAGES, stride_pages, num_pages, page_size = pages
    col = gl.minimum(pos // page_size, page_cap // page_size - 1)
    page = gl.load(PAGES + off_b.to(gl.int64) * stride_pages + col)
    return gl.minimum(gl.maximum(page, 0), num_pages - 1), pos % page_size


@gluon.jit
def loader(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, PACK: gl.constexpr):
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_smem, bars, problem, pages = loader_args
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    CW: gl.constexpr = k_desc.block_type.shape[3]  # the columns of a Q or K chunk
    NCH: gl.constexpr = HEAD_DIM // CW
    Q_BUFS: gl.constexpr = q_smem.shape[0] // (CONSUMERS * NCH)
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ready = bars
    n_work = problem[5]
    tile_counter = problem[6]
    varlen: gl.constexpr = problem[9] is not None
    c = 0  # K/V tiles loaded so far, across query tiles: the ring slot and its phase
    i = 0  # query tiles taken so far: the Q buffer and its phase
    t = gl.program_id(0)
    while t < n_work:
        b = sequence_of(t, problem)
        off_b, off_h, off_hk, start_m, n_start, n_k, q_start, k_start, _, _ = tile(t, b, problem, GROUP,
                                                                                  BLOCK_M, BLOCK_N, CAUSAL,
                                                                                  PACK)
        # varlen: the packed tensors' descriptors have one batch, and a sequence's rows start at its offsets;
        # rows past its end are the next sequence's (the consumers mask and never store them)
        desc_b = 0 if varlen else off_b
        qb = i % Q_BUFS
        # a fresh mbarrier counts as having completed the phase before 0, so the first pass does not wait
        mbarrier.wait(q_empty.index(qb), ((i // Q_BUFS) & 1) ^ 1)
        # the work item's slot: two, whatever the Q buffers (one Q buffer: the consumers took item i - 2's
        # index before they released item i - 1's Q)
        publish_tile(tile_smem, tile_ready, i % 2, t, b)
        mbarrier.expect(q_ready.index(qb), CONSUMERS * NCH * q_desc.block_type.nbytes)
        for w in gl.static_range(CONSUMERS):
            for ch in gl.static_range(NCH):
                row = q_start + start_m + w * HALF_M
                buf = q_smem.index((CONSUMERS * qb + w) * NCH + ch)
                if PACK > 1:
                    # q as (batch, seqlen, heads_k, the group, d): a block of positions x the group's heads
                    # (start_m, a packed row, counts within the sequence; q_start, a position, does not)
                    packed = start_m + w * HALF_M
                    at = [desc_b, q_start + packed // PACK, off_hk, packed % PACK, ch * CW]
                    tma.async_copy_global_to_shared(q_desc, at, q_ready.index(qb), buf)
                else:
                    tma.async_copy_global_to_shared(q_desc, [desc_b, row, off_h, ch * CW], q_ready.index(qb),
                                                    buf)
        # the first key tile's (page, row) in the descriptors' first two dims: (batch, key) unpaged; paged,
        # each tile's page is read a tile ahead, so its load's latency overlaps the ring's waits
        kv_b = desc_b
        key = k_start + n_start
        if pages[0] is not None:
            kv_b, key = _page_of(pages, problem[12], off_b, n_start)
        sparse = problem[13]
        if sparse[0] is not None:
            at, full, _ = block_lists(sparse, off_b, off_h, start_m // BLOCK_M)
        for j in range(n_k):
            s = c % STAGES
            phase = ((c // STAGES) & 1) ^ 1
            if sparse[0] is not None:
                # the block lists' step j (sparse.py): the padded layout, so k_start is 0
                key = key_of_step(sparse, at, full, j, BLOCK_N)
            next_b = kv_b
            next_key = key + BLOCK_N
            if pages[0] is not None:
                next_b, next_key = _page_of(pages, problem[12], off_b, n_start + (j + 1) * BLOCK_N)
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), NCH * k_desc.block_type.nbytes)
            for ch in gl.static_range(NCH):
                tma.async_copy_global_to_shared(k_desc, [kv_b, key, off_hk, ch * CW], k_ready.index(s),
                                                k_smem.index(s * NCH + ch))
            mbarrier.wait(v_empty.index(s), phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            if v_desc.dtype.primitive_bitwidth == 8:
                # K-major V: the descriptor is over (batch, heads_k, dv, seqlen)
                tma.async_copy_global_to_shared(v_desc, [kv_b, off_hk, 0, key], v_ready.index(s),
                                                v_smem.index(s))
            else:
                tma.async_copy_global_to_shared(v_desc, [kv_b, key, off_hk, 0], v_ready.index(s),
                                                v_smem.index(s))
            kv_b = next_b
            key = next_key
            c += 1
        i += 1
        # the next tile goes to whichever program asks first (the first num_programs are taken by program
        # id): a static walk gave some programs 15% more causal work than the mean
        t = gl.atomic_add(tile_counter, 1, sem="relaxed") + gl.num_programs(0)
    # no tile left: a slot holding n_work tells the consumers to stop
    mbarrier.wait(q_empty.index(i % Q_BUFS), ((i // Q_BUFS) & 1) ^ 1)
    publish_tile(tile_smem, tile_ready, i % 2, n_work, 0)
    # the last program to get here zeroes the counter for the next launch, which saves the host a zeroing
    # launch per call: every program's last take precedes its arrival (release), and the last
    # arrival sees them all (acquire), so no take can follow the reset
    arrived = gl.atomic_add(tile_counter + 1, 1, sem="acq_rel")
    if arrived == gl.num_programs(0) - 1:
        gl.atomic_xchg(tile_counter, 0, sem="relaxed")
        gl.atomic_xchg(tile_counter + 1, 0, sem="relaxed")
