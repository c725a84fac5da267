"""dQ's way out of the Gluon backward (attn_bwd.py; the dQ writer serves attn_bwd_keys.py too): each
consumer warpgroup's dQ columns of a query tile go through a float32 staging tile in shared memory and a TMA
reduce-add into the float32 dQ buffer, or, under DETERMINISTIC, to a dQ-writer warp that adds them in a
fixed order across programs (FA3's scheme: a counter per query head and tile in global memory, waited on
with acquire loads and counted into with a release add once the writer's own adds have landed).
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from flashattn.kernels.gluon.bwd_tiles import key_tile, writer_sequence


@builtin
def reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor .add). Triton
    3.6's Gluon builds the op but exports no wrapper for it; the project pins triton 3.6.*."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    kind = ir.DESCRIPTOR_REDUCE_KIND.ADD
    _semantic.builder.create_async_tma_reduce(kind, tensor_desc.handle, coord, src.handle)


@gluon.jit
def store_dq(dq, dq_buf, dq_desc, desc_b, row, off_h, sm_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr,
              HALF_D: gl.constexpr, handoff, k):
    """Scale this warpgroup's dQ columns of one query tile and reduce-add them through its staging tile
    (varlen: rows past the sequence's end add zeros into the next sequence's, or fall past the tensor).
    DETERMINISTIC (handoff: the dQ writer's (dq_full, dq_empty) barriers; k: this store's index): stage them
    for the writer instead, once it has read the previous store's."""
    if handoff is not None:
        dq_full, dq_empty = handoff
        # a fresh mbarrier counts as having completed the phase before 0, so the first store does not wait
        mbarrier.wait(dq_empty, (k & 1) ^ 1)
        dq_buf.reshape([BLOCK_M, HALF_D]).store(dq * sm_scale)
        fence_async_shared()
        mbarrier.arrive(dq_full, count=1)
    else:
        tma.store_wait(0)  # the previous reduce-add has read the staging tile
        dq_buf.reshape([BLOCK_M, HALF_D]).store(dq * sm_scale)
        fence_async_shared()
        reduce_add(dq_desc, [desc_b, row, off_h, WG * HALF_D], dq_buf)


@gluon.jit
def warp_lanes():
    """0..31 across the dQ writer's one warp."""
    return gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))


