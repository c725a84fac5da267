"""The attention ops registered with torch.library (namespace `flashattn::`), with their autograd.

Registered as custom ops with fake (meta) implementations, so torch.compile(fullgraph=True) traces through
forward and backward without a graph break. The op bodies dispatch to the Triton launchers or the torch
backend. One op pair serves the padded and the varlen layouts (cu_seqlens given).

Dropout's (seed, offset) are drawn inside the forward op from torch's generator for the device (the CUDA
generator's Philox seed and offset, advanced by the counters used, as torch's own dropout does), returned as
`rng_state` and saved for the backward, which regenerates the same mask. torch.manual_seed makes runs
repeatable, and torch.utils.checkpoint's RNG-state replay reproduces the mask.
"""

import torch
from torch import Tensor
from torch._C._functorch import unwrap_if_dead

from flashattn.backend import backend_module


def _draw_rng_state(device: torch.device, counters: int) -> Tensor:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + (counters + 3) // 4 * 4)  # CUDA Philox offsets advance in steps of 4
    else:
        seed, offset = (int(x) for x in torch.randint(0, 2**62, (2,)))
    return torch.tensor([seed, offset], dtype=torch.int64)


def _call(launcher, tensors: tuple, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
          causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, learnable_sink,
          **extra):
    """launcher(*tensors, **options, **extra) with the options as the launchers name them; the keywords
    spelled out: a dict of them, unpacked, costs ~1 us more a call."""
    seed, offset = (int(x) for x in rng_state.tolist()) if dropout_p > 0 else (0, 0)
    return launcher(
        *tensors, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=seed, rng_offset=offset,
        learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **extra,
    )


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_left, window_right, softcap, alibi_slopes, dropout_p, learnable_sink, deterministic):
    # deterministic only concerns the backward; it is an input here so that autograd can hand it on
    rng_state = torch.zeros(2, dtype=torch.int64)
    if dropout_p > 0:
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        rng_state = _draw_rng_state(q.device, batch * q.shape[-2] * max_seqlen_q * max_seqlen_k)
    out, lse = _call(backend_module(q).attention_forward, (q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     dropout_p, rng_state, learnable_sink)
    return out, lse, rng_state


@torch.library.custom_op("flashattn::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
    learnable_sink: Tensor | None, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, dropout_p, learnable_sink,
                     deterministic)


@attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes, dropout_p, learnable_sink, deterministic):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is None:
        b, sq, h, _ = q.shape
        lse = q.new_empty((b, h, sq), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64)


def _bwd_impl(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
              learnable_sink, deterministic):
    """dq, dk, dv and dsink (None without a sink)."""
    return _call(backend_module(q).attention_backward, (dout, q, k, v, out, lse), cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                 alibi_slopes, dropout_p, rng_state, learnable_sink, deterministic=deterministic)


@torch.library.custom_op("flashattn::attn_bwd", mutates_args=())
def attn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None, dropout_p: float, learnable_sink: Tensor | None, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dsink = _bwd_impl(
        dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, learnable_sink,
        deterministic)
    # a custom op returns tensors only: an empty dsink stands for "no sink"
    return dq, dk, dv, dsink if dsink is not None else q.new_empty(0, dtype=torch.float32)


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, learnable_sink,
      deterministic):
    n_sink = learnable_sink.shape[0] if learnable_sink is not None else 0
    # the launchers return contiguous gradients whatever the inputs' strides (empty_like would keep them)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(n_sink, dtype=torch.float32))


_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
         "window_left", "window_right", "softcap", "alibi_slopes", "dropout_p")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    *args, learnable_sink, deterministic = rest
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, learnable_sink)
    ctx.args = args
    ctx.deterministic = deterministic


def _grads(ctx, dout, bwd):
    """(dq, dk, dv, dsink); like flash_attn, the LSE output is not differentiated."""
    q, k, v, out, lse, rng_state, sink = ctx.saved_tensors
    dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, rng_state, *ctx.args, sink, ctx.deterministic)
    return dq, dk, dv, dsink.to(sink.dtype) if sink is not None else None


def _backward(ctx, dout, dlse, drng):
    dq, dk, dv, dsink = _grads(ctx, dout, attn_bwd)
    return (dq, dk, dv) + (None,) * len(_ARGS) + (dsink, None)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _through_custom_op() -> bool:
    """Whether calls go through the registered ops (under torch.compile; tests patch it to check the ops)."""
    return torch.compiler.is_compiling()


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward outside torch.compile, without the custom-op dispatch: its per-call host
    cost (~0.3 ms with autograd) exceeds the whole kernel time of small problems. Takes the differentiable
    tensors apart and every other input in one tuple (`rest`: _ARGS, then deterministic): apply's host time
    grows with its argument count (~0.5 us each)."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, rest):
        inputs = (q, k, v, *rest[:-1], learnable_sink, rest[-1])
        output = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[1], output[2])
        # the backward never reads the LSE's gradient: without this the engine fills a zero tensor of the
        # LSE's shape for it on every backward (an allocation and a fill kernel)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse, drng):
        dq, dk, dv, dsink = _grads(ctx, dout, _bwd_impl)
        return dq, dk, dv, dsink, None

    @classmethod
    def apply(cls, q, k, v, learnable_sink, rest):
        """Function.apply without its generic steps: it checks for a setup_context (this Function has none)
        and unwraps dead functorch wrappers through a generator over the arguments; the same unwrapping of
        the four tensor arguments here, ~1-2 us less host time."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(q, k, v, learnable_sink, rest)
        sink = learnable_sink if learnable_sink is None else unwrap_if_dead(learnable_sink)
        return _eager_apply(unwrap_if_dead(q), unwrap_if_dead(k), unwrap_if_dead(v), sink, rest)


# the C++ apply that Function.apply ends in (its `super().apply`), bound to _EagerAttention
_eager_apply = super(torch.autograd.Function, _EagerAttention).apply


def _needs_grad(q, k, v, learnable_sink) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        learnable_sink is not None and learnable_sink.requires_grad))


def attention(q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap: float = 0.0,
              alibi_slopes=None, dropout_p: float = 0.0, learnable_sink=None, deterministic: bool = False,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """(out, lse, rng_state) with autograd: through the registered op under torch.compile, else directly
    (and without an autograd node when nothing needs a gradient: inference)."""
    rest = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale),
            bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
            float(dropout_p), bool(deterministic))
    if _through_custom_op():
        return attn_fwd(q, k, v, *rest[:-1], learnable_sink, rest[-1])
    if _needs_grad(q, k, v, learnable_sink):
        return _EagerAttention.apply(q, k, v, learnable_sink, rest)
    return _fwd_impl(q, k, v, *rest[:-1], learnable_sink, rest[-1])
