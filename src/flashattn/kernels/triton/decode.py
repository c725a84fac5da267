"""A KV-cache attention step in one launch: append (with rotary), split-KV attention, and the merge of splits.

One program = one key chunk ("split") of one (batch, kv head) for one block of packed query rows. Row r of
the tile is the pair (query position r // GROUP, query head kv_head·GROUP + r % GROUP): every query head of
a GQA group reads the same K/V tile, so each tile is loaded once per group, and the M dimension reaches the
16 rows tl.dot needs even when seqlen_q = 1.

Keys are addressed by their absolute position in the cache: position p of sequence b lives at
  contiguous: K[cache_row(b), p]              (cache_row = cache_batch_idx[b] or b)
  paged:      K[block_table[b, p // PAGE], p % PAGE]
and a tile gathers its rows one by one, so BLOCK_N and PAGE need not divide each other.

Sequence b holds keys [lo_b, end_b): start_b = cache_seqlens[b] keys were there before this call, the
seqlen_new new ones take positions [start_b, end_b). Query i is aligned with key i + diag, diag = end_b −
seqlen_q (causal is the window (∞, 0), bottom-right aligned); it sees [max(lo_b, i + diag − left),
min(end_b, i + diag + right + 1)), and only the keys KEY_MASK keeps, when given.

FP8_CACHE: the caches hold e4m3 values whose real value is x_fp8 · descale, one K and one V descale per
program (per tensor, or per (batch, kv head): a pointer and two strides, 0 for one per tensor). Tiles are
converted for the dots (exact: every e4m3 value is an fp16, bf16 and fp32 value), k_descale is folded into
the score scale and v_descale into the normalised output. DOT_FP16 (a 16-bit q): the dots run in fp16,
whatever q's dtype, with q scaled into fp16's range by a power of two: on sm_90 a tile's e4m3 -> fp16
conversion is one instruction per two elements, and e4m3 -> bf16 goes through fp16 with one more per
element. An fp32 q keeps fp32 dots.
New keys/values are quantised with the same descales on their way into the cache, and
the attention reads them quantised, as the cache now holds them.

Every index read from the device is clamped into range before it addresses memory: start_b into
[0, capacity − seqlen_new], lo_b into [0, start_b], cache rows into [0, rows), pages into [0, pages), rotary
positions into the table. A bad value gives a wrong result, never an access outside a tensor (the host-side
checks, opt-in, say which value was bad).

Phases of a program:
  1. append: the programs of a (batch, kv head) share the new rows; each writes its rows of the new keys
     (rotated) and values into the cache. Nothing else reads those cache slots in this launch: the attention
     below takes new keys from KN/VN, so the order of the writes does not matter.
  2. attention over this split's key tiles, online softmax in base 2 (as in attn_fwd.py): tiles below
     start_b come from the cache; the tiles from start_b on mix cache rows and new rows (rotated again).
  3. with splits: each program writes its partial (normalised out, base-2 LSE; −inf when it saw nothing) to
     the workspace and takes a ticket from its row's counter; the last one to arrive merges every split's
     partial and writes the result, then resets the counter to 0 for the next launch.
"""

import triton
import triton.language as tl

from flashattn.kernels.triton.rotary import rotated

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # via exp2, not libdevice, so the Triton interpreter runs it too; saturates to ±1 without NaN
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _to_cache(x, descale, CACHE_TY: tl.constexpr, FP8_CACHE: tl.constexpr):
    """x as the cache stores it, in the cache's dtype CACHE_TY. An FP8 cache: x / descale in fp32 (IEEE
    division, as torch's), clamped to ±448 (explicitly: no saturating cast is assumed), rounded to the
    nearest e4m3 value."""
    if FP8_CACHE:
        y = _clamp(tl.math.div_rn(x.to(tl.float32), descale), -448.0, 448.0).to(CACHE_TY)
    else:
        y = x.to(CACHE_TY)
    return y


