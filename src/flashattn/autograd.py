"""The attention ops registered with torch.library (namespace `flashattn::`), with their autograd.

Registered as custom ops with fake (meta) implementations, so torch.compile(fullgraph=True) traces through
forward and backward without a graph break. The op bodies dispatch to the Triton launchers or the torch
backend.
"""

import torch
from torch import Tensor

from flashattn.backend import backend_module


@torch.library.custom_op("flashattn::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    # deterministic only concerns the backward; it is an input here so that autograd can hand it on
    return backend_module(q).attention_forward(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes,
    )


@attn_fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashattn::attn_bwd", mutates_args=())
def attn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return backend_module(q).attention_backward(
        dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic,
    )


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
      deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.alibi_slopes = alibi_slopes
    ctx.args = (softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse):
    # like flash_attn, the LSE output is not differentiated
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, *ctx.args, ctx.alibi_slopes, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap: float = 0.0,
              alibi_slopes=None, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) with autograd through the registered op."""
    return attn_fwd(q, k, v, float(softmax_scale), bool(causal), int(window_size[0]), int(window_size[1]),
                    float(softcap), alibi_slopes, bool(deterministic))
