"""The block-sparse launchers on an H200's default routes, on the CPU (tests/fake_h200.py: the
device facts faked and every kernel a recorder, so the whole host path down to the launch runs): which
kernels a call launches by its mask's partial blocks and `deterministic`, and that the Gluon kernels get
the mask's own tensors. What they compute: tests/test_block_sparse_gpu.py."""

from __future__ import annotations

import fake_h200
import pytest
import torch

import flashattn.kernels.gluon.attn_bwd as bwd_ws_kernels
import flashattn.kernels.gluon.attn_fwd as fwd_ws_kernels
from flashattn import BlockMask
from flashattn.backends.triton import block_sparse

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


def _run(mask, deterministic=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N, 4, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, N, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    kt = mask.to_kernel_tensors()
    out, lse = block_sparse.block_sparse_forward(q, k, v, kt, softmax_scale=0.1)
    block_sparse.block_sparse_backward(torch.randn_like(out), q, k, v, out, lse, kt, softmax_scale=0.1,
                                       deterministic=deterministic)
    return kt


def _whole_blocks():
    """Per query head, whole 128 x 128 blocks (no partial one), every diagonal block on."""
    table = torch.rand(1, 4, N // 128, N // 128, generator=torch.Generator().manual_seed(1)) < 0.4
    return BlockMask.from_blocks(table | torch.eye(N // 128, dtype=torch.bool), N, N)


def test_whole_blocks_launch_the_gluon_variants(sparse_h200):
    kt = _run(_whole_blocks())
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
    kt = _run(BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 3 == 0, 1, 1, N, N))
    assert kt.partial_permille == 1000
    names = [name for kind, name, _ in sparse_h200 if kind == "jit"]
    assert names == ["sparse_fwd_kernel", "attn_bwd_preprocess_kernel", "sparse_bwd_kernel",
                     "sparse_bwd_kernel"]


def test_deterministic_keeps_the_triton_backward(sparse_h200):
    _run(_whole_blocks(), deterministic=True)
    names = [name for kind, name, _ in sparse_h200 if kind == "jit"]
    assert names == ["attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel", "sparse_bwd_kernel",
                     "sparse_bwd_kernel"]
