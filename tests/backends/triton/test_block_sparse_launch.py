"""The block-sparse launchers on an H200's default routes, on the CPU (tests/fake_h200.py: the
device facts faked and every kernel a recorder, so the whole host path down to the launch runs): which
kernels a call launches by its mask's partial blocks and `deterministic`, that the Gluon kernels get the
mask's own tensors, and that a repeated signature's kept route and launches launch the same. What they
compute: tests/test_block_sparse_gpu.py."""

from __future__ import annotations

import fake_h200
import pytest
import torch

import flashattn.kernels.gluon.attn_bwd as bwd_ws_kernels
import flashattn.kernels.gluon.attn_fwd as fwd_ws_kernels
from flashattn import BlockMask
from flashattn.backends.triton import attention, block_sparse

N = 512


@pytest.fixture
def sparse_h200(monkeypatch):
    """The fake H200's launch log, the block-sparse Triton kernels (and the preprocess they launch)
    recorded too."""
    log = fake_h200.install(monkeypatch)
    for name in ("sparse_fwd_kernel", "sparse_bwd_kernel", "attn_bwd_preprocess_kernel"):
        monkeypatch.setattr(block_sparse, name, fake_h200.Kernel(getattr(block_sparse, name), log))
    return log


def _params(log, kernel: str, real) -> dict:
    """The parameters by name of the one JIT call of `kernel` in the log."""
    (call,) = [c for kind, name, c in log if kind == "jit" and name == kernel]
    _, args, kwargs = call
    return {**dict(zip(real.arg_names, args, strict=False)), **kwargs}


def _tensors():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N, 4, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, N, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v, torch.randn(1, N, 4, 128, generator=g).to(torch.bfloat16)


def _run(mask, deterministic=False, tensors=None):
    """The mask's kernel tensors and the forward's (out, lse), after a forward and a backward."""
    q, k, v, dout = tensors or _tensors()
    kt = mask.to_kernel_tensors()
    out, lse = block_sparse.block_sparse_forward(q, k, v, kt, softmax_scale=0.1)
    block_sparse.block_sparse_backward(dout, q, k, v, out, lse, kt, softmax_scale=0.1,
                                       deterministic=deterministic)
    return kt, out, lse


