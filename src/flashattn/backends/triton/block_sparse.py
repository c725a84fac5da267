"""Launchers of the block-sparse attention kernels (kernels/triton/attn_sparse.py), given their route
(sparse_routes.sparse_route). Same signatures as backends/torch/block_sparse.py:
q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv), kt a flashattn.masks.BlockMaskKernelTensors.
A mask that is a band (sparse_routes.DenseBandRoute) runs the dense attention launchers with the band as
its window; other masks run the Triton kernels, or the Gluon kernels' block-sparse variants on a route that
names them (route.gluon_fwd, route.gluon_bwd: the default one where few of the mask's blocks are partial,
or `gluon_route`). As the dense launchers do, they keep a call signature's default route and, on the Gluon
variants, its prepared launch: a repeated signature allocates and launches.
"""

import torch

from flashattn import config
from flashattn.backends.triton import gluon, host, sparse_routes, tma
from flashattn.backends.triton import launch as launch_mod
from flashattn.backends.triton.attention import (
    LOG2E,
    _remember,
    attention_backward,
    attention_forward,
    problem_of,
    spec_of,
)
from flashattn.kernels.triton.attn_bwd import attn_bwd_preprocess_kernel
from flashattn.kernels.triton.attn_sparse import sparse_bwd_kernel, sparse_fwd_kernel

_route_cache: dict = {}  # signature -> the default route
_forward_cache: dict = {}  # signature -> (problem, the Gluon forward's prepared launch)


def _rows(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _signature(q, k, v, kt, softmax_scale, softcap, dropout_p, deterministic=False) -> tuple | None:
    """What a call's default route and its Gluon launch depend on besides the tensors' addresses, or None
    where they are not kept (calls not launched through plans: the interpreter's): q, k and v's layouts,
    dtypes, device and alignment (the dense spec's), the options, the mask's blocks, rule, partial share
    (on which side of the routing threshold) and list shapes (which fix the kernels' scalar arguments from
    the mask, and so what a compiled kernel is specialised on), the settings' generation."""
    if not launch_mod.direct(q):
        return None
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, aligned, softmax_scale, softcap, dropout_p > 0, deterministic, kt.rule,
            kt.partial_permille <= sparse_routes.GLUON_PARTIAL_PERMILLE, kt.shapes(), config.generation)


def _default_route(key, q, k, v, kt, softcap, dropout_p, deterministic=False):
    """default_route, kept per signature (key: `_signature`'s, None: not kept)."""
    route = None if key is None else _route_cache.get(key)
    if route is None:
        route = default_route(q, k, v, kt, softcap, dropout_p, deterministic)
        if key is not None:
            _remember(_route_cache, key, route)
    return route


def _common(q, k, v, kt, softmax_scale, softcap, dropout_p, rng_seed, rng_offset):
    b, sq, h, d = q.shape
    flags = dict(
        GROUP=h // k.shape[2], HEAD_DIM=d, HEAD_DIM_V=v.shape[-1], BLOCK_D=host.block_d(d),
        BLOCK_DV=host.block_dv(d, v.shape[-1]), SPARSE_M=kt.block_m, SPARSE_N=kt.block_n,
        HAS_SOFTCAP=softcap > 0, HAS_DROPOUT=dropout_p > 0, DOT_PREC=host.dot_precision(q.dtype),
    )
    scalars = (softmax_scale * LOG2E, softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E,
               float(dropout_p), int(rng_seed), int(rng_offset))
    mask_dims = (kt.kv_full_num.shape[0], kt.kv_full_num.shape[1])
    return b, sq, h, flags, scalars, mask_dims


def band_of(kt) -> tuple[int, int] | None:
    """(left, right), -1 unbounded, when the mask is exactly a band of the dense kernels' form (bottom-right
    aligned, no global tokens, one mask for all batch elements and heads), else None. A rule stands for the
    whole mask: BlockMask keeps one only from the constructors that define the mask by it (full, causal,
    sliding_window, local_global) and from re-blocking, never from combining masks."""
    r = kt.rule
    if r is None or r.global_tokens > 0 or tuple(kt.kv_full_num.shape[:2]) != (1, 1):
        return None
    if r.left < 0 and r.right < 0:
        return (-1, -1)  # every key: the diagonal does not matter
    if r.diag != kt.seqlen_k - kt.seqlen_q:
        return None
    return (r.left, r.right)


