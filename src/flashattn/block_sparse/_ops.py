"""Block-sparse attention as torch.library ops (flashattn::block_sparse_fwd / _bwd) with their autograd.

The mask travels as the list of kernel tensors (BlockMaskKernelTensors.TENSORS order) plus the block size
and its rule as a list of ints (MaskRule.as_list, or MaskRule.NONE), so the ops take tensors and scalars
only and torch.compile traces them without a graph break. The op bodies
call the launchers chosen by `launchers(q)`, the one place that decides between the Triton kernels and the
torch path.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from flashattn import autograd
from flashattn.autograd import _draw_rng_state
from flashattn.backend import backend_name
from flashattn.block_sparse import _torch
from flashattn.masks import BlockMaskKernelTensors, MaskRule

_TRITON_LAUNCHERS = "flashattn.ops.block_sparse"


def launchers(q: Tensor):
    """The module whose block_sparse_forward / block_sparse_backward serve tensors like q: the Triton
    launchers (flashattn.ops.block_sparse, imported lazily like the dense ones) or the torch path (same
    signatures)."""
    if backend_name(q) == "triton":
        return importlib.import_module(_TRITON_LAUNCHERS)
    return _torch


def _kernel_tensors(q, k, mask, block_m, block_n, rule) -> BlockMaskKernelTensors:
    return BlockMaskKernelTensors.from_tensors(mask, block_m, block_n, q.shape[1], k.shape[1],
                                               MaskRule.from_list(rule))


def _options(softmax_scale, softcap, dropout_p, rng_state):
    seed, offset = (int(x) for x in rng_state.tolist()) if dropout_p > 0 else (0, 0)
    return dict(softmax_scale=softmax_scale, softcap=softcap, dropout_p=dropout_p, rng_seed=seed,
                rng_offset=offset)


def _fwd_impl(q, k, v, mask, block_m, block_n, rule, softmax_scale, softcap, dropout_p):
    rng_state = torch.zeros(2, dtype=torch.int64)
    if dropout_p > 0:
        b, sq, h, _ = q.shape
        rng_state = _draw_rng_state(q.device, b * h * sq * k.shape[1])
    kt = _kernel_tensors(q, k, mask, block_m, block_n, rule)
    out, lse = launchers(q).block_sparse_forward(q, k, v, kt, **_options(softmax_scale, softcap, dropout_p,
                                                                          rng_state))
    return out, lse, rng_state


@torch.library.custom_op("flashattn::block_sparse_fwd", mutates_args=())
def block_sparse_fwd(
    q: Tensor, k: Tensor, v: Tensor, mask: list[Tensor], block_m: int, block_n: int, rule: list[int],
    softmax_scale: float, softcap: float, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fwd_impl(q, k, v, mask, block_m, block_n, rule, softmax_scale, softcap, dropout_p)


@block_sparse_fwd.register_fake
def _(q, k, v, mask, block_m, block_n, rule, softmax_scale, softcap, dropout_p):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64)


def _bwd_impl(dout, q, k, v, out, lse, rng_state, mask, block_m, block_n, rule, softmax_scale, softcap,
              dropout_p):
    kt = _kernel_tensors(q, k, mask, block_m, block_n, rule)
    dq, dk, dv = launchers(q).block_sparse_backward(dout, q, k, v, out, lse, kt, **_options(
        softmax_scale, softcap, dropout_p, rng_state))
    return dq, dk, dv


@torch.library.custom_op("flashattn::block_sparse_bwd", mutates_args=())
def block_sparse_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
    mask: list[Tensor], block_m: int, block_n: int, rule: list[int], softmax_scale: float, softcap: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, rng_state, mask, block_m, block_n, rule, softmax_scale, softcap,
                     dropout_p)


@block_sparse_bwd.register_fake
def _(dout, q, k, v, out, lse, rng_state, mask, block_m, block_n, rule, softmax_scale, softcap, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, *scalars = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, *mask)
    ctx.scalars = scalars


def _grads(ctx, dout, bwd):
    # like flash_attn, the LSE output is not differentiated
    q, k, v, out, lse, rng_state, *mask = ctx.saved_tensors
    return bwd(dout, q, k, v, out, lse, rng_state, mask, *ctx.scalars), len(mask)


def _backward(ctx, dout, dlse, drng):
    # a custom op's backward returns one None per tensor of a list input
    (dq, dk, dv), n_mask = _grads(ctx, dout, block_sparse_bwd)
    return dq, dk, dv, [None] * n_mask, None, None, None, None, None, None


block_sparse_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerBlockSparse(torch.autograd.Function):
    """The same forward and backward outside torch.compile, without the custom-op dispatch, whose per-call
    host cost (~0.3 ms per op with autograd, flashattn.autograd._EagerAttention) exceeds the kernel time of
    sparse masks."""

    @staticmethod
    def forward(ctx, q, k, v, mask, *scalars):
        output = _fwd_impl(q, k, v, mask, *scalars)
        _setup_context(ctx, (q, k, v, mask, *scalars), output)
        ctx.mark_non_differentiable(output[1], output[2])
        return output

    @staticmethod
    def backward(ctx, dout, dlse, drng):
        (dq, dk, dv), _ = _grads(ctx, dout, _bwd_impl)
        return dq, dk, dv, None, None, None, None, None, None, None


def block_sparse_attention(q, k, v, mask, block_m, block_n, rule, softmax_scale, softcap, dropout_p):
    """(out, lse, rng_state) with autograd: through the registered op under torch.compile, else directly."""
    op = block_sparse_fwd if autograd._through_custom_op() else _EagerBlockSparse.apply
    return op(q, k, v, mask, block_m, block_n, rule, softmax_scale, softcap, dropout_p)
