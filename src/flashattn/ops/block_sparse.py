"""The block-sparse attention ops: `flashattn::block_sparse_fwd` and `flashattn::block_sparse_bwd`.

The mask travels as the list of kernel tensors (BlockMaskKernelTensors.TENSORS order) plus the block size,
its rule as a list of ints (MaskRule.as_list, or MaskRule.NONE) and its share of partial blocks, so the ops
take tensors and scalars only and torch.compile traces them without a graph break. `deterministic` asks the
backward for gradients that are bitwise reproducible (the forward ignores it and passes it on). The bodies
call the backend that serves the tensors: its block_sparse_forward / block_sparse_backward.
"""

import torch
from torch import Tensor

from flashattn.backends import entry
from flashattn.masks import BlockMaskKernelTensors, MaskRule
from flashattn.ops.registry import Op
from flashattn.ops.rng import NO_RNG, draw_rng_state, unpack


def _kernel_tensors(q, k, mask, block_m, block_n, rule, partial_permille) -> BlockMaskKernelTensors:
    return BlockMaskKernelTensors.from_tensors(mask, block_m, block_n, q.shape[1], k.shape[1],
                                               MaskRule.from_list(rule), partial_permille)


def _fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, mask: list[Tensor], block_m: int, block_n: int, rule: list[int],
    partial_permille: int, softmax_scale: float, softcap: float, dropout_p: float, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    rng_state = NO_RNG
    if dropout_p > 0:
        b, sq, h, _ = q.shape
        rng_state = draw_rng_state(q.device, b * h * sq * k.shape[1])
    seed, offset = unpack(rng_state, dropout_p)
    kt = _kernel_tensors(q, k, mask, block_m, block_n, rule, partial_permille)
    out, lse = entry(q).block_sparse_forward(q, k, v, kt, softmax_scale=softmax_scale, softcap=softcap,
                                             dropout_p=dropout_p, rng_seed=seed, rng_offset=offset)
    return out, lse, rng_state


def _fwd_fake(q, k, v, mask, block_m, block_n, rule, partial_permille, softmax_scale, softcap, dropout_p,
              deterministic):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64)


def _bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
    mask: list[Tensor], block_m: int, block_n: int, rule: list[int], partial_permille: int,
    softmax_scale: float, softcap: float, dropout_p: float, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = unpack(rng_state, dropout_p)
    kt = _kernel_tensors(q, k, mask, block_m, block_n, rule, partial_permille)
    return entry(q).block_sparse_backward(dout, q, k, v, out, lse, kt, softmax_scale=softmax_scale,
                                          softcap=softcap, dropout_p=dropout_p, rng_seed=seed,
                                          rng_offset=offset, deterministic=deterministic)


def _bwd_fake(dout, q, k, v, out, lse, rng_state, mask, block_m, block_n, rule, partial_permille,
              softmax_scale, softcap, dropout_p, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


block_sparse_bwd = Op("block_sparse_bwd", _bwd_impl, fake=_bwd_fake)
block_sparse_fwd = Op("block_sparse_fwd", _fwd_impl, fake=_fwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, *scalars = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, *mask)
    ctx.scalars = scalars


def _backward(ctx, dout, dlse, drng):
    # like flash_attn, the LSE output is not differentiated
    q, k, v, out, lse, rng_state, *mask = ctx.saved_tensors
    dq, dk, dv = block_sparse_bwd(dout, q, k, v, out, lse, rng_state, mask, *ctx.scalars)
    # a custom op's backward returns one None per tensor of a list input
    return dq, dk, dv, [None] * len(mask), *([None] * len(ctx.scalars))


block_sparse_fwd.register_autograd(_backward, _setup_context, differentiable=("q", "k", "v"),
                                   non_differentiable_outputs=(1, 2))


def block_sparse_attention(q, k, v, mask, block_m, block_n, rule, partial_permille, softmax_scale, softcap,
                           dropout_p, deterministic):
    """(out, lse, rng_state) with autograd."""
    return block_sparse_fwd(q, k, v, mask, block_m, block_n, rule, partial_permille, softmax_scale, softcap,
                            dropout_p, deterministic)
