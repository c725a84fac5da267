"""Providers for the `sparse` suite: one block-sparse mask per case, run by this project and by flex (on its
Triton kernels, or on FlashAttention-4's where FA4 is installed).

`flashattn-sparse` calls flashattn.block_sparse_attn_func with the case's BlockMask (a band, as the dense and
causal cases' masks are, runs the dense kernels: its rows' route_fwd / route_bwd say which kernels ran;
`flashattn-sparse-kernels`: the block-sparse kernels through the launchers, band or not;
`flashattn-sparse-gluon-fwd`: the same with the forward on the Gluon kernel's block-sparse variant;
`flashattn-sparse-gluon`: with the backward on the Gluon backward's too, where it takes the case;
`flashattn-sparse-bits`: the same on a route whose partial blocks read bitmasks even where the mask has a
rule);
`flex-sparse` runs torch.compile(flex_attention) with a flex BlockMask made of our BlockMask's block lists and
a mask_mod of the same element rule for the partial tiles (dense too: a mask of full tiles). The dense kernel
is the plain `flashattn` provider; the suite skips it where it cannot express the mask. The mask is described
by the case's extra fields (`pattern`, `target_density`, `window`, `global_tokens`, `seed`, `block`), built
once, and shared by the providers and the suite's oracle.

One mask_mod serves every flex-sparse case: its parameters live in module tensors that each case overwrites
in place, and every flex block mask is per head, so flex compiles once per N instead of once per mask (a
compile costs tens of seconds; the anchors page warns what a silent recompile-limit fallback does). The
price is a band test and one table lookup per element of flex's partial tiles, where a dedicated mask_mod
would do only one of them. `flex-fa4-sparse` takes a mask_mod per pattern instead (`pattern_mask_mod`):
FA4's CuTe DSL traces a mask_mod's index arithmetic but not a captured tensor indexed by constants (it
failed on the shared one with "Expected TensorSSA, but got int"), so it compiles once per pattern and
parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashattn.masks._kernel import FULL, PARTIAL

from ..case import Case
from .base import Prepared, Provider, make_leaves
from .flex import _compiled_flex
from .ours import routes_info

BLOCK = 128


@dataclass(frozen=True)
class MaskSpec:
    """What builds a case's mask: pattern in {dense, causal, local_global, random} and its parameters."""

    pattern: str
    seqlen: int
    nheads: int
    window: int = -1
    global_tokens: int = 0
    target_density: float = 1.0
    seed: int = 0
    block: int = BLOCK

    @classmethod
    def of(cls, case: Case) -> MaskSpec:
        e = case.extra
        if "pattern" not in e:
            raise ValueError("this provider runs the sparse suite's cases (extra field `pattern` missing)")
        if case.seqlen_q != case.seqlen_k:
            raise ValueError(f"sparse cases are self-attention; got sq={case.seqlen_q}, sk={case.seqlen_k}")
        return cls(e["pattern"], case.seqlen_q, case.nheads, int(e.get("window", -1)),
                   int(e.get("global_tokens", 0)), float(e.get("target_density", 1.0)), int(e.get("seed", 0)),
                   int(e.get("block", BLOCK)))


