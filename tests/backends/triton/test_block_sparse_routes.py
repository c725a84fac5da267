"""Which kernels a block-sparse call runs (backends/triton/block_sparse.py, sparse_routes.sparse_route): a
mask that is exactly a band runs the dense attention's kernels with the band as its window (DenseBandRoute),
any other mask the block-sparse kernels. The band must be the mask element for element, and the call through
the dense kernels must be the dense call, bit for bit. The results against the oracle:
tests/test_block_sparse.py (its causal and window masks take this route), tests/test_block_sparse_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import route_specs
import torch
from utils import INTERPRET, LaunchRecorder, make_qkv

import flashattn
from flashattn.backends.triton import block_sparse as launchers
from flashattn.backends.triton import routes, sparse_routes
from flashattn.masks import BlockMask

N, BS = 83, (32, 16)
BANDS = {  # mask -> the band it is
    "full": (lambda: BlockMask.full(N, N + 20, block_size=BS), (-1, -1)),
    "causal_sq<sk": (lambda: BlockMask.causal(N - 9, N, block_size=BS), (-1, 0)),
    "causal_sq>sk": (lambda: BlockMask.causal(N + 13, N, block_size=BS), (-1, 0)),
    "window": (lambda: BlockMask.sliding_window(N, N, (24, 9), block_size=BS), (24, 9)),
    "window_sq>sk": (lambda: BlockMask.sliding_window(N + 13, N, (11, 3), block_size=BS), (11, 3)),
    "window_causal": (lambda: BlockMask.sliding_window(N, N + 7, (40, -1), causal=True, block_size=BS),
                      (40, 0)),
    "local_no_globals": (lambda: BlockMask.local_global(N, (20, 7), 0, block_size=BS), (20, 7)),
    "local_no_globals_causal": (lambda: BlockMask.local_global(N, 24, 0, causal=True, block_size=BS),
                                (24, 0)),
    "reblocked_causal": (lambda: BlockMask.causal(N, block_size=BS).with_block_size(64), (-1, 0)),
}
NOT_BANDS = {
    "local_global": lambda: BlockMask.local_global(N, (20, 7), 19, block_size=BS),
    "causal_and_window": lambda: BlockMask.causal(N, block_size=BS)
    & BlockMask.sliding_window(N, N, (30, -1), block_size=BS),
    "strided": lambda: BlockMask.strided(N, 16, block_size=BS),
    "from_dense_causal": lambda: BlockMask.from_dense(torch.ones(N, N, dtype=torch.bool).tril(),
                                                      block_size=BS),
    "documents": lambda: BlockMask.document(torch.tensor([0, 30, 30, N]), causal=True, block_size=BS),
}


def _band_dense(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """The dense kernels' element mask of window (left, right): query i sees key j iff j is within
    [i + sk - sq - left, i + sk - sq + right] (a side of -1 unbounded)."""
    i = torch.arange(sq).view(-1, 1) + sk - sq
    j = torch.arange(sk).view(1, -1)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


@pytest.mark.parametrize("name", BANDS)
def test_a_band_mask_is_its_band(name):
    build, band = BANDS[name]
    mask = build()
    kt = mask.to_kernel_tensors()
    assert launchers.band_of(kt) == band
    # element for element: the route computes this mask, not a neighbour of it
    assert torch.equal(mask.to_dense()[0, 0], _band_dense(mask.seqlen_q, mask.seqlen_k, *band))


@pytest.mark.parametrize("name", NOT_BANDS)
def test_other_masks_are_no_band(name):
    assert launchers.band_of(NOT_BANDS[name]().to_kernel_tensors()) is None


def test_sparse_route_of_the_spec():
    spec = sparse_routes.SparseSpec(128, 128, 128, True, True, band=(-1, 0))
    assert sparse_routes.sparse_route(spec) == sparse_routes.DenseBandRoute((-1, 0))
    no_band = sparse_routes.SparseSpec(128, 128, 128, True, True)
    assert isinstance(sparse_routes.sparse_route(no_band), sparse_routes.SparseRoute)
    # the block-sparse kernels' route stays at hand for a band, to time or check them there
    assert sparse_routes.triton_sparse_route(spec) == sparse_routes.sparse_route(no_band)


def test_the_gluon_sparse_forward_route():
    """The Gluon forward's block-sparse variant takes a call the dense Gluon forward takes whose mask has
    128-row blocks and key blocks a multiple of its key tiles, with two consumers and neither the half step
    nor the GQA packing; it is the default route where it takes the call (and few blocks are partial)."""
    def route(block_m=128, block_n=128, **kw):
        spec = sparse_routes.SparseSpec(128, block_m, block_n, False, True, dense=route_specs.spec(**kw))
        taken = sparse_routes.gluon_sparse_route(spec)
        assert sparse_routes.sparse_route(spec).gluon_fwd == (taken.gluon_fwd if taken else None)
        return taken

    for d, block_n in ((64, 128), (128, 128), (192, 128), (256, 64)):
        fwd = route(headdim=d, headdim_v=min(d, 128)).gluon_fwd
        assert fwd.tiles.block_m == 128 and fwd.tiles.block_n == block_n, d
        assert (fwd.pack, fwd.half_diag) == (1, False)
    assert route(block_n=256).gluon_fwd.tiles.block_n == 128  # two key tiles a block
    assert route(block_m=64) is None  # a mask block of 64 rows: half the kernel's tile
    assert route(block_n=64) is None  # key blocks narrower than the key tile
    assert route(dropout=True) is None
    assert route(dtype="float32") is None
    assert route(cuda=False) is None
    assert sparse_routes.gluon_sparse_route(sparse_routes.SparseSpec(128, 128, 128, False, True)) is None


def test_the_gluon_sparse_backward_route():
    """The Gluon backward's block-sparse variant takes a call the dense Gluon backward takes on attn_bwd.py's
    kernel (d and dv up to 128) whose mask has 128 x 128 blocks, on the masked calls' tiles (64-row steps,
    d = 64's dQ a step late); under GQA a mask per head gives a program per query head; it is not the
    default route where it takes the call, and gluon_sparse_route leaves it out on request."""
    def route(block_m=128, block_n=128, mask_heads=1, backward=True, **kw):
        spec = sparse_routes.SparseSpec(128, block_m, block_n, False, True, dense=route_specs.spec(**kw),
                                        mask_heads=mask_heads)
        taken = sparse_routes.gluon_sparse_route(spec, backward)
        if backward:
            assert sparse_routes.sparse_route(spec).gluon_bwd == (taken.gluon_bwd if taken else None)
        return taken

    for d, defer in ((64, True), (128, False)):
        bwd = route(headdim=d, headdim_v=d).gluon_bwd
        assert (bwd.tiles.block_m, bwd.tiles.block_n, bwd.defer_dq) == (64, 128, defer), d
        assert not (bwd.d_qk or bwd.wide_keys or bwd.deterministic)
    assert route(headdim=128, headdim_v=64).gluon_bwd is not None  # dv < d: the tiles at d's width
    # GQA 4/2 (route_specs' spec): one mask for all heads keeps the dense split; a mask per head splits the
    # group to one head a program
    assert route().gluon_bwd.group_split == routes.group_split(route_specs.spec())
    assert route(mask_heads=4).gluon_bwd.group_split == 2
    assert route(mask_heads=4, nheads=4, nheads_k=4).gluon_bwd.group_split == 1  # MHA: nothing to split
    assert route(mask_heads=4, batch=64, seqlen_k=65536).gluon_bwd is None  # split buffers past the cap
    assert route(block_n=256).gluon_bwd is None  # a key block of two key tiles
    assert route(block_m=256) is None  # the forward declines it too
    assert route(headdim=192, headdim_v=128).gluon_bwd is None  # the wide heads' kernels: no such variant
    assert route(deterministic=True).gluon_bwd is None  # the Triton kernels' fixed order
    assert route(backward=False).gluon_bwd is None
    assert route(dropout=True) is None


@pytest.mark.parametrize("permille", [0, 100, 101, 570, 1000])
def test_the_default_takes_the_gluon_variants_where_few_blocks_are_partial(permille):
    """Masks whose visible blocks are mostly full run on the Gluon kernels' variants by default (measured
    1.2-1.4x the Triton kernels' speed there), masks with more than GLUON_PARTIAL_PERMILLE partial blocks on
    the Triton kernels (whose rule or bits cost less in a partial step); a band runs the dense kernels
    whatever its blocks; a deterministic call keeps the Gluon forward and the Triton backward."""
    def spec(**kw):
        return sparse_routes.SparseSpec(128, 128, 128, False, True, dense=route_specs.spec(**kw),
                                        partial_permille=permille)

    gluon = permille <= sparse_routes.GLUON_PARTIAL_PERMILLE
    route = sparse_routes.sparse_route(spec())
    assert isinstance(route, sparse_routes.SparseRoute)
    assert (route.gluon_fwd is not None, route.gluon_bwd is not None) == (gluon, gluon)
    if gluon:
        assert route == sparse_routes.gluon_sparse_route(spec())
    else:
        assert route == sparse_routes.triton_sparse_route(spec())
    deterministic = sparse_routes.sparse_route(spec(deterministic=True))
    assert (deterministic.gluon_fwd is not None, deterministic.gluon_bwd) == (gluon, None)
    band = dataclasses.replace(spec(), band=(-1, 0))
    assert sparse_routes.sparse_route(band) == sparse_routes.DenseBandRoute((-1, 0))
    # no dense spec (the interpreter's calls, or a call the Gluon kernels cannot take): the Triton kernels
    assert sparse_routes.sparse_route(dataclasses.replace(spec(), dense=None)).gluon_fwd is None


@pytest.mark.parametrize("name, build", [
    ("local_global", lambda: BlockMask.local_global(2048, 144, 128)),
    ("random_blocks", lambda: BlockMask.from_blocks(torch.rand(1, 2, 16, 16, generator=torch.Generator()
                                                               .manual_seed(0)) < 0.3, 2048, 2048)),
    ("mask_mod", lambda: BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 3 == 0, 2, 1, 300, 200,
                                                 block_size=(64, 32))),
    ("empty", lambda: BlockMask.from_mask_mod(lambda b, h, i, j: i < 0, 1, 1, 100, 100)),
])
def test_partial_permille_counts_the_mask(name, build):
    """The kernel tensors' share of partial blocks, which routing reads, is the mask's own count over every
    batch element and head, and survives a move and the ops' round trip through from_tensors."""
    mask = build()
    counts = mask.num_blocks()
    kt = mask.to_kernel_tensors()
    assert kt.partial_permille == 1000 * counts["partial"] // max(counts["partial"] + counts["full"], 1)
    assert kt.to("cpu").partial_permille == kt.partial_permille
    again = type(kt).from_tensors(kt.tensors(), kt.block_m, kt.block_n, kt.seqlen_q, kt.seqlen_k, kt.rule,
                                  kt.partial_permille)
    assert again.partial_permille == kt.partial_permille
    if name == "random_blocks":
        assert kt.partial_permille == 0  # whole blocks: no partial one
    if name == "mask_mod":
        assert kt.partial_permille == 1000  # every visible block partial


needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                  reason="the Triton launchers run on CUDA or under TRITON_INTERPRET=1")


def _recorders(monkeypatch):
    """Launches of the block-sparse kernels and of the dense Triton forward, by kernel."""
    from flashattn.backends.triton import attention

    calls = {"sparse_fwd": [], "sparse_bwd": [], "dense_fwd": []}
    monkeypatch.setattr(launchers, "sparse_fwd_kernel",
                        LaunchRecorder(launchers.sparse_fwd_kernel, calls["sparse_fwd"]))
    monkeypatch.setattr(launchers, "sparse_bwd_kernel",
                        LaunchRecorder(launchers.sparse_bwd_kernel, calls["sparse_bwd"]))
    monkeypatch.setattr(attention, "attn_fwd_kernel", LaunchRecorder(attention.attn_fwd_kernel,
                                                                     calls["dense_fwd"]))
    return calls


@needs_triton
@pytest.mark.parametrize("name, dropout_p", [("causal_sq>sk", 0.0), ("window_causal", 0.0), ("full", 0.0),
                                             ("causal_sq>sk", 0.3)])
def test_a_band_runs_the_dense_call(monkeypatch, name, dropout_p):
    """The same bits as flash_attn_func with the band's window (dropout's keep mask too: both draw their
    Philox state alike), forward and gradients, and no block-sparse kernel launched."""
    if not INTERPRET:
        pytest.skip("the dense call's route on a GPU: tests/test_block_sparse_gpu.py")
    from flashattn import config as flashattn_config

    monkeypatch.setattr(flashattn_config, "backend", "triton")
    build, band = BANDS[name]
    mask = build()
    q, k, v = make_qkv(2, mask.seqlen_q, mask.seqlen_k, 4, 2, 40, dtype=torch.float32,
                       generator=torch.Generator().manual_seed(0))
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(1))
    calls = _recorders(monkeypatch)
    runs = []
    for call in (lambda *t: flashattn.block_sparse_attn_func(*t, mask, dropout_p=dropout_p),
                 lambda *t: flashattn.flash_attn_func(*t, dropout_p=dropout_p, window_size=band)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        out = call(*leaves)
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert calls["sparse_fwd"] == [] and calls["sparse_bwd"] == []
    assert len(calls["dense_fwd"]) == 2


@needs_triton
def test_other_masks_run_the_block_sparse_kernels(monkeypatch):
    if not INTERPRET:
        pytest.skip("on a GPU: tests/test_block_sparse_gpu.py")
    from flashattn import config as flashattn_config

    monkeypatch.setattr(flashattn_config, "backend", "triton")
    mask = NOT_BANDS["local_global"]()
    q, k, v = (t.requires_grad_() for t in make_qkv(1, N, N, 2, 2, 32, dtype=torch.float32,
                                                    generator=torch.Generator().manual_seed(0)))
    calls = _recorders(monkeypatch)
    out = flashattn.block_sparse_attn_func(q, k, v, mask)
    out.sum().backward()
    assert len(calls["sparse_fwd"]) == 1 and len(calls["sparse_bwd"]) == 2 and calls["dense_fwd"] == []


@needs_triton
def test_bench_rows_say_which_kernels_ran(monkeypatch):
    """flashattn-sparse's rows name the route of the call; flashattn-sparse-kernels runs the block-sparse
    kernels on a band too (the A/B of DenseBandRoute) and gets the public call's result."""
    if not INTERPRET:
        pytest.skip("on a GPU the dense route is Gluon's: tests/test_block_sparse_gpu.py")
    from flashattn import config as flashattn_config
    from flashattn.bench.providers.sparse import _KernelRoute, sparse_routes_info

    monkeypatch.setattr(flashattn_config, "backend", "triton")
    q, k, v = make_qkv(1, N, N, 2, 2, 32, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    band, other = BANDS["window"][0](), NOT_BANDS["local_global"]()
    assert sparse_routes_info(q, k, v, band.to_kernel_tensors()) == {
        "route_fwd": "DenseBandRoute/TritonForward", "route_bwd": "DenseBandRoute/TritonBackward"}
    assert sparse_routes_info(q, k, v, other.to_kernel_tensors()) == {"route_fwd": "SparseRoute",
                                                                      "route_bwd": "SparseRoute"}
    kt = band.to_kernel_tensors()
    calls = _recorders(monkeypatch)
    out = _KernelRoute.apply(q, k, v, kt, launchers.triton_route(q, v, kt))
    assert len(calls["sparse_fwd"]) == 1 and calls["dense_fwd"] == []
    torch.testing.assert_close(out, flashattn.block_sparse_attn_func(q, k, v, band), rtol=1e-5, atol=1e-5)
