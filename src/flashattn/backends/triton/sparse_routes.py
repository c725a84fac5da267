"""How a block-sparse call (BlockMask, block_sparse_attn_func) runs: a pure function from the call's
`SparseSpec` to a route, as routes.py is for the dense and varlen calls: `DenseBandRoute` when the mask is
exactly a band (its rule, see SparseSpec), which then takes routes.py's routes with the band as the window;
else `SparseRoute`: the block-sparse kernels, on Hopper the Gluon kernels' block-sparse variants
(kernels/gluon/sparse.py, sparse_bwd.py: `gluon_sparse_route`) where they take the call and at most
GLUON_PARTIAL_PERMILLE of the mask's visible blocks are partial, else the Triton ones
(kernels/triton/attn_sparse.py).
This module imports neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashattn.backends.triton import routes
from flashattn.backends.triton.configs import TileConfig, tile_config

# the share of partial blocks among a mask's visible ones, in thousandths, up to which its default route is
# the Gluon kernels' variants. On an H100 (benchmarks/results/2026-12-07-sparse-gluon-bwd-h100, 16K, d 128,
# forward + backward) they ran masks of full blocks 1.31-1.40x as fast as the Triton kernels (random, 5-50%
# dense) and local + global at 4% and 7% partial blocks 1.33x and 1.20x, but at 15% 0.96x and at 57% 0.81x:
# a partial step's bits come from L2 in their critical path, where the Triton kernels compute the rule's
# predicate
GLUON_PARTIAL_PERMILLE = 100


@dataclass(frozen=True)
class SparseSpec:
    """A block-sparse call as routing sees it: the padded head dim, the mask's block size, whether the
    mask carries a rule (MaskRule) for its partial blocks, and band: (left, right), -1 unbounded, when that
    rule is the whole mask and a band of the dense kernels' form (query i sees keys [i + seqlen_k -
    seqlen_q - left, i + seqlen_k - seqlen_q + right], no global tokens, one mask for every batch element
    and head), else None."""

    block_d: int
    mask_block_m: int
    mask_block_n: int
    has_rule: bool
    cuda: bool = True
    band: tuple[int, int] | None = None
    # the call as a dense one without a mask (routes.Spec: dtype, head dims, device, alignment, options),
    # which says whether the Gluon kernels could take it; None: never
    dense: routes.Spec | None = None
    # the mask's head dim: 1 (one mask for every head) or the call's query heads
    mask_heads: int = 1
    # its partial blocks among its visible ones, in thousandths (BlockMaskKernelTensors.partial_permille)
    partial_permille: int = 0


@dataclass(frozen=True)
class SparseRoute:
    """kernels/triton/attn_sparse.py: each query tile walks its list of key tiles, full tiles unmasked,
    partial ones through the mask's rule or its bitmask. Tiles subdivide the mask's blocks."""

    fwd: TileConfig
    dkdv: TileConfig
    dq: TileConfig
    by_rule: bool  # partial blocks by the rule's arithmetic (else by the bitmask)
    # the forward on the Gluon kernel (its lists and bitmasks), in place of `fwd`'s Triton one
    gluon_fwd: routes.GluonForward | None = None
    # the backward on the Gluon kernel (its column lists and bitmasks), in place of `dkdv` and `dq`'s
    gluon_bwd: routes.GluonBackward | None = None
    kernel = "triton"


def _sparse_tiles(kernel: str, spec: SparseSpec) -> TileConfig:
    """The table's tile config, shrunk so that kernel tiles subdivide the mask's blocks (powers of two)."""
    cfg = tile_config(kernel, spec.block_d, spec.cuda)
    block_n = cfg.block_n
    if kernel == "fwd" and block_n * spec.block_d >= 128 * 128 and cfg.num_stages >= 3:
        # the block-index loads the sparse forward pipelines take 1 KiB past the 227 KiB the dense kernel
        # fills at (128, 128, 3 stages), d = 128 (sm_90, Triton 3.6); half-width key tiles keep the three
        # stages, and were within 2% of the dense optimum in the H200 sweep (2 stages lost 7%)
        block_n //= 2
    return TileConfig(min(cfg.block_m, spec.mask_block_m), min(block_n, spec.mask_block_n), cfg.num_warps,
                      cfg.num_stages, cfg.maxnreg)


@dataclass(frozen=True)
class DenseBandRoute:
    """A mask that is a band (full, causal, sliding window, local without global tokens) runs the dense
    attention's own routes (forward_route / backward_route: on Hopper the Gluon kernels) with that band as
    its window: the same element mask, without the block lists' index loads, and its tiles outside the band
    never visited either."""

    window: tuple[int, int]  # (left, right), -1 unbounded
    kernel = "dense"


def gluon_sparse_forward(spec: SparseSpec) -> routes.GluonForward | None:
    """The Gluon forward's block-sparse variant for this call, or None where it does not take it: a call
    the dense Gluon forward takes (16-bit, sm90, TMA-ready, no dropout) whose mask has blocks of 128 query
    rows (the kernel's two consumer warpgroups of 64) and keys a multiple of the route's key tile. Its tiles
    are the dense route's at the call's head dim, two consumers (d = 64's three-consumer tiles hold 192
    rows), no half-diagonal step (the lists stand for the band) and a tile per query head (no GQA packing:
    the masks are per query head)."""
    dense = spec.dense
    if dense is None or not routes.takes_gluon_forward(dense) or dense.varlen or spec.mask_block_m != 128:
        return None
    base = routes.gluon_forward_route(dense, packed=False)
    tiles = base.tiles
    if tiles.block_m != 2 * routes.HALF_M:
        # d = 64: the two-consumer row of its tile table (its short-sequence tiles)
        tiles = replace(tiles, block_m=2 * routes.HALF_M, maxnreg=None)
    if spec.mask_block_n % tiles.block_n:
        return None
    width = base.head_dim
    q_buffers = routes.gluon_q_buffers(dense, tiles, width)
    return replace(base, tiles=tiles, q_buffers=q_buffers, defer_release=q_buffers == 2, half_diag=False,
                   trees=3, maxnreg=tiles.maxnreg or routes.MAXNREG_TWO, pack=1)


def gluon_sparse_backward(spec: SparseSpec) -> routes.GluonBackward | None:
    """The Gluon backward's block-sparse variant for this call, or None where it does not take it: a call the
    dense Gluon backward takes on attn_bwd.py's kernel (16-bit, sm90, TMA-ready, d and dv up to 128, no
    dropout) whose mask has 128 x 128 blocks (a key block is the kernel's key tile, a query block two or one
    of its steps). Its tiles are the masked calls' (64-row steps). The lists are per query head: under GQA a
    mask per head gives a program each query head (the group split at the whole group, whose float32 dK and
    dV buffers must fit SPLIT_BUFFER_CAP); one mask for all heads leaves the dense split. Its dQ is added in
    a varying order, as the dense Gluon backward's (not bitwise reproducible, unlike the Triton kernels')."""
    dense = spec.dense
    if (dense is None or not routes.takes_gluon_backward(dense) or dense.varlen or dense.deterministic
            or (spec.mask_block_m, spec.mask_block_n) != (128, 128)):
        return None
    route = routes.gluon_backward_route(dense, masked=True)
    if route.d_qk or route.wide_keys or route.tiles.block_n != 128 or 128 % route.tiles.block_m:
        return None
    if spec.mask_heads > 1 and dense.group > 1:
        buffers = dense.batch * dense.seqlen_k * dense.nheads_k * (dense.headdim + dense.headdim_v) * 4
        if buffers > routes.SPLIT_BUFFER_CAP:
            return None
        route = replace(route, group_split=dense.group)
    return route


def triton_sparse_route(spec: SparseSpec) -> SparseRoute:
    """The block-sparse kernels' route, for any mask."""
    return SparseRoute(_sparse_tiles("fwd", spec), _sparse_tiles("dkdv", spec), _sparse_tiles("dq", spec),
                       spec.has_rule)


def gluon_sparse_route(spec: SparseSpec, backward: bool = True) -> SparseRoute | None:
    """The block-sparse kernels' route with the forward on the Gluon kernel's variant and, where it takes
    the call and `backward`, the backward on the Gluon backward's (`gluon_sparse_backward`; else the Triton
    kernels'), or None where the Gluon forward does not take the call (`gluon_sparse_forward`)."""
    fwd = gluon_sparse_forward(spec)
    if fwd is None:
        return None
    bwd = gluon_sparse_backward(spec) if backward else None
    return replace(triton_sparse_route(spec), gluon_fwd=fwd, gluon_bwd=bwd)


def sparse_route(spec: SparseSpec) -> SparseRoute | DenseBandRoute:
    """A block-sparse call's default route: the dense kernels for a band; else the Gluon kernels' variants
    where they take the call (the backward's where it does, else the Triton one) and few of the mask's
    blocks are partial (GLUON_PARTIAL_PERMILLE); else the block-sparse Triton kernels."""
    if spec.band is not None:
        return DenseBandRoute(spec.band)
    if spec.partial_permille <= GLUON_PARTIAL_PERMILLE:
        route = gluon_sparse_route(spec)
        if route is not None:
            return route
    return triton_sparse_route(spec)