@gluon.jit
def wait_count(counter, target, lanes):
    """Spin until the int32 counter in global memory reaches target (acquire: what was written before its
    increments is visible after), then order what follows, TMA operations included, after it."""
    ptrs = counter + lanes * 0
    seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)
    while gl.min(seen, axis=0) < target:
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("fence.proxy.async;\n\tmov.u32 $0, 0;", "=r,r", [lanes], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def count_in(counter, lanes):
    """Wait until this warp's TMA operations have completed, their writes included (tma.store_wait waits
    for their reads only), then add 1 to the counter with release semantics, from lane 0."""
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tcp.async.bulk.wait_group 0;\n\tbar.warp.sync -1;\n\t"
        "setp.eq.u32 p, $1, 0;\n\t@p fence.proxy.async;\n\t@p red.release.gpu.global.add.s32 [$2], 1;\n\t"
        "mov.u32 $0, 0;\n\t}",
        "=r,r,l", [lanes, counter + lanes * 0], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def count_slot(det, off_b, off_h, q_start, t0, TILE: gl.constexpr, n, n_last, diag, left, right,
               BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The counter of head off_h's counter tile of TILE rows from row t0 (det: the kernel's (LOCK, its batch
    and head strides, ...)), and how many programs add into that tile before this one, key tile n. The key
    tiles that see a row of the tile form one run [lo, hi] (key_tile); before this one: those above it under
    a right edge (the tile's last row's right edge bounds hi), else those below it (its first row's left
    edge bounds lo)."""
    LOCK = det[0]
    stride_lock_b, stride_lock_h = det[1]
    if CAUSAL:
        before = gl.minimum(n_last, (t0 + TILE - 1 + diag) // BLOCK_N) - n
    elif right is not None:
        before = gl.minimum(n_last, (t0 + TILE - 1 + diag + right) // BLOCK_N) - n
    elif left is not None:
        before = n - gl.maximum(t0 + diag - left, 0) // BLOCK_N
    else:
        before = n
    counter = LOCK + off_b.to(gl.int64) * stride_lock_b + off_h.to(gl.int64) * stride_lock_h + q_start + t0
    return counter, before


@gluon.jit
def writer_tile(problem, seq_smem, seq_ready, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                GROUP: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    """A dQ writer's program as its consumers see it (key_tile in the fixed order's launch order: the last key
    tile first under a right edge): (batch, its part's first query head, the dQ descriptor's batch, first
    query row, query tiles, the sequence's first query row, the key tile's index, the last key tile's, and
    seqlen_k - seqlen_q)."""
    varlen: gl.constexpr = problem[7] is not None
    b = writer_sequence(seq_smem, seq_ready, varlen)
    off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, seqlen_q, seqlen_k = key_tile(
        problem, b, BLOCK_M, BLOCK_N, CAUSAL, SPLIT, CAUSAL or problem[6] is not None)
    head0 = off_hk * GROUP + part * (GROUP // SPLIT)
    desc_b = 0 if varlen else off_b
    return (off_b, head0, desc_b, m_first, n_m, q_start, start_n // BLOCK_N, gl.cdiv(seqlen_k, BLOCK_N) - 1,
            seqlen_k - seqlen_q)


@gluon.jit
def dq_writer(args, loader_args, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, DEFER_DQ: gl.constexpr,
              SPLIT: gl.constexpr, SETS: gl.constexpr = 1, COUNT_M: gl.constexpr = 0):
    """DETERMINISTIC: reduce-add each step's staged dQ tiles (HEAD_DIM's columns in units of the dQ
    descriptor's width, tile w holding unit w: attn_bwd.py's two warpgroups' halves, attn_bwd_keys.py's
    three 64-column units) in the fixed order.
    Store k of this program is step k's query tile and head, in the consumers' step order (DEFER_DQ stores
    a step late, in the same order), staged in set k % SETS (its units in tiles (k % SETS) · units + w, its
    barriers dq_full / dq_empty index k % SETS). The order is kept per counter tile of COUNT_M rows (BLOCK_M
    where 0; a multiple of BLOCK_M, the same for every program of a launch): at counter tile t the programs
    add in the order of their key tiles, the last first under a right edge; its counter holds how many have
    added, so this program waits for the number of key tiles that see a row of t and come before its own,
    adds its steps in t, and counts in once (a wait for its adds to land and a release add, each an L2 round
    trip: COUNT_M = 2 · BLOCK_M halves them for 32-row steps)."""
    dq_desc = args[2]
    dq_smem = args[9]
    seq_smem = args[10]
    seq_ready = args[11][5]
    problem = args[13]
    _, _, dq_full, dq_empty = args[17]
    left = problem[5]
    right = problem[6]
    off_b, head0, desc_b, m_first, n_m, q_start, n, n_last, diag = writer_tile(
        problem, seq_smem, seq_ready, BLOCK_M, BLOCK_N, GROUP, CAUSAL, SPLIT)
    HEADS: gl.constexpr = GROUP // SPLIT
    TILE: gl.constexpr = BLOCK_M if COUNT_M == 0 else COUNT_M
    gl.static_assert(TILE % BLOCK_M == 0)
    # the staged tiles: HEAD_DIM's columns in units of the dQ descriptor's width, one tile per unit
    W: gl.constexpr = dq_desc.block_type.shape[3]
    UNITS: gl.constexpr = HEAD_DIM // W
    lanes = warp_lanes()
    c = 0  # the stores so far
    for g in range(HEADS):
        off_h = head0 + g
        i = 0
        while i < n_m:
            m0 = m_first + i * BLOCK_M
            t0 = (m0 // TILE) * TILE
            k = gl.minimum(n_m - i, (t0 + TILE - m0) // BLOCK_M)  # this program's steps in counter tile t0
            counter, before = count_slot(args[17], off_b, off_h, q_start, t0, TILE, n, n_last, diag, left,
                                         right, BLOCK_N, CAUSAL)
            wait_count(counter, before, lanes)  # while the consumers compute the step
            for j in range(k):
                st = c + j
                mbarrier.wait(dq_full.index(st % SETS), (st // SETS) & 1)
                for w in gl.static_range(UNITS):
                    reduce_add(dq_desc, [desc_b, q_start + m0 + j * BLOCK_M, off_h, w * W],
                               dq_smem.index((st % SETS) * UNITS + w))
                tma.store_wait(0)  # the staging tiles read: the consumers may write the next ones
                mbarrier.arrive(dq_empty.index(st % SETS), count=1)
            count_in(counter, lanes)
            c += k
            i += k