@triton.jit
def _cache_rows(BLOCK_TABLE, bt_row, pos, ok, cache_row, n_cache_rows,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(page, slot), int64, of cache positions pos (< capacity where ok): the first two indices into the
    cache. Pages come from the block table, clamped to the pool."""
    if PAGED:
        page = tl.load(BLOCK_TABLE + bt_row + pos // PAGE_SIZE, mask=ok, other=0)
        page = _clamp(page, 0, n_cache_rows - 1).to(tl.int64)
        slot = (pos % PAGE_SIZE).to(tl.int64)
    else:
        page = cache_row
        slot = tl.where(ok, pos, 0).to(tl.int64)
    return page, slot


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, offs_n, lo, hi, start, diag, offs_i, ok_r, slope, offs_d, ok_d,
    K, V, KN, VN, COS, SIN, KEY_MASK, BLOCK_TABLE,
    k_head, v_head, kn_head, vn_head, bt_row, km_row, cache_row, n_cache_rows,
    stride_kb, stride_kn, stride_vb, stride_vn, stride_knm, stride_vnm, stride_cs, stride_ss, seqlen_ro,
    qk_scale, softcap_in, softcap_out, window_left, window_right, k_descale, v_descale,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MIXED: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI_ON: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, FP8_CACHE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One key tile (positions offs_n) folded into the running state (m_i, l_i, acc). MIXED: the tile may
    hold new keys (positions >= start), which come from KN/VN instead of the cache. FP8_CACHE: K/V tiles in
    the dots' dtype (q's) hold x_fp8 (the descales are applied by the caller's scales)."""
    ok_n = (offs_n >= lo) & (offs_n < hi)
    if HAS_KEY_MASK:
        ok_n = ok_n & (tl.load(KEY_MASK + km_row + offs_n, mask=ok_n, other=0) != 0)
    if MIXED:
        is_new = offs_n >= start
        ok_c = ok_n & (offs_n < start)
    else:
        ok_c = ok_n
    page, slot = _cache_rows(BLOCK_TABLE, bt_row, offs_n, ok_c, cache_row, n_cache_rows, PAGED, PAGE_SIZE)
    mask_c = ok_c[:, None] & ok_d[None, :]
    k = tl.load(k_head + (page * stride_kb + slot * stride_kn)[:, None] + offs_d[None, :], mask=mask_c,
                other=0.0)
    if FP8_CACHE:
        k = k.to(q.dtype)  # exact: every e4m3 value is a 16-bit float
    if MIXED:
        ok_new = ok_n & is_new
        rel = tl.where(ok_new, offs_n - start, 0).to(tl.int64)
        mask_new = ok_new[:, None] & ok_d[None, :]
        k_new = rotated(kn_head + rel[:, None] * stride_knm + offs_d[None, :], mask_new, offs_d, COS, SIN,
                        offs_n, stride_cs, stride_ss, seqlen_ro, ROT_DIM, INTERLEAVED)
        # rounded to the cache's dtype (quantised for an FP8 one): what the cache now holds and a later call
        # would read
        k_new = _to_cache(k_new, k_descale, K.dtype.element_ty, FP8_CACHE)
        k = tl.where(is_new[:, None], k_new.to(k.dtype), k)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, d) x (d, BLOCK_N)
    if SOFTCAP:
        s = _tanh(qk * softcap_in) * softcap_out
    else:
        s = qk * qk_scale
    if ALIBI_ON:
        dist = tl.abs(offs_i[:, None] + diag - offs_n[None, :]).to(tl.float32)
        s = s - slope[:, None] * dist
    keep = ok_n[None, :] & ok_r[:, None]
    if WINDOW:
        rel_q = offs_n[None, :] - (offs_i[:, None] + diag)
        keep = keep & (rel_q >= -window_left) & (rel_q <= window_right)
    s = tl.where(keep, s, float("-inf"))
    # -- update m_i and l_i; a row with nothing visible yet subtracts 0 so exp2 gives 0, not NaN
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + (page * stride_vb + slot * stride_vn)[:, None] + offs_d[None, :], mask=mask_c,
                other=0.0)
    if FP8_CACHE:
        v = v.to(q.dtype)
    if MIXED:
        v_new = tl.load(vn_head + rel[:, None] * stride_vnm + offs_d[None, :], mask=mask_new, other=0.0)
        v_new = _to_cache(v_new, v_descale, V.dtype.element_ty, FP8_CACHE)
        v = tl.where(is_new[:, None], v_new.to(v.dtype), v)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N) x (BLOCK_N, d)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["cache_len"])