def _spec(q, v, kt, dense=None) -> sparse_routes.SparseSpec:
    block_d = max(host.block_d(q.shape[-1]), host.block_d(v.shape[-1]))
    return sparse_routes.SparseSpec(block_d, kt.block_m, kt.block_n, kt.rule is not None,
                                    tma.device_facts(q.device)[0], band_of(kt), dense,
                                    kt.kv_full_num.shape[1], kt.partial_permille)


def default_route(q, k, v, kt, softcap: float = 0.0, dropout_p: float = 0.0,
                  deterministic: bool = False) -> sparse_routes.SparseRoute | sparse_routes.DenseBandRoute:
    """The call's route (sparse_routes.sparse_route). The dense spec, which says whether the Gluon kernels'
    variants could take the call, is derived only where the mask is no band and few enough of its blocks
    are partial for routing to consider them."""
    dense = None
    if kt.partial_permille <= sparse_routes.GLUON_PARTIAL_PERMILLE and band_of(kt) is None:
        dense = spec_of(q, k, v, softcap=softcap, dropout_p=dropout_p, deterministic=deterministic)
    return sparse_routes.sparse_route(_spec(q, v, kt, dense))


def triton_route(q, v, kt) -> sparse_routes.SparseRoute:
    """The block-sparse kernels' route for this call, band or not (to time or check them on a band)."""
    return sparse_routes.triton_sparse_route(_spec(q, v, kt))


def gluon_route(q, k, v, kt, softcap: float = 0.0, dropout_p: float = 0.0,
                backward: bool = True) -> sparse_routes.SparseRoute | None:
    """The block-sparse kernels' route with the forward on the Gluon kernel's variant and, where it takes the
    call and `backward`, the backward on the Gluon backward's (None where the Gluon forward does not take
    the call), whatever the mask's partial blocks: for their tests and their timing."""
    dense = spec_of(q, k, v, softcap=softcap, dropout_p=dropout_p)
    return sparse_routes.gluon_sparse_route(_spec(q, v, kt, dense), backward)


def _rule(kt, route: sparse_routes.SparseRoute) -> tuple[tuple[int, int, int, int], dict]:
    """(runtime ints, constexpr flags) that tell the kernels how partial blocks get their predicate: the
    mask's MaskRule when the route takes it, else the bitmask."""
    r = kt.rule
    if r is None or not route.by_rule:
        return (0, 0, 0, 0), dict(PART_BY=1, RULE_LEFT=False, RULE_RIGHT=False, RULE_GLOBAL=False,
                                  RULE_GLOBAL_CAUSAL=False)
    return (r.diag, r.left, r.right, r.global_tokens), dict(
        PART_BY=2, RULE_LEFT=r.left >= 0, RULE_RIGHT=r.right >= 0, RULE_GLOBAL=r.global_tokens > 0,
        RULE_GLOBAL_CAUSAL=r.global_causal)