def _whole_blocks(seed=1, density=0.4):
    """Per query head, whole 128 x 128 blocks (no partial one), every diagonal block on."""
    table = torch.rand(1, 4, N // 128, N // 128, generator=torch.Generator().manual_seed(seed)) < density
    return BlockMask.from_blocks(table | torch.eye(N // 128, dtype=torch.bool), N, N)


def test_whole_blocks_launch_the_gluon_variants(sparse_h200):
    kt, _, _ = _run(_whole_blocks())
    names = [name for kind, name, _ in sparse_h200 if kind == "jit"]
    assert names == ["attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_ws_kernel"]
    fwd = _params(sparse_h200, "attn_fwd_ws_kernel", fwd_ws_kernels.attn_fwd_ws_kernel)
    assert fwd["FULL_NUM"] is kt.kv_full_num and fwd["Q_ORDER"] is kt.q_order
    bwd = _params(sparse_h200, "attn_bwd_ws_kernel", bwd_ws_kernels.attn_bwd_ws_kernel)
    assert bwd["Q_FULL_NUM"] is kt.q_full_num and bwd["K_ORDER"] is kt.k_order
    assert bwd["PART_BITS"].data_ptr() == kt.part_bits.data_ptr() and bwd["PART_BITS"].dtype == torch.int16
    # a mask per query head under GQA 4:2: a program per head, whose float32 dK / dV parts are summed
    assert bwd["SPLIT"] == 2 and bwd["DK_ACC"] is not None
    assert (bwd["mask_b"], bwd["mask_h"], bwd["n_kblocks"]) == (1, 4, N // 128)


def test_mostly_partial_blocks_launch_the_triton_kernels(sparse_h200):
    kt, _, _ = _run(BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 3 == 0, 1, 1, N, N))
    assert kt.partial_permille == 1000
    names = [name for kind, name, _ in sparse_h200 if kind == "jit"]
    assert names == ["sparse_fwd_kernel", "attn_bwd_preprocess_kernel", "sparse_bwd_kernel",
                     "sparse_bwd_kernel"]


def test_deterministic_keeps_the_triton_backward(sparse_h200):
    _run(_whole_blocks(), deterministic=True)
    names = [name for kind, name, _ in sparse_h200 if kind == "jit"]
    assert names == ["attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel", "sparse_bwd_kernel",
                     "sparse_bwd_kernel"]


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_repeated_signature_launches_as_the_uncached_path(sparse_h200, monkeypatch, deterministic):
    """A repeated call signature takes its kept route and, on the Gluon variants, its kept launches (the
    forward's here, the backward's in attention_backward's cache): the same launches, every parameter, as
    the first call and as a path that keeps nothing."""
    tensors = _tensors()
    mask = _whole_blocks()
    kt = mask.to_kernel_tensors()
    names = {t.data_ptr(): n for n, t in zip(("q", "k", "v", "dout"), tensors, strict=True)}
    names.update({getattr(kt, n).data_ptr(): n for n in kt.TENSORS})
    runs, alive = [], []  # each round's out and lse kept, so that no later tensor takes their names
    for kept in (True, True, False):
        monkeypatch.setattr(block_sparse, "_signature",
                            block_sparse._signature if kept else lambda *a, **kw: None)
        monkeypatch.setattr(attention, "_cacheable", attention._cacheable if kept else lambda *a: False)
        sparse_h200.clear()
        _, out, lse = _run(mask, deterministic, tensors)
        names.update({out.data_ptr(): "out", lse.data_ptr(): "lse"})
        alive += [out, lse]
        runs.append(fake_h200.launches(sparse_h200, names))
        if kept and len(runs) == 2 and not deterministic:
            # every launch a hit's: through the kept plans, no JIT call
            assert [kind for kind, *_ in sparse_h200] == ["run"] * 3
    assert runs[0] == runs[1] == runs[2]


def test_other_list_shapes_miss_and_the_same_shapes_launch_their_own_mask(sparse_h200):
    """The kept launch is keyed on the mask's list shapes (which fix its scalar arguments): a mask of other
    shapes launches afresh; one of the same shapes takes the kept launch with its own tensors."""
    tensors = _tensors()
    n = N // 128
    eye = torch.eye(n, dtype=torch.bool).expand(1, 4, n, n)
    cross = eye.clone()
    cross[..., 0, :] = True  # a full first row and column: lists as long as every block's
    cross[..., :, 0] = True
    every, diagonal, other = (BlockMask.from_blocks(t, N, N) for t in (torch.ones_like(eye), eye, cross))
    kts = [m.to_kernel_tensors() for m in (every, diagonal, other)]
    assert kts[0].shapes() != kts[1].shapes() and kts[0].shapes() == kts[2].shapes()
    _run(every, tensors=tensors)
    sparse_h200.clear()
    _run(diagonal, tensors=tensors)
    assert [kind for kind, name, _ in sparse_h200 if name == "attn_fwd_ws_kernel"] == ["jit"]
    sparse_h200.clear()
    _run(other, tensors=tensors)
    assert [kind for kind, name, _ in sparse_h200 if name == "attn_fwd_ws_kernel"] == ["run"]
    ((_, _, params),) = [c for c in fake_h200.launches(sparse_h200, {kts[2].kv_full_num.data_ptr(): "mine"})
                         if c[0] == "attn_fwd_ws_kernel"]
    assert ("mine", torch.int32, tuple(kts[2].kv_full_num.shape), kts[2].kv_full_num.stride()) in params


def test_the_kept_launches_hold_no_tensor(sparse_h200):
    """Neither the kept routes and launches nor their keys hold a tensor (the mask's lists, the inputs)."""
    _run(_whole_blocks())
    reached = fake_h200.objects_reached(block_sparse._route_cache, block_sparse._forward_cache,
                                        attention._backward_cache)
    assert len(block_sparse._route_cache) == 1 and len(block_sparse._forward_cache) == 1
    assert len(attention._backward_cache) == 1 and reached > 50
