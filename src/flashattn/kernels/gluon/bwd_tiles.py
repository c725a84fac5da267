"""Which key tile a program of the Gluon backward (attn_bwd.py) owns, and which query tiles it visits.

The loader, the consumers and DETERMINISTIC's dQ writer all call `key_tile`: it is a pure function of the
program id and the problem, so each partition derives the same answer without a hand-off, except the
packed (varlen) layout's sequence, which the loader alone finds by bisection (`key_sequence`) and publishes
through shared memory (`program_sequence` reads it), as in the forward (schedule.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from flashattn.kernels.gluon.schedule import next_tile, sequence_of_tile, store_rows
from flashattn.kernels.triton.common import seq_bounds  # scalar arithmetic: Gluon calls triton.jit helpers


@gluon.jit
def key_sequence(problem, SPLIT: gl.constexpr):
    """Varlen: (this program's tile of the key-tile list, its sequence), found by bisection (the loader's
    search, whose result it hands the consumers through shared memory: `program_sequence`)."""
    per_tile = problem[0] * SPLIT  # nheads_k · SPLIT programs per key tile
    t = gl.program_id(0) // per_tile
    return t, sequence_of_tile(t, problem[9], problem[3] // per_tile)


@gluon.jit
def program_sequence(seq_smem, seq_ready, varlen: gl.constexpr):
    """A consumer's copy of the sequence the loader found (0 in the padded layout): the consumers do not
    search themselves, as in the forward (schedule.py)."""
    b = 0
    if varlen:
        _, b = next_tile(seq_smem, seq_ready, 0)
    return b


@gluon.jit
def writer_sequence(seq_smem, seq_ready, varlen: gl.constexpr):
    """`program_sequence` for a one-warp partition (the dQ writers): the sequence the loader found, 0 in the
    padded layout."""
    b = 0
    if varlen:
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        mbarrier.wait(seq_ready.index(0), 0)
        b = gl.max(seq_smem.index(2).load(one), 0)
    return b


@gluon.jit
def key_tile(problem, off_b, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              SPLIT: gl.constexpr, REVERSE: gl.constexpr = False):
    """(batch, kv head, its part of the group (SPLIT), first key, first query row, query tiles, the
    sequence's first query and key rows in the packed tensors, its query and key lengths) of this program;
    rows and keys count from the sequence's start. n_bhk counts batch · kv heads · SPLIT (the group's parts
    as heads of their own). Padded layout: common.grouped_program's order, rank 0 the first key tile, which
    every query sees under causal masking. Varlen (CU_Q given; off_b: the program's sequence,
    `key_sequence`): program p is tile p // (nheads_k · SPLIT) of the list of every sequence's key tiles
    (PLAN: the tiles before each sequence), then kv head and part, each sequence's first tile first; the grid
    is a bound on the list's length, and the programs past it get no query tiles (and store nothing). The
    query tiles are those with a row that sees a key of the tile. REVERSE: each head's (each sequence's) key
    tiles in the opposite order, the last one at the lowest rank (DETERMINISTIC's order under a right
    edge)."""
    nheads_k, seqlen_q, seqlen_k, n_bhk, lpt_group, left, right, CU_Q, CU_K, PLAN, STATS_ROW0 = problem
    pid = gl.program_id(0)
    if CU_Q is not None:
        t = pid // (nheads_k * SPLIT)
        off_hk = (pid // SPLIT) % nheads_k
        part = pid % SPLIT
        # seqlen_q / seqlen_k: the packed tensors' rows, each sequence clamped into them
        q_start, seqlen_q = seq_bounds(CU_Q, off_b, seqlen_q, True)
        k_start, seqlen_k = seq_bounds(CU_K, off_b, seqlen_k, True)
        if REVERSE:
            start_n = (gl.load(PLAN + off_b + 1) - 1 - t) * BLOCK_N
            if start_n < 0:  # past the list (t past the last sequence's tiles)
                start_n = seqlen_k
        else:
            start_n = (t - gl.load(PLAN + off_b)) * BLOCK_N
    else:
        n_tiles = gl.cdiv(seqlen_k, BLOCK_N)
        per_group = lpt_group * n_tiles
        g = pid // per_group
        r = pid - g * per_group
        heads = gl.minimum(lpt_group, n_bhk - g * lpt_group)
        off_bhk = g * lpt_group + r % heads
        start_n = (r // heads) * BLOCK_N
        if REVERSE:
            start_n = (n_tiles - 1 - r // heads) * BLOCK_N
        part = off_bhk % SPLIT
        off_bhk = off_bhk // SPLIT
        off_b = off_bhk // nheads_k
        off_hk = off_bhk % nheads_k
        q_start = 0
        k_start = 0
    # query i sees key j iff j <= i + seqlen_k - seqlen_q + right (causal: right = 0): from the first key's
    # first row; and iff j >= i + seqlen_k - seqlen_q - left: up to the last key's last row
    if CAUSAL:
        m_first = (gl.maximum(start_n - (seqlen_k - seqlen_q), 0) // BLOCK_M) * BLOCK_M
    elif right is not None:
        m_first = (gl.maximum(start_n - (seqlen_k - seqlen_q) - right, 0) // BLOCK_M) * BLOCK_M
    else:
        m_first = 0
    m_end = seqlen_q
    if left is not None:
        m_end = gl.minimum(gl.maximum(start_n + BLOCK_N - (seqlen_k - seqlen_q) + left, 0), seqlen_q)
    n_m = gl.cdiv(gl.maximum(m_end - m_first, 0), BLOCK_M)
    if CU_Q is not None:
        if start_n >= seqlen_k:  # past the list
            n_m = 0
    return off_b, off_hk, part, start_n, m_first, n_m, q_start, k_start, seqlen_q, seqlen_k


@gluon.jit
def step_rows(c, steps_per_head, head0, m_first, BLOCK_M: gl.constexpr, HEADS: gl.constexpr):
    """Step c of a program that walks steps_per_head query tiles of each of its HEADS query heads: (its query
    head, its first query row, whether it is its head's last step). With one head (HEADS a constexpr) c is
    the tile itself: no integer division by a runtime value, ~30 instructions a step whose MUFU.RCP and F2I
    queue behind the other warpgroup's exp2s on the same pipe, between the step's first wgmmas (d = 64
    causal ran 5% faster without it; d = 128 the same). More heads keep the division: carrying the head and
    row across steps instead spilled more than it saved."""
    off_h = head0
    i = c
    if HEADS > 1:
        g = c // steps_per_head
        off_h = head0 + g
        i = c - g * steps_per_head
    return off_h, m_first + i * BLOCK_M, i == steps_per_head - 1


@gluon.jit
def part_heads(off_hk, part, nheads_k, SPLIT: gl.constexpr, LOCK):
    """(the head, the heads) of the float32 dK / dV buffers a part of the GQA group split adds into: kv head
    off_hk of nheads_k, which every part adds into (atomics, in no fixed order); under DETERMINISTIC
    (LOCK given) head off_hk · SPLIT + part of nheads_k · SPLIT, one part an element, so that each element
    has one contributor and the parts are summed afterwards in a fixed order."""
    if LOCK is not None:
        return off_hk * SPLIT + part, nheads_k * SPLIT
    return off_hk, nheads_k


@gluon.jit
def add_key_tile(ACC, x, tile, d, col0: gl.constexpr, layout: gl.constexpr):
    """Add a warpgroup's columns [col0, col0 + x's width) of its keys' dK or dV (x: [keys, columns] in
    `layout`) into a float32 buffer shaped like k or v (contiguous (b, sk, h_k, d), or (total_k, h_k, d)
    under varlen), no key past seqlen_k and no column past d: the GQA group split's parts. tile: (the
    sequence's first key row in the buffer, x's first key, seqlen_k, kv head, kv heads)."""
    key_row0, key0, seqlen_k, off_hk, nheads_k = tile
    rows = key0 + gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
    first = (key_row0 * nheads_k + off_hk) * d
    offs = first + (rows.to(gl.int64) * (nheads_k * d))[:, None] + cols[None, :]
    inside = (rows < seqlen_k)[:, None] & (cols < d)[None, :]
    gl.atomic_add(ACC + offs, x, mask=inside, sem="relaxed")


@gluon.jit
def store_key_tiles(k_tile, v_tile, dk_desc, dv_desc, kv_rows, key_place, widths, VARLEN: gl.constexpr):
    """A warpgroup's staged dK and dV (k_tile, v_tile: its keys' TMA tiles of K and V in shared memory,
    (1, keys, 1, columns) as the descriptors' blocks) to global memory by TMA, or, where a packed sequence
    ends inside its keys (a TMA store would write the next sequence's), by masked stores of the keys inside,
    no column past the head dims. key_place: (batch, the sequence's first key row in the packed tensors, the
    tiles' first key, seqlen_k, the program's key tile start, kv head); widths: (d_qk, d_v); kv_rows: dk, dv
    and their row and head strides (varlen)."""
    off_b, k_start, key0, seqlen_k, start_n, off_hk = key_place
    d_qk, d_v = widths
    if VARLEN:
        DK, DV, stride_km, stride_kh, stride_vm, stride_vh = kv_rows
        KEYS: gl.constexpr = k_tile.shape[1]
        if start_n < seqlen_k:  # a tile of the list
            if key0 + KEYS > seqlen_k:
                n = seqlen_k - key0
                store_rows(k_tile.reshape([KEYS, k_tile.shape[3]]), DK, k_start + key0, n, off_hk, stride_km,
                           stride_kh, d_qk)
                store_rows(v_tile.reshape([KEYS, v_tile.shape[3]]), DV, k_start + key0, n, off_hk, stride_vm,
                           stride_vh, d_v)
            else:
                fence_async_shared()
                key = k_start + key0
                tma.async_copy_shared_to_global(dk_desc, [0, key, off_hk, 0], k_tile)
                tma.async_copy_shared_to_global(dv_desc, [0, key, off_hk, 0], v_tile)
    else:
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [off_b, key0, off_hk, 0], k_tile)
        tma.async_copy_shared_to_global(dv_desc, [off_b, key0, off_hk, 0], v_tile)
