"""The dense and varlen attention ops: `flashattn::attn_fwd` and `flashattn::attn_bwd`, with autograd.

One op pair serves the padded and the varlen layouts (cu_seqlens given). The bodies call the backend that
serves the tensors (`flashattn.backends.entry`): its attention_forward / attention_backward. Dropout's
(seed, offset) are drawn inside the forward op (ops/rng.py) and saved for the backward.
"""

import math

import torch
from torch import Tensor

from flashattn.backends import entry
from flashattn.ops.registry import Op
from flashattn.ops.rng import NO_RNG, draw_rng_state, unpack


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _empty(q: Tensor, k: Tensor, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """No query row sees a key: an empty batch, no queries or no keys (the kernels' grids would be empty)."""
    return q.numel() == 0 or k.shape[-3] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0


def _no_keys(q: Tensor, v: Tensor, varlen: bool, learnable_sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out, lse) of rows that see no key: out 0, lse +inf (the sink's logit with a sink)."""
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    h = q.shape[-2]
    lse_shape = (h, q.shape[0]) if varlen else (q.shape[0], h, q.shape[1])
    if learnable_sink is None:
        return out, q.new_full(lse_shape, math.inf, dtype=torch.float32)
    sink = learnable_sink.float().view(h, 1) if varlen else learnable_sink.float().view(1, h, 1)
    return out, sink.expand(lse_shape).contiguous()


def _fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
    learnable_sink: Tensor | None, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    # deterministic only concerns the backward; it is an input here so that autograd can hand it on
    rng_state = NO_RNG
    if dropout_p > 0:
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        rng_state = draw_rng_state(q.device, batch * q.shape[-2] * max_seqlen_q * max_seqlen_k)
    seed, offset = unpack(rng_state, dropout_p)
    if _empty(q, k, max_seqlen_q, max_seqlen_k):
        return (*_no_keys(q, v, cu_seqlens_q is not None, learnable_sink), rng_state)
    out, lse = entry(q).attention_forward(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=seed, rng_offset=offset,
        learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    return out, lse, rng_state


def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_left, window_right, softcap, alibi_slopes, dropout_p, learnable_sink, deterministic):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is None:
        b, sq, h, _ = q.shape
        lse = q.new_empty((b, h, sq), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64)


def _bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None, dropout_p: float, learnable_sink: Tensor | None, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    seed, offset = unpack(rng_state, dropout_p)
    if _empty(q, k, max_seqlen_q, max_seqlen_k):
        # no row sees a key: every gradient is 0 (the sink's too: its rows' outputs are 0, so D = 0)
        n_sink = learnable_sink.shape[0] if learnable_sink is not None else 0
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                q.new_zeros(n_sink, dtype=torch.float32))
    dq, dk, dv, dsink = entry(q).attention_backward(
        dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        dropout_p=dropout_p, rng_seed=seed, rng_offset=offset, learnable_sink=learnable_sink,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic,
    )
    # an op returns tensors only: an empty dsink stands for "no sink"
    return dq, dk, dv, dsink if dsink is not None else q.new_empty(0, dtype=torch.float32)


def _bwd_fake(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
              learnable_sink, deterministic):
    n_sink = learnable_sink.shape[0] if learnable_sink is not None else 0
    # the launchers return contiguous gradients whatever the inputs' strides (empty_like would keep them)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(n_sink, dtype=torch.float32))


attn_bwd = Op("attn_bwd", _bwd_impl, fake=_bwd_fake)
attn_fwd = Op("attn_fwd", _fwd_impl, fake=_fwd_fake)
_N_OPTIONS = 11  # the inputs between v and learnable_sink: cu_seqlens_q ... dropout_p


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    *options, learnable_sink, deterministic = rest
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, learnable_sink)
    ctx.options = options
    ctx.deterministic = deterministic


def _backward(ctx, dout, dlse, drng):
    # like flash_attn, the LSE output is not differentiated
    q, k, v, out, lse, rng_state, sink = ctx.saved_tensors
    dq, dk, dv, dsink = attn_bwd(dout, q, k, v, out, lse, rng_state, *ctx.options, sink, ctx.deterministic)
    dsink = dsink.to(sink.dtype) if sink is not None else None
    return (dq, dk, dv) + (None,) * _N_OPTIONS + (dsink, None)


attn_fwd.register_autograd(_backward, _setup_context, differentiable=("q", "k", "v", "learnable_sink"),
                           non_differentiable_outputs=(1, 2))


def _paged_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: Tensor | None, learnable_sink: Tensor | None,
) -> tuple[Tensor, Tensor]:
    if q.numel() == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return _no_keys(q, v, True, learnable_sink)
    return entry(q).attention_forward(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_table=block_table)


def _paged_fwd_fake(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, learnable_sink):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


# the paged varlen forward for calls that need no gradient (inference prefill): no autograd; a call that
# needs one takes attn_fwd on the gathered keys (flashattn.paged)
attn_fwd_paged = Op("attn_fwd_paged", _paged_fwd_impl, fake=_paged_fwd_fake)