def decode_kernel(
    Q, K, V, KN, VN, COS, SIN, O, LSE, WORK, COUNTERS,
    SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, KEY_MASK, K_DESCALE, V_DESCALE,
    cache_len,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    stride_cs, stride_ss, stride_bt, stride_ab, stride_mb,
    stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    nheads_k, seqlen_q, seqlen_new, capacity, n_cache_rows, seqlen_ro, num_splits,
    qk_scale, softcap_in, softcap_out, window_left, window_right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, APPEND: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    Q_PER_ROW: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI_ON: tl.constexpr,
    SPLIT: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_CHUNK: tl.constexpr, FP8_CACHE: tl.constexpr,
    DOT_FP16: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    off_bh = tl.program_id(0)
    split = tl.program_id(1)
    m_block = tl.program_id(2)
    m_blocks = tl.num_programs(2)
    off_b = off_bh // nheads_k
    off_hk = off_bh % nheads_k
    off_b64 = off_b.to(tl.int64)

    # -- this sequence's key range, every device index clamped into range
    if HAS_SEQLENS:
        start = tl.load(SEQLENS + off_b)
    else:
        start = cache_len
    start = _clamp(start, 0, capacity - seqlen_new)
    end = start + seqlen_new
    if HAS_LEFTPAD:
        lo = _clamp(tl.load(LEFTPAD + off_b), 0, start)
    else:
        lo = 0
    if HAS_BATCH_IDX:
        cache_row = _clamp(tl.load(BATCH_IDX + off_b), 0, n_cache_rows - 1).to(tl.int64)
    else:
        cache_row = off_b64
    diag = end - seqlen_q  # query i is aligned with key i + diag
    bt_row = off_b64 * stride_bt
    km_row = off_b64 * stride_mb
    offs_d = tl.arange(0, BLOCK_D)
    ok_d = offs_d < HEAD_DIM
    k_head = K + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_hk.to(tl.int64) * stride_vh
    kn_head = KN + off_b64 * stride_knb + off_hk.to(tl.int64) * stride_knh
    vn_head = VN + off_b64 * stride_vnb + off_hk.to(tl.int64) * stride_vnh
    if FP8_CACHE:
        # this program's descales (q's batch entry, its kv head); k's is folded into the score scale
        k_descale = tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh)
        v_descale = tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
        qk_scale = qk_scale * k_descale
        softcap_in = softcap_in * k_descale
    else:
        k_descale = 1.0
        v_descale = 1.0

    # -- 1. append: the programs of this (batch, kv head) take BLOCK_N new rows in turn
    if APPEND:
        programs = num_splits * m_blocks
        for r0 in range((split * m_blocks + m_block) * BLOCK_N, seqlen_new, programs * BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            ok = rows < seqlen_new
            pos = start + rows
            page, slot = _cache_rows(BLOCK_TABLE, bt_row, pos, ok, cache_row, n_cache_rows, PAGED, PAGE_SIZE)
            mask = ok[:, None] & ok_d[None, :]
            k = rotated(kn_head + rows[:, None].to(tl.int64) * stride_knm + offs_d[None, :], mask, offs_d,
                        COS, SIN, pos, stride_cs, stride_ss, seqlen_ro, ROT_DIM, INTERLEAVED)
            tl.store(k_head + (page * stride_kb + slot * stride_kn)[:, None] + offs_d[None, :],
                     _to_cache(k, k_descale, K.dtype.element_ty, FP8_CACHE), mask=mask)
            v = tl.load(vn_head + rows[:, None].to(tl.int64) * stride_vnm + offs_d[None, :], mask=mask,
                        other=0.0)
            tl.store(v_head + (page * stride_vb + slot * stride_vn)[:, None] + offs_d[None, :],
                     _to_cache(v, v_descale, V.dtype.element_ty, FP8_CACHE), mask=mask)

    # -- packed rows: r = query position * GROUP + head within the group
    n_rows = seqlen_q * GROUP
    start_m = m_block * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = start_m + offs_m
    ok_r = offs_r < n_rows
    offs_i = offs_r // GROUP
    offs_h = off_hk * GROUP + offs_r % GROUP

    hi = end
    if WINDOW:
        # keys some row of this block may see; window_left/right are huge when unbounded
        first_i = start_m // GROUP
        last_i = (tl.minimum(start_m + BLOCK_M, n_rows) - 1) // GROUP
        lo = tl.maximum(lo, first_i + diag - window_left)
        hi = tl.minimum(hi, last_i + diag + window_right + 1)

    # -- this split's share of the key tiles (tiles aligned to BLOCK_N in absolute positions)
    tile_lo = tl.maximum(lo, 0) // BLOCK_N
    n_tiles = tl.maximum(tl.cdiv(hi, BLOCK_N) - tile_lo, 0)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_lo + n_tiles)

    # -- q, rotated at its own position (Q_PER_ROW) or the first new key's, rounded to q's dtype
    q_ptrs = (Q + off_b64 * stride_qb + offs_i[:, None].to(tl.int64) * stride_qm
              + offs_h[:, None] * stride_qh + offs_d[None, :])
    if Q_PER_ROW:
        pos_q = start + offs_i
    else:
        pos_q = start + offs_i * 0
    q = rotated(q_ptrs, ok_r[:, None] & ok_d[None, :], offs_d, COS, SIN, pos_q, stride_cs, stride_ss,
                seqlen_ro, ROT_DIM, INTERLEAVED).to(Q.dtype.element_ty)
    if DOT_FP16:
        # each row of q scaled by the power of two that puts its largest |value| in [2^14, 2^15), below
        # fp16's 65504, the inverse folded into the row's score scales: exact for a 16-bit q (a power of
        # two keeps the bits, and fp16 holds a bf16 value exactly down to 2^-31 of its row's largest), and
        # per row, so that query heads of very different magnitudes sharing a program keep their bits
        q32 = q.to(tl.float32)
        binade = (tl.max(tl.abs(q32), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        # the scale's biased exponent: 2^(14 - e) for a largest |q| in [2^e, 2^(e+1))
        code = _clamp(268 - binade, 14, 227)
        q = (q32 * (code << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        inverse = ((254 - code) << 23).to(tl.float32, bitcast=True)[:, None]
        qk_scale = qk_scale * inverse  # (BLOCK_M, 1) from here on
        softcap_in = softcap_in * inverse
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI_ON:
        # slopes in log2 units: the scores are kept in base 2
        slope = tl.load(ALIBI + off_b * stride_ab + offs_h, mask=ok_r, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # -- 2. attention: tiles wholly below start from the cache, the rest (new keys among them) mixed
    if APPEND:
        t_mid = _clamp(start // BLOCK_N, t_begin, t_end)
    else:
        t_mid = t_end
    for start_n in range(t_begin * BLOCK_N, t_mid * BLOCK_N, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n + tl.arange(0, BLOCK_N), lo, hi, start, diag, offs_i, ok_r, slope,
            offs_d, ok_d, K, V, KN, VN, COS, SIN, KEY_MASK, BLOCK_TABLE, k_head, v_head, kn_head, vn_head,
            bt_row, km_row, cache_row, n_cache_rows, stride_kb, stride_kn, stride_vb, stride_vn, stride_knm,
            stride_vnm, stride_cs, stride_ss, seqlen_ro, qk_scale, softcap_in, softcap_out, window_left,
            window_right, k_descale, v_descale, PAGED, PAGE_SIZE, False, HAS_KEY_MASK, WINDOW, SOFTCAP,
            ALIBI_ON, ROT_DIM, INTERLEAVED, FP8_CACHE, DOT_PREC,
        )
    if APPEND:
        # one or two tiles in a decode step: not worth pipeline buffers of their own
        for start_n in tl.range(t_mid * BLOCK_N, t_end * BLOCK_N, BLOCK_N, num_stages=1):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start_n + tl.arange(0, BLOCK_N), lo, hi, start, diag, offs_i, ok_r, slope,
                offs_d, ok_d, K, V, KN, VN, COS, SIN, KEY_MASK, BLOCK_TABLE, k_head, v_head, kn_head,
                vn_head, bt_row, km_row, cache_row, n_cache_rows, stride_kb, stride_kn, stride_vb, stride_vn,
                stride_knm, stride_vnm, stride_cs, stride_ss, seqlen_ro, qk_scale, softcap_in, softcap_out,
                window_left, window_right, k_descale, v_descale, PAGED, PAGE_SIZE, True, HAS_KEY_MASK, WINDOW,
                SOFTCAP, ALIBI_ON, ROT_DIM, INTERLEAVED, FP8_CACHE, DOT_PREC,
            )

    o_ptrs = (O + off_b64 * stride_ob + offs_i[:, None].to(tl.int64) * stride_om
              + offs_h[:, None] * stride_oh + offs_d[None, :])
    lse_ptrs = LSE + off_b64 * stride_lb + offs_h * stride_lh + offs_i * stride_lm
    mask_o = ok_r[:, None] & ok_d[None, :]
    if SPLIT:
        # -- 3. this split's partial into the workspace: (splits, programs, BLOCK_M, BLOCK_D) outputs, then
        # (splits, programs, BLOCK_M) base-2 LSEs; -inf marks a row that saw nothing
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        lse2 = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
        rows_all = tl.num_programs(0) * m_blocks
        row = off_bh * m_blocks + m_block
        work_o = WORK + offs_m[:, None] * BLOCK_D + offs_d[None, :]
        lse_base = WORK + (num_splits * rows_all).to(tl.int64) * (BLOCK_M * BLOCK_D)
        work_l = lse_base + offs_m
        part = (split * rows_all + row).to(tl.int64)
        o_part = acc / l_safe[:, None]
        if FP8_CACHE:
            o_part = o_part * v_descale  # in real units: the merge needs no descale
        tl.store(work_o + part * (BLOCK_M * BLOCK_D), o_part, mask=mask_o)
        tl.store(work_l + part * BLOCK_M, lse2, mask=ok_r)
        # every thread's stores are issued before the ticket; the atomic's release orders them for the
        # program that takes the last ticket, whose acquire makes them visible to its loads (which skip L1)
        tl.debug_barrier()
        ticket = tl.atomic_add(COUNTERS + row, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            tl.atomic_xchg(COUNTERS + row, 0, sem="relaxed", scope="gpu")
            # the block's first MERGE_ROWS rows, which hold all of its rows below n_rows (the route's
            # invariant: a decode step's block of 16 holds a GQA group's few), so that MERGE_CHUNK splits'
            # loads go out together (an unrolled body, loads that depend neither on one another nor on the
            # running max): the merge waits on L2 once a chunk rather than twice a split, which at batch 1
            # (16 splits of 2 key tiles each) costs more than the attention
            offs_q = tl.arange(0, MERGE_ROWS)
            ok_q = start_m + offs_q < n_rows
            mask_q = ok_q[:, None] & ok_d[None, :]
            merge_o = WORK + offs_q[:, None] * BLOCK_D + offs_d[None, :]
            merge_l = lse_base + offs_q
            m = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)
            w = tl.zeros([MERGE_ROWS], dtype=tl.float32)
            merged = tl.zeros([MERGE_ROWS, BLOCK_D], dtype=tl.float32)
            for s0 in range(0, num_splits, MERGE_CHUNK):
                for j in tl.static_range(MERGE_CHUNK):
                    ok_s = s0 + j < num_splits
                    part = ((s0 + j) * rows_all + row).to(tl.int64)
                    lse_s = tl.load(merge_l + part * BLOCK_M, mask=ok_q & ok_s, other=float("-inf"),
                                    cache_modifier=".cg")
                    o_s = tl.load(merge_o + part * (BLOCK_M * BLOCK_D), mask=mask_q & ok_s, other=0.0,
                                  cache_modifier=".cg")
                    # -- rescale to the new max; rows with nothing yet subtract 0, not -inf
                    m_new = tl.maximum(m, lse_s)
                    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.math.exp2(m - m_sub)
                    beta = tl.math.exp2(lse_s - m_sub)  # 0 for empty partials
                    # where, not a product alone: an empty partial's output must not reach the sum
                    merged = merged * alpha[:, None] + tl.where(beta[:, None] > 0.0, beta[:, None] * o_s,
                                                                0.0)
                    w = w * alpha + beta
                    m = m_new
            seen_q = w > 0.0
            w_safe = tl.where(seen_q, w, 1.0)
            r_q = start_m + offs_q
            i_q, h_q = r_q // GROUP, off_hk * GROUP + r_q % GROUP
            tl.store(O + off_b64 * stride_ob + i_q[:, None].to(tl.int64) * stride_om
                     + h_q[:, None] * stride_oh + offs_d[None, :],
                     (merged / w_safe[:, None]).to(O.dtype.element_ty), mask=mask_q)
            tl.store(LSE + off_b64 * stride_lb + h_q * stride_lh + i_q * stride_lm,
                     tl.where(seen_q, (m + tl.math.log2(w_safe)) * LN2, float("inf")), mask=ok_q)
    else:
        # -- epilogue: out 0 and lse +inf for a row that sees no key (flash_attn's convention)
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        o = acc / l_safe[:, None]
        if FP8_CACHE:
            o = o * v_descale
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=mask_o)
        tl.store(lse_ptrs, tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("inf")), mask=ok_r)
