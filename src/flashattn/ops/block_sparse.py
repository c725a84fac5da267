"""Launchers of the block-sparse attention kernels (kernels/attn_sparse.py).

Same signatures as flashattn.block_sparse._torch (flashattn.block_sparse._ops picks it on the torch backend):
q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv), kt a flashattn.masks.BlockMaskKernelTensors.
"""

import torch

from flashattn import _env
from flashattn.kernels.attn_bwd import attn_bwd_preprocess_kernel
from flashattn.kernels.attn_sparse import sparse_bwd_kernel, sparse_fwd_kernel
from flashattn.ops import host
from flashattn.ops.attention import LOG2E
from flashattn.ops.configs import tile_config


def _rows(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _common(q, k, v, kt, softmax_scale, softcap, dropout_p, rng_seed, rng_offset):
    b, sq, h, d = q.shape
    block_d = max(host.block_d(d), host.block_d(v.shape[-1]))
    flags = dict(
        GROUP=h // k.shape[2], HEAD_DIM=d, HEAD_DIM_V=v.shape[-1], BLOCK_D=host.block_d(d),
        BLOCK_DV=host.block_d(v.shape[-1]), SPARSE_M=kt.block_m, SPARSE_N=kt.block_n, HAS_SOFTCAP=softcap > 0,
        HAS_DROPOUT=dropout_p > 0, DOT_PREC=host.dot_precision(q.dtype),
    )
    scalars = (softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E,
               float(dropout_p), int(rng_seed), int(rng_offset))
    mask_dims = (kt.kv_full_num.shape[0], kt.kv_full_num.shape[1])
    return b, sq, h, block_d, flags, scalars, mask_dims


def _rule(kt) -> tuple[tuple[int, int, int, int], dict]:
    """(runtime ints, constexpr flags) that tell the kernels how partial blocks get their predicate: the
    mask's MaskRule when it has one (FLASHATTN_SPARSE_RULE=0 forces the bitmasks, for A/B timing), else
    bits."""
    r = kt.rule
    if r is None or _env.get("FLASHATTN_SPARSE_RULE", "1") == "0":
        return (0, 0, 0, 0), dict(PART_BY=1, RULE_LEFT=False, RULE_RIGHT=False, RULE_GLOBAL=False,
                                  RULE_GLOBAL_CAUSAL=False)
    return (r.diag, r.left, r.right, r.global_tokens), dict(
        PART_BY=2, RULE_LEFT=r.left >= 0, RULE_RIGHT=r.right >= 0, RULE_GLOBAL=r.global_tokens > 0,
        RULE_GLOBAL_CAUSAL=r.global_causal)


def _tiles(kernel, block_d, device, kt):
    """The table's tile config, shrunk so that kernel tiles subdivide the mask's blocks (powers of two)."""
    cfg = tile_config(kernel, block_d, device)
    block_n = cfg.block_n
    if kernel == "fwd" and block_n * block_d >= 128 * 128 and cfg.num_stages >= 3:
        # the block-index loads the sparse forward pipelines take 1 KiB past the 227 KiB the dense kernel
        # fills at (128, 128, 3 stages), d = 128 (sm_90, Triton 3.6); half-width key tiles keep the three
        # stages, and were within 2% of the dense optimum in the H200 sweep (2 stages lost 7%)
        block_n //= 2
    return min(cfg.block_m, kt.block_m), min(block_n, kt.block_n), cfg


def _grid(n_bh: int, n_blocks: int, subtiles: int) -> tuple[tuple[int], tuple[int, int, int]]:
    """(1D grid, (n_bh, n_tiles, hoist)) for the kernels' _program: the heaviest 1/32 of each head's blocks
    (their launch order puts them first) start heads interleaved. Enough for a local + global mask's global
    rows (one or two blocks up to 64K tokens), few enough that the rest keeps the head-major order whose
    concurrent programs share a head's tiles in L2: with every tile interleaved across heads, random masks
    ran 4-9% slower on the H200 (benchmarks/NOTES.md, v10)."""
    n_tiles = n_blocks * subtiles
    hoist = min(max(1, n_blocks // 32) * subtiles, n_tiles - 1)
    return (n_bh * n_tiles,), (n_bh, n_tiles, hoist)


def block_sparse_forward(q, k, v, kt, *, softmax_scale, softcap=0.0, dropout_p=0.0, rng_seed=0, rng_offset=0):
    """out (b, sq, h, dv) in q's dtype and lse (b, h, sq) float32 (+inf: the row sees no key)."""
    b, sq, h, block_d, flags, scalars, (mb, mh) = _common(q, k, v, kt, softmax_scale, softcap, dropout_p,
                                                            rng_seed, rng_offset)
    out = torch.empty((b, sq, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    block_m, block_n, cfg = _tiles("fwd", block_d, q.device, kt)
    rule_args, rule_flags = _rule(kt)
    grid, order_args = _grid(b * h, kt.n_qblocks, kt.block_m // block_m)
    sparse_fwd_kernel[grid](
        q, k, v, out, lse, kt.kv_full_num, kt.kv_full_idx, kt.kv_part_num, kt.kv_part_idx, kt.part_bits,
        kt.q_order,
        *_rows(q), *_rows(k), *_rows(v), *_rows(out), h, sq, k.shape[1], *scalars,
        mb, mh, kt.kv_full_num.shape[2], kt.kv_full_idx.shape[3], kt.kv_part_idx.shape[3], *rule_args,
        *order_args, BLOCK_M=block_m, BLOCK_N=block_n, **flags, **rule_flags, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    return out, lse


def block_sparse_backward(dout, q, k, v, out, lse, kt, *, softmax_scale, softcap=0.0, dropout_p=0.0,
                          rng_seed=0, rng_offset=0):
    """dq, dk, dv laid out like q, k, v (dk/dv summed over each GQA group). No atomics: deterministic."""
    b, sq, h, block_d, flags, scalars, (mb, mh) = _common(q, k, v, kt, softmax_scale, softcap, dropout_p,
                                                            rng_seed, rng_offset)
    sk, hk = k.shape[1], k.shape[2]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    attn_bwd_preprocess_kernel[(host.cdiv(sq, 64), b * h)](
        out, dout, delta, q, q, delta, delta, *_rows(out), *_rows(dout), *(lse.stride(0), lse.stride(1)) * 2,
        h, sq, sq, HEAD_DIM_V=v.shape[-1], BLOCK_DV=flags["BLOCK_DV"], BLOCK_M=64, IS_VARLEN=False,
        GLUON=False,
    )
    n_qblocks, n_kblocks = kt.kv_full_num.shape[2], kt.q_full_num.shape[2]
    rule_args, rule_flags = _rule(kt)
    kv_m, kv_n, kv_cfg = _tiles("dkdv", block_d, q.device, kt)
    q_m, q_n, q_cfg = _tiles("dq", block_d, q.device, kt)
    (n_kv,), kv_args = _grid(b * hk, n_kblocks, kt.block_n // kv_n)
    (n_q,), q_args = _grid(b * h, n_qblocks, kt.block_m // q_m)
    # one launch per role (ROLE_DKDV; the other role's order is a dummy). Both in one, flex's layout, ran from
    # v12 until the dense backward's one-launch variant failed on the H200 with a timing-dependent misaligned
    # address (kernels/attn_bwd.py, benchmarks/NOTES.md v13); v12 had measured it within noise of two launches
    launches = [(n_kv, kv_args, (0, 1, 0), kv_cfg, True), (n_q, (0, 1, 0), q_args, q_cfg, False)]
    for n_programs, kv_order, q_order, cfg, role_dkdv in launches:
        sparse_bwd_kernel[(n_programs,)](
            q, k, v, dout, lse, delta, dq, dk, dv,
            kt.kv_full_num, kt.kv_full_idx, kt.kv_part_num, kt.kv_part_idx, kt.part_bits, kt.q_order,
            kt.q_full_num, kt.q_full_idx, kt.q_part_num, kt.q_part_idx, kt.q_part_slot, kt.k_order,
            *_rows(q), *_rows(k), *_rows(v), *_rows(dout), *_rows(dq), *_rows(dk), *_rows(dv),
            h, hk, sq, sk, *scalars, softmax_scale, mb, mh, n_qblocks, n_kblocks, kt.kv_full_idx.shape[3],
            kt.kv_part_idx.shape[3], kt.q_full_idx.shape[3], kt.q_part_idx.shape[3], *rule_args, *kv_order,
            *q_order, DKDV_BLOCK_M=kv_m, DKDV_BLOCK_N=kv_n, DQ_BLOCK_M=q_m, DQ_BLOCK_N=q_n, **flags,
            **rule_flags, ROLE_DKDV=role_dkdv, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            maxnreg=cfg.maxnreg,
        )
    return dq, dk, dv