def random_blocks(spec: MaskSpec) -> torch.Tensor:
    """bool (nheads, n, n) block grid, every head its own draw, the diagonal always on (no empty rows): the
    block density is target_density in expectation."""
    n = -(-spec.seqlen // spec.block)
    g = torch.Generator().manual_seed(spec.seed)
    p = max(0.0, (spec.target_density - 1 / n) / (1 - 1 / n)) if n > 1 else 1.0
    table = torch.rand(spec.nheads, n, n, generator=g) < p
    table |= torch.eye(n, dtype=torch.bool)
    return table


@functools.lru_cache(maxsize=64)
def _cpu_mask(spec: MaskSpec):
    from flashattn.masks import BlockMask

    n, bs = spec.seqlen, (spec.block, spec.block)
    if spec.pattern == "dense":
        return BlockMask.full(n, n, block_size=bs)
    if spec.pattern == "causal":
        return BlockMask.causal(n, n, block_size=bs)
    if spec.pattern == "local_global":
        return BlockMask.local_global(n, spec.window, spec.global_tokens, block_size=bs)
    if spec.pattern == "random":
        return BlockMask.from_blocks(random_blocks(spec)[None], n, n, block_size=bs)
    raise ValueError(f"unknown sparse pattern {spec.pattern!r}; expected dense, causal, local_global, random")


_on_device: dict = {}


def block_mask(spec: MaskSpec, device: torch.device):
    """The case's flashattn.BlockMask on device (built on the CPU once; the last device copy is kept)."""
    key = (spec, str(device))
    if key not in _on_device:
        _on_device.clear()  # one long mask at a time on the GPU
        _on_device[key] = _cpu_mask(spec).to(device)
    return _on_device[key]


# -- flex: one mask_mod for every pattern, parameters in module tensors overwritten per case
_params: torch.Tensor | None = None  # int64 (3,): left, right, global_tokens
_table: torch.Tensor | None = None  # bool (nheads, n_blocks, n_blocks): block-level part of the mask


def _flex_mask_mod(b, h, q_idx, kv_idx):
    diff = q_idx - kv_idx
    local = (diff <= _params[0]) & (-diff <= _params[1])
    glob = (kv_idx < _params[2]) | (q_idx < _params[2])
    return local | glob | _table[h, q_idx // BLOCK, kv_idx // BLOCK]


def _set_flex_state(spec: MaskSpec, device: torch.device) -> None:
    global _params, _table
    n = -(-spec.seqlen // BLOCK)
    if spec.pattern == "dense":
        values = (spec.seqlen, spec.seqlen, 0)
    elif spec.pattern == "causal":
        values = (spec.seqlen, 0, 0)
    elif spec.pattern == "local_global":
        values = (spec.window, spec.window, spec.global_tokens)
    else:
        values = (-1, -1, 0)  # no band (it needs diff <= -1 and diff >= 1), no global tokens
    if spec.pattern == "random":
        table = random_blocks(spec)
    else:
        table = torch.zeros(spec.nheads, n, n, dtype=torch.bool)
    if _params is None or _params.device != device or _table is None or _table.shape != table.shape:
        _params = torch.zeros(3, dtype=torch.int64, device=device)
        _table = torch.zeros(table.shape, dtype=torch.bool, device=device)
    _params.copy_(torch.tensor(values))
    _table.copy_(table)


@functools.cache
def pattern_mask_mod(pattern: str, window: int = -1, global_tokens: int = 0):
    """The element rule of a pattern's partial blocks as plain index arithmetic (one function per pattern and
    parameters, so that flex finds its compilation again): causal, or a symmetric band of `window` with the
    first `global_tokens` queries and keys seeing everything. dense and random masks have no partial block
    (every set block is full), so their rule is never evaluated: the dense mask's is flex's noop_mask, with
    which the FLASH backend runs FA4's dense kernel; a random mask's must not be, as that backend drops the
    block lists of a call whose mask_mod is noop_mask's constant (torch's
    flex_flash_attention.is_trivial_mask_graph), so it gets a comparison that always holds."""
    if pattern == "causal":
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    if pattern == "local_global":
        def local_global(b, h, q_idx, kv_idx):
            band = (q_idx - kv_idx <= window) & (kv_idx - q_idx <= window)
            return band | (kv_idx < global_tokens) | (q_idx < global_tokens)
        return local_global
    if pattern == "random":
        return lambda b, h, q_idx, kv_idx: kv_idx >= 0
    from torch.nn.attention.flex_attention import noop_mask

    return noop_mask


def _sorted_lists(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool (B, H, M, N) -> (num (B, H, M), idx (B, H, M, N)) int32: the set blocks of each row first, in
    ascending order (flex's list convention; entries past num are padding). Full width N, unlike the kernels'
    trimmed masks._kernel.block_lists: flex derives its transposed (backward) lists with one column per
    idx entry, so a narrower idx would drop the blocks past its width."""
    num = flags.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def flex_block_mask(spec: MaskSpec, device: torch.device, mask_mod=None):
    """flex's BlockMask of the case: the block lists of our own BlockMask, the shared mask_mod for the
    partial blocks (or the given one, of the same rule: pattern_mask_mod's).

    Taking our lists (rather than create_block_mask over the mask_mod) makes the two providers visit exactly
    the same tiles, and skips a compiled create_block_mask, whose cold compile can take minutes at some
    lengths (pytorch/pytorch#182060; the first H200 runs never got past flex's first case). Always per head
    (nheads), dense included: flex is compiled with static shapes, so one block-mask shape per N means one
    flex compilation per N for the whole suite.
    """
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    if spec.block != BLOCK:
        raise ValueError(f"flex-sparse uses {BLOCK}x{BLOCK} tiles; the case asks for {spec.block}")
    _set_flex_state(spec, device)
    ours = block_mask(spec, device)
    state = ours.block_state.expand(1, spec.nheads, -1, -1)
    kv_num, kv_idx = _sorted_lists(state == PARTIAL)
    full_num, full_idx = _sorted_lists(state == FULL)
    return FlexBlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                        mask_mod=mask_mod or _flex_mask_mod,
                                        seq_lengths=(spec.seqlen, spec.seqlen))


def sparse_routes_info(q, k, v, kt) -> dict:
    """`route_fwd` / `route_bwd` of block_sparse_attn_func with this mask: SparseRoute (the block-sparse
    Triton kernels) or SparseRoute/gluon (the Gluon kernels' variant), DenseBandRoute/<the dense call's
    route> for a band, or "torch" on the pure-PyTorch backend."""
    from flashattn import backends

    if backends.backend_name(q) != "triton":
        return {"route_fwd": "torch", "route_bwd": "torch"}
    from flashattn.backends.triton import block_sparse, sparse_routes

    route = block_sparse.default_route(q, k, v, kt)
    if isinstance(route, sparse_routes.DenseBandRoute):
        dense = routes_info(q, k, v, window_size=route.window)
        return {key: f"DenseBandRoute/{name}" for key, name in dense.items()}
    return {"route_fwd": "SparseRoute" + ("/gluon" if route.gluon_fwd else ""),
            "route_bwd": "SparseRoute" + ("/gluon" if route.gluon_bwd else "")}


def _setup_flashattn_sparse(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    import flashattn

    mask = block_mask(MaskSpec.of(case), q.device)
    kt = mask.to_kernel_tensors(q.device)  # the lists are built here, outside the timed call
    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    return Prepared(fwd=lambda: flashattn.block_sparse_attn_func(qb, kb, vb, mask), leaves=leaves,
                    info=sparse_routes_info(qb, kb, vb, kt))


class _KernelRoute(torch.autograd.Function):
    """The block-sparse kernels' launchers forward and backward on a given route."""

    @staticmethod
    def forward(ctx, q, k, v, kt, route):
        from flashattn.backends.triton import block_sparse

        scale = q.shape[-1] ** -0.5
        out, lse = block_sparse.block_sparse_forward(q, k, v, kt, softmax_scale=scale, route=route)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kt, ctx.route, ctx.scale = kt, route, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        from flashattn.backends.triton import block_sparse

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_sparse.block_sparse_backward(dout, q, k, v, out, lse, ctx.kt,
                                                         softmax_scale=ctx.scale, route=ctx.route)
        return dq, dk, dv, None, None


def _kernels_setup(by_rule: bool, gluon_fwd: bool = False, gluon_bwd: bool = False):
    """A setup that runs the block-sparse kernels on the case's mask, band or not, with partial blocks by
    the mask's rule where it has one (by_rule) or always by its bitmask; gluon_fwd: the forward on the
    Gluon kernel's block-sparse variant (block_sparse.gluon_route; a case it does not take fails to set
    up, and its row says why), and gluon_bwd the backward on the Gluon backward's where it takes the case
    (route_bwd says which ran)."""

    def setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        import dataclasses

        from flashattn.backends.triton import block_sparse

        kt = block_mask(MaskSpec.of(case), q.device).to_kernel_tensors(q.device)
        leaves = make_leaves(q, k, v, "bshd")
        if not gluon_fwd:
            route = block_sparse.triton_route(leaves[0], leaves[2], kt)
        else:
            route = block_sparse.gluon_route(*leaves, kt, backward=gluon_bwd)
            if route is None:
                raise RuntimeError("the Gluon forward's block-sparse variant does not take this call (it "
                                   "needs sm90, 16-bit TMA-ready tensors and 128-row mask blocks)")
        route = dataclasses.replace(route, by_rule=route.by_rule and by_rule)
        info = {"route_fwd": "SparseRoute" + ("/gluon" if route.gluon_fwd else ""),
                "route_bwd": "SparseRoute" + ("/gluon" if route.gluon_bwd else ""), "by_rule": route.by_rule}
        return Prepared(fwd=lambda: _KernelRoute.apply(*leaves, kt, route), leaves=leaves, info=info)

    return setup


def _setup_flex_sparse(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    from torch.nn.attention.flex_attention import flex_attention

    fmask = flex_block_mask(MaskSpec.of(case), q.device)
    # on the CPU (smoke tests only) eager flex is enough and skips an inductor C++ build per shape
    flex = _compiled_flex() if q.device.type == "cuda" else flex_attention
    leaves = make_leaves(q, k, v, "bhsd")
    qh, kh, vh = leaves
    gqa = case.nheads != case.nheads_k
    return Prepared(fwd=lambda: flex(qh, kh, vh, block_mask=fmask, enable_gqa=gqa), leaves=leaves,
                    layout="bhsd")


def _setup_flex_fa4_sparse(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    """flex-sparse on FlashAttention-4's kernels: flex_attention runs its block mask and the pattern's own
    mask_mod there with kernel_options BACKEND=FLASH, which needs CUDA and flash_attn.cute (FA4's wheels) in
    the process."""
    if q.device.type != "cuda":
        raise RuntimeError("flex-fa4-sparse needs a CUDA device (flex's FLASH backend is FlashAttention-4)")
    import flash_attn.cute  # noqa: F401  (an ImportError here says FA4 is missing, not a flex error later)

    spec = MaskSpec.of(case)
    fmask = flex_block_mask(spec, q.device, pattern_mask_mod(spec.pattern, spec.window, spec.global_tokens))
    flex = _compiled_flex()
    leaves = make_leaves(q, k, v, "bhsd")
    qh, kh, vh = leaves
    gqa = case.nheads != case.nheads_k
    options = {"BACKEND": "FLASH"}
    return Prepared(fwd=lambda: flex(qh, kh, vh, block_mask=fmask, enable_gqa=gqa, kernel_options=options),
                    leaves=leaves, layout="bhsd")


PROVIDERS = [
    Provider("flashattn-sparse", _setup_flashattn_sparse,
             "this project: flashattn.block_sparse_attn_func with the case's BlockMask"),
    Provider("flashattn-sparse-kernels", _kernels_setup(True),
             "the block-sparse kernels on the case's mask even where it is a band (A/B timing of "
             "DenseBandRoute)"),
    Provider("flashattn-sparse-gluon-fwd", _kernels_setup(True, gluon_fwd=True),
             "the block-sparse kernels with the forward on the Gluon kernel's block-sparse variant (not yet "
             "the default; A/B timing against flashattn-sparse-kernels)"),
    Provider("flashattn-sparse-gluon", _kernels_setup(True, gluon_fwd=True, gluon_bwd=True),
             "the block-sparse kernels with the forward and, where it takes the case, the backward on the "
             "Gluon kernels' block-sparse variants (not yet the default; A/B timing)"),
    Provider("flashattn-sparse-bits", _kernels_setup(False),
             "the block-sparse kernels on the route whose partial blocks read their bitmasks even when the "
             "mask has a rule (A/B timing)"),
    Provider("flex-sparse", _setup_flex_sparse,
             "torch.compile(flex_attention) with our BlockMask's block lists and the same element rule"),
    Provider("flex-fa4-sparse", _setup_flex_fa4_sparse,
             "flex-sparse on FlashAttention-4's kernels: kernel_options BACKEND=FLASH (needs FA4)"),
]
