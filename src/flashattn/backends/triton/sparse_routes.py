"""How a block-sparse call (BlockMask, block_sparse_attn_func) runs: a pure function from the call's
`SparseSpec` to a route, as routes.py is for the dense and varlen calls: `DenseBandRoute` when the mask is
exactly a band (its rule, see SparseSpec), which then takes routes.py's routes with the band as the window;
else `SparseRoute` (kernels/triton/attn_sparse.py).
This module imports neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashattn.backends.triton.configs import TileConfig, tile_config


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


@dataclass(frozen=True)
class SparseRoute:
    """kernels/triton/attn_sparse.py: each query tile walks its list of key tiles, full tiles unmasked,
    partial ones through the mask's rule or its bitmask. Tiles subdivide the mask's blocks."""

    fwd: TileConfig
    dkdv: TileConfig
    dq: TileConfig
    by_rule: bool  # partial blocks by the rule's arithmetic (else by the bitmask)
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


def triton_sparse_route(spec: SparseSpec) -> SparseRoute:
    """The block-sparse kernels' route, for any mask."""
    return SparseRoute(_sparse_tiles("fwd", spec), _sparse_tiles("dkdv", spec), _sparse_tiles("dq", spec),
                       spec.has_rule)


def sparse_route(spec: SparseSpec) -> SparseRoute | DenseBandRoute:
    """A block-sparse call's default route: the dense kernels for a band, else the block-sparse kernels."""
    if spec.band is not None:
        return DenseBandRoute(spec.band)
    return triton_sparse_route(spec)