def _grid(n_bh: int, n_blocks: int, subtiles: int) -> tuple[tuple[int], tuple[int, int, int]]:
    """(1D grid, (n_bh, n_tiles, hoist)) for the kernels' _program: the heaviest 1/32 of each head's blocks
    (their launch order puts them first) start heads interleaved. Enough for a local + global mask's global
    rows (one or two blocks up to 64K tokens), few enough that the rest keeps the head-major order whose
    concurrent programs share a head's tiles in L2: with every tile interleaved across heads, random masks
    ran 4-9% slower on the H200."""
    n_tiles = n_blocks * subtiles
    hoist = min(max(1, n_blocks // 32) * subtiles, n_tiles - 1)
    return (n_bh * n_tiles,), (n_bh, n_tiles, hoist)


def block_sparse_forward(q, k, v, kt, *, softmax_scale, softcap=0.0, dropout_p=0.0, rng_seed=0, rng_offset=0,
                         route=None):
    """out (b, sq, h, dv) in q's dtype and lse (b, h, sq) float32 (+inf: the row sees no key). route:
    sparse_routes.SparseRoute or sparse_routes.DenseBandRoute to run instead of the default one."""
    key = None
    if route is None:
        key = _signature(q, k, v, kt, softmax_scale, softcap, dropout_p)
        hit = None if key is None else _forward_cache.get(key)
        if hit is not None:
            pb, gluon_fwd, prepared = hit
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
            gluon.forward(pb, gluon_fwd, q, k, v, out, lse, prepared, block_mask=kt)
            return out, lse
        route = _default_route(key, q, k, v, kt, softcap, dropout_p)
    if isinstance(route, sparse_routes.DenseBandRoute):
        return attention_forward(q, k, v, softmax_scale=softmax_scale, causal=False, window_size=route.window,
                                 softcap=softcap, dropout_p=dropout_p, rng_seed=rng_seed,
                                 rng_offset=rng_offset)
    b, sq, h, flags, scalars, (mb, mh) = _common(q, k, v, kt, softmax_scale, softcap, dropout_p,
                                                            rng_seed, rng_offset)
    out = torch.empty((b, sq, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if route.gluon_fwd is not None:
        # the Gluon forward's block-sparse variant (route.gluon_fwd checked it takes the call: no dropout)
        pb = problem_of(q, k, v, softmax_scale, softcap)
        prepared = gluon.forward(pb, route.gluon_fwd, q, k, v, out, lse, block_mask=kt)
        if key is not None:
            _remember(_forward_cache, key, (pb, route.gluon_fwd, prepared))
        return out, lse
    cfg = route.fwd
    block_m, block_n = cfg.block_m, cfg.block_n
    rule_args, rule_flags = _rule(kt, route)
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
                          rng_seed=0, rng_offset=0, route=None, deterministic=False):
    """dq, dk, dv laid out like q, k, v (dk/dv summed over each GQA group). The block-sparse Triton kernels
    use no atomics (deterministic); a band's dense backward and the Gluon backward's block-sparse variant
    (route.gluon_bwd) add dQ in a varying order, as flash_attn_func's default does, unless deterministic
    (then the dense backward's fixed order, and no Gluon block-sparse backward on the default route)."""
    if route is None:
        key = _signature(q, k, v, kt, softmax_scale, softcap, dropout_p, deterministic)
        route = _default_route(key, q, k, v, kt, softcap, dropout_p, deterministic)
    if isinstance(route, sparse_routes.DenseBandRoute):
        dq, dk, dv, _ = attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=False,
                                           window_size=route.window, softcap=softcap, dropout_p=dropout_p,
                                           rng_seed=rng_seed, rng_offset=rng_offset,
                                           deterministic=deterministic)
        return dq, dk, dv
    if route.gluon_bwd is not None:
        # the dense backward's launcher with the mask's column lists (route.gluon_bwd checked it takes the
        # call: no dropout), which keeps the launch per signature, route and mask shapes
        dq, dk, dv, _ = attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=False,
                                           softcap=softcap, route=route.gluon_bwd, block_mask=kt)
        return dq, dk, dv
    b, sq, h, flags, scalars, (mb, mh) = _common(q, k, v, kt, softmax_scale, softcap, dropout_p,
                                                            rng_seed, rng_offset)
    sk, hk = k.shape[1], k.shape[2]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    attn_bwd_preprocess_kernel[(host.cdiv(sq, 64), b * h)](
        out, dout, delta, q, q, delta, delta, None, *_rows(out), *_rows(dout),
        *(lse.stride(0), lse.stride(1)) * 2,
        h, sq, sq, HEAD_DIM_V=v.shape[-1], BLOCK_DV=flags["BLOCK_DV"], BLOCK_M=64, IS_VARLEN=False,
        GLUON=False, HEAD_DIM=q.shape[-1], BLOCK_D=flags["BLOCK_D"],
    )
    n_qblocks, n_kblocks = kt.kv_full_num.shape[2], kt.q_full_num.shape[2]
    rule_args, rule_flags = _rule(kt, route)
    kv_cfg, q_cfg = route.dkdv, route.dq
    kv_m, kv_n, q_m, q_n = kv_cfg.block_m, kv_cfg.block_n, q_cfg.block_m, q_cfg.block_n
    (n_kv,), kv_args = _grid(b * hk, n_kblocks, kt.block_n // kv_n)
    (n_q,), q_args = _grid(b * h, n_qblocks, kt.block_m // q_m)
    # one launch per role (ROLE_DKDV; the other role's order is a dummy). Both roles in one launch (flex's
    # layout) measured within noise of two, but the dense backward's one-launch variant failed on the H200
    # with a timing-dependent misaligned address
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
