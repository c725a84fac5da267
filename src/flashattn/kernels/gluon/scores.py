"""The score side of the Gluon kernels: the score transforms (softcap, ALiBi) that the forward and the
backward share, the forward's online-softmax step over one key tile in a wgmma accumulator layout, and the
backwards' recomputed Pᵀ of one transposed score tile.

Base-2 scores are kept as a pair (x, scale) whose product is the score, scale > 0: a row's max is taken on
x and scaled once per row, and each exponent is one FFMA, x · scale − m. A feature that is off is a None
argument (a compile-time value: a jit function may take None but not return it), so a call without it
compiles to the same code as a kernel without the feature:
  - softcap (cap_in = softmax_scale / c, cap_out = c / ln 2): x = tanh(cap_in · qk), scale = cap_out;
  - ALiBi (slope in base 2): x = x · scale − slope · |i + seqlen_k − seqlen_q − j|, scale = 1, after the
    softcap;
  - the band: query i sees key j iff j < seqlen_k, j <= i + diag_r (a right edge, diag_r = seqlen_k −
    seqlen_q + right; causal is right = 0) and j >= i + diag_l (a left edge, diag_l = seqlen_k − seqlen_q −
    left).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashattn.kernels.gluon.sparse import keep_of
from flashattn.kernels.gluon.sparse_bwd import keep_t_of

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup of the forward: the wgmma M of one warpgroup
# A row's columns in a wgmma accumulator: column 8 j + 2 q + e sits in register (j, e) of lane q of the row's
# quad (4 lanes). ROW_PARTS lays out [HALF_M, 4] per-lane partials of the rows of one warpgroup: row bit 3 in
# a register, the quad's lanes along axis 1, the other row bits in lanes 2-4 and the warps, as the
# accumulator has them (so converting between the two is free)
ROW_PARTS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]],
    block_bases=[], shape=[64, 4]))


@gluon.jit
def tanh(x):
    """tanh.approx.f32: one MUFU instruction (relative error about 2^-11, as FlashAttention-3's softcap).
    The Triton kernels' 1 − 2 / (exp2(2x / ln 2) + 1) costs an exp2 and a reciprocal on the same pipe as
    the softmax's exp2, which bounds these kernels: three MUFU operations per score instead of two."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def softcapped(s, qk_scale, cap_in, cap_out):
    """The raw q·k products s as (x, scale) before ALiBi (module docstring). With a softcap, x is
    tanh(cap_in · qk), whose derivative the backward needs."""
    if cap_in is not None:
        x = tanh(s * cap_in)
        scale = cap_out
    else:
        x = s
        scale = qk_scale
    return x, scale


@gluon.jit
def with_alibi(x, scale, dist, slope):
    """(x, scale) with ALiBi's bias (slope in base 2; None: none); dist: |i + seqlen_k - seqlen_q - j| as
    float32, broadcastable to x's shape (either orientation: the backward works on Sᵀ)."""
    if slope is not None:
        x = x * scale - slope * dist
        scale = 1.0
    return x, scale


@gluon.jit
def transposed_probs(st, lse, offs_k, offs_q, key0, row0, key_tail, seqlen_k, qk_scale, cap_in, cap_out,
                     slope, diag, diag_r, diag_l, CAUSAL: gl.constexpr, part=None):
    """The backwards' Pᵀ = exp2(score − lse) over an Sᵀ tile of raw q·k products (keys × query rows: offs_k
    from key0, offs_q from row0; lse per row, base 2), and the lse it used, which ALiBi under CAUSAL changes.
    key_tail: the tile's keys pass seqlen_k. Keys past seqlen_k read as zero rows: their Pᵀ = exp2(0 − lse)
    overflows against a very negative lse, and inf times a zero K row is NaN in dQ, so the key tail is masked
    with the band's edges, and only where the tile may cross one: the first row's right edge before the last
    key, the last row's left edge past the first. part: a block-sparse mask's step, (partial, its bits:
    sparse_bwd.transposed_bits), masked by its bits where partial and not at all otherwise (no band; a full
    block holds no key past seqlen_k, and a partial one's bits are 0 there)."""
    N_KEYS: gl.constexpr = st.shape[0]
    N_ROWS: gl.constexpr = st.shape[1]
    x, scale = softcapped(st, qk_scale, cap_in, cap_out)
    if slope is not None:
        if CAUSAL:
            # every key a row sees is at or before its diagonal: slope · |i + diag - j| is slope · (i + diag)
            # - slope · j, a term per key and one per query, folded into the query's LSE (masked scores are
            # -inf whatever their bias). A float vector of the queries beside Sᵀ, or the bias per score,
            # spilled in attn_bwd.py's loop at d = 128 with a window
            x = x * scale + (slope * offs_k.to(gl.float32))[:, None]
            scale = 1.0
            lse = lse + slope * (offs_q + diag).to(gl.float32)
        else:
            dist = gl.abs((offs_q[None, :] + diag - offs_k[:, None]).to(gl.float32))
            x, scale = with_alibi(x, scale, dist, slope)
    if part is not None:
        if part[0]:
            keep = gl.convert_layout(keep_t_of(part[1]), st.type.layout)
            pt = gl.exp2(gl.where(keep, x * scale, float("-inf")) - lse[None, :])
        else:
            pt = gl.exp2(x * scale - lse[None, :])
    elif (key_tail or (diag_r is not None and row0 + diag_r < key0 + N_KEYS - 1)
            or (diag_l is not None and key0 < row0 + (N_ROWS - 1) + diag_l)):
        keep = offs_k[:, None] < seqlen_k
        if diag_r is not None:
            keep = keep & (offs_q[None, :] + diag_r >= offs_k[:, None])
        if diag_l is not None:
            keep = keep & (offs_q[None, :] + diag_l <= offs_k[:, None])
        pt = gl.exp2(gl.where(keep, x * scale, float("-inf")) - lse[None, :])
    else:
        pt = gl.exp2(x * scale - lse[None, :])
    return pt, lse


@gluon.jit
def _combine(x, axis: gl.constexpr, MAX: gl.constexpr):
    if MAX:
        y = gl.max(x, axis)
    else:
        y = gl.sum(x, axis)
    return y


@gluon.jit
def _lane_parts(x, MAX: gl.constexpr, TREE: gl.constexpr):
    """[M, N] in a wgmma accumulator layout -> [M, 4] in ROW_PARTS: the max (MAX) or the sum of each row's
    columns held by each lane of its quad. TREE: as a tree of log2(N / 4) levels; gl.max / gl.sum over a
    thread's registers chain each instruction on the last (at N = 128, 32 dependent FMNMX or FADD per row,
    each waiting out the previous one's latency), and halving the columns level by level keeps each level's
    instructions independent. Two consumers gain 5% from the trees at d=64 1K causal; three, which run
    serial steps, lose 2-4%, and keep the chains."""
    M: gl.constexpr = x.shape[0]
    J: gl.constexpr = x.shape[1] // 8
    if TREE:
        y = _combine(x.reshape([M, J, 4, 2]), 3, MAX)  # e
        for _ in gl.static_range(4):  # j: columns j and j + J/2 paired, while J > 1 (J <= 16)
            if y.shape[1] > 1:
                y = _combine(y.reshape([M, 2, y.shape[1] // 2, 4]), 1, MAX)
        y = gl.convert_layout(y.reshape([M, 4]), ROW_PARTS)
    else:
        # one chain per lane and row
        y = _combine(x.reshape([M, J, 4, 2]).permute((0, 2, 1, 3)).reshape([M, 4, 2 * J]), 2, MAX)
        y = gl.convert_layout(y, ROW_PARTS)
    return y


@gluon.jit
def _new_max(x, m_i, scale, TREES: gl.constexpr):
    """max(m_i, each row's max of x * scale) for x [M, N] in a wgmma accumulator layout (scale > 0): the
    lanes' partial maxima, then two shuffles across the quad."""
    return gl.maximum(m_i, gl.convert_layout(gl.max(_lane_parts(x, True, (TREES & 1) != 0), 1),
                                             m_i.type.layout) * scale)


@gluon.jit
def _masked_exp(x, m_i, scale, offs_q, start_n, seqlen_k, diag_r, diag_l, s_layout: gl.constexpr,
                BLOCK_N: gl.constexpr, TREES: gl.constexpr, part=None):
    """The masked tile's exponentials (keys past seqlen_k or outside each row's band get 0; part: a
    block-sparse mask's bits instead, which are 0 past seqlen_k): (p, m_new, m_sub)."""
    if part is not None:
        keep = keep_of(part[1], s_layout)
    else:
        offs_k = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = offs_k[None, :] < seqlen_k
        if diag_r is not None:
            keep = keep & (offs_k[None, :] <= offs_q[:, None] + diag_r)
        if diag_l is not None:
            keep = keep & (offs_k[None, :] >= offs_q[:, None] + diag_l)
    # masked before the scale (scale > 0): -inf * scale - m_sub is -inf, so the exponent is one FFMA
    # as the unmasked body's, not a multiply and a subtraction (64 instructions fewer per step)
    sm = gl.where(keep, x, float("-inf"))
    m_new = _new_max(sm, m_i, scale, TREES)
    # a row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    return gl.exp2(sm * scale - m_sub[:, None]), m_new, m_sub


@gluon.jit
def softmax_step(s, m_i, l_i, offs_q, start_n, seqlen_k, scores, slope, diag, diag_r, diag_l, unmasked_from,
                 unmasked_to, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, TREES: gl.constexpr,
                 MASKED: gl.constexpr = False, part=None):
    """One key tile of the forward's online softmax (base 2): (p, m_new, l_new, alpha). scores: (qk_scale,
    cap_in, cap_out) of `softcapped`; slope, diag: ALiBi's; diag_r, diag_l: the band's edges (module
    docstring); tiles inside [unmasked_from, unmasked_to) need no predicate for any row of the warpgroup
    (unmasked_from None: no left edge). MASKED: the tile is known to need the mask (the half-diagonal step:
    its keys reach past the right edge of every row but the last), so the unmasked body, dead there, is not
    compiled (224 SASS instructions fewer at d=64 causal). part: a block-sparse mask's step, (partial,
    its bits: sparse.partial_bits), masked by its bits where partial and not at all otherwise (no band)."""
    qk_scale, cap_in, cap_out = scores
    x, scale = softcapped(s, qk_scale, cap_in, cap_out)
    if slope is not None:
        offs_k = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        # positions converted per row and per key rather than per score (a quarter-rate instruction), exact
        # below 2^24
        dist = gl.abs((offs_q + diag).to(gl.float32)[:, None] - offs_k.to(gl.float32)[None, :])
        x, scale = with_alibi(x, scale, dist, slope)
    if part is not None:
        cut = part[0]
    else:
        cut = start_n + BLOCK_N > unmasked_to
        if unmasked_from is not None:
            cut = cut | (start_n < unmasked_from)
    if MASKED:
        p, m_new, m_sub = _masked_exp(x, m_i, scale, offs_q, start_n, seqlen_k, diag_r, diag_l, s_layout,
                                      BLOCK_N, TREES)
    elif cut:
        p, m_new, m_sub = _masked_exp(x, m_i, scale, offs_q, start_n, seqlen_k, diag_r, diag_l, s_layout,
                                      BLOCK_N, TREES, part)
    else:
        m_new = _new_max(x, m_i, scale, TREES)
        m_sub = m_new
        p = gl.exp2(x * scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    # l_i: each lane's partial sums ([HALF_M, 4], ROW_PARTS), reduced across the quad at the query tile's end
    # only, as FlashAttention-3's: the exponents need the row's max, never its sum, so no step waits for a
    # shuffle of it
    l_new = (l_i * gl.convert_layout(alpha, gl.SliceLayout(1, ROW_PARTS))[:, None]
             + _lane_parts(p, False, (TREES & 2) != 0))
    return p, m_new, l_new, alpha
