"""Warp-specialised Hopper forward in Gluon (Triton's explicit-layout dialect), FlashAttention-3's schedule.

Why a second forward body: Triton 3.6 gives no warp specialisation on sm_90 (its automatic pass leaves our
loop unchanged, NOTES v2/v14) and its pipeliner waits for every QK^T right after issuing it, so the tensor
cores idle during the softmax. Here the roles are explicit:
  - a loader warp streams K and V tiles through a ring of shared-memory stages with TMA, one mbarrier pair
    (ready: bytes landed; empty: both consumers done) per stage and operand;
  - two consumer warpgroups each own 64 query rows of the 128-row tile. Inside one, the next tile's QK^T and
    the previous tile's PV are in flight while the softmax runs (wgmma is asynchronous; we wait explicitly),
    and the two warpgroups never synchronise with each other, so one's softmax overlaps the other's matmuls.
Only the plain case comes here (16-bit, padded layout, head dim 64 or 128, causal or not, GQA): every other
feature keeps the Triton kernel (attn_fwd.py), whose online-softmax invariants this body shares.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup: the wgmma M of one warpgroup
LN2 = gl.constexpr(0.6931471805599453)  # the kernel works in base 2; LSE leaves it as a natural log


@gluon.jit
def _tile_plan(seqlen_q, seqlen_k, start_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """Key tiles the query rows [start_m, start_m + BLOCK_M) visit (causal: bottom-right aligned)."""
    if CAUSAL:
        n_end = gl.minimum(gl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0), seqlen_k)
    else:
        n_end = seqlen_k
    return gl.cdiv(n_end, BLOCK_N)


@gluon.jit
def _program(n_bh, n_tiles, group):
    """(batch·head, tile rank) of this program: common.grouped_program's order (heads in groups, every head's
    heaviest tile first), restated here because Gluon cannot call a triton.jit function."""
    pid = gl.program_id(0)
    per_group = group * n_tiles
    g = pid // per_group
    r = pid - g * per_group
    heads = gl.minimum(group, n_bh - g * group)
    return g * group + r % heads, r // heads


@gluon.jit
def _loader(args, loader_args, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            CAUSAL: gl.constexpr):
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, off_b, off_h, off_hk, start_m, n_k = loader_args
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, start_m, off_h, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [off_b, start_m + HALF_M, off_h, 0], q_bar, q_smem.index(1))
    for j in range(n_k):
        s = j % STAGES
        # a fresh mbarrier counts as having completed the phase before 0, so the first pass does not wait
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, j * BLOCK_N, off_hk, 0], k_ready.index(s),
                                        k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, j * BLOCK_N, off_hk, 0], v_ready.index(s),
                                        v_smem.index(s))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, offs_q, start_n, seqlen_k, diag, unmasked_to, s_layout: gl.constexpr,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """One tile of the online softmax (base 2): (p, m_new, l_new, alpha)."""
    if start_n + BLOCK_N > unmasked_to:
        offs_k = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = offs_k[None, :] < seqlen_k
        if CAUSAL:
            keep = keep & (offs_k[None, :] <= offs_q[:, None] + diag)
        sc = gl.where(keep, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        # a row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - m_sub[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = m_new
        p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _consumer(args, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
              WG: gl.constexpr):
    (o_desc, q_smem, k_smem, v_smem, bars, LSE, stride_lse_b, stride_lse_h, off_b, off_h, start_m, n_k,
     seqlen_q, seqlen_k, qk_scale) = args
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    row0 = start_m + WG * HALF_M
    diag = seqlen_k - seqlen_q
    offs_q = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    # tiles ending at or before unmasked_to need no predicate for any row of this warpgroup
    unmasked_to = seqlen_k
    if CAUSAL:
        unmasked_to = gl.minimum(unmasked_to, row0 + diag + 1)

    q = q_smem.index(WG).reshape([HALF_M, HEAD_DIM])
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar, 0)

    if n_k > 0:
        # tile 0: QK^T alone
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, offs_q, 0, seqlen_k, diag, unmasked_to, s_layout,
                                      BLOCK_N, CAUSAL)
        for j in range(1, n_k):
            cur = j % STAGES
            prev = (j - 1) % STAGES
            # issue this tile's QK^T, then the previous tile's PV; the softmax below runs while they do
            mbarrier.wait(k_ready.index(cur), (j // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(cur).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            # wgmma groups retire in order: one left outstanding means QK^T is done, PV may still run
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(cur), count=1)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, offs_q, j * BLOCK_N, seqlen_k, diag,
                                          unmasked_to, s_layout, BLOCK_N, CAUSAL)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            # the PV just finished was in the previous max's units
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        last = (n_k - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_k - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)

    # rows that saw no key: out = 0 and lse = +inf (flash_attn's convention)
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    gl.store(LSE + off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h + offs_q, lse,
             mask=offs_q < seqlen_q)
    # the Q rows are no longer read: their shared memory stages O for the TMA store, which clips rows
    # past seqlen_q
    q_smem.index(WG).reshape([HALF_M, HEAD_DIM]).store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, 0], q_smem.index(WG))
    tma.store_wait(0)


@gluon.jit
def _consumer0(args, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               CAUSAL: gl.constexpr):
    _consumer(args, STAGES, BLOCK_N, HEAD_DIM, CAUSAL, 0)


@gluon.jit
def _consumer1(args, loader_args, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               CAUSAL: gl.constexpr):
    # a worker partition: same signature as the loader's
    _consumer(args, STAGES, BLOCK_N, HEAD_DIM, CAUSAL, 1)


@gluon.jit
def attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, stride_lse_b, stride_lse_h,
    nheads, seqlen_q, seqlen_k, qk_scale, n_bh, lpt_group,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 2 * HALF_M)
    n_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    off_bh, rank = _program(n_bh, n_tiles, lpt_group)
    off_b = off_bh // nheads
    off_h = off_bh % nheads
    off_hk = off_h // GROUP
    # rank 0 is the last query tile, the one with the most keys under causal masking
    start_m = (n_tiles - 1 - rank) * BLOCK_M
    n_k = _tile_plan(seqlen_q, seqlen_k, start_m, BLOCK_M, BLOCK_N, CAUSAL)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # released by both consumer warpgroups
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty)

    args = (o_desc, q_smem, k_smem, v_smem, bars, LSE, stride_lse_b, stride_lse_h, off_b, off_h, start_m, n_k,
            seqlen_q, seqlen_k, qk_scale)
    loader_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, off_b, off_h, off_hk, start_m, n_k)
    gl.warp_specialize([
        (_consumer0, (args, STAGES, BLOCK_N, HEAD_DIM, CAUSAL)),
        (_consumer1, (args, loader_args, STAGES, BLOCK_N, HEAD_DIM, CAUSAL)),
        (_loader, (args, loader_args, STAGES, BLOCK_N, HEAD_DIM, CAUSAL)),
    ], [4, 1], [240, 24])
