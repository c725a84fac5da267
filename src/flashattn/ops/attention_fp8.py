"""The FP8 attention op: `flashattn::attn_fwd_fp8`, e4m3 q, k, v with float32 descales, inference only (no
autograd: nobody has an FP8 backward, and flashattn.interface_fp8 refuses calls that need gradients).

Padded and varlen layouts as `flashattn::attn_fwd`. The body calls the backend that serves the tensors:
its attention_forward_fp8.
"""

import torch
from torch import Tensor

from flashattn.backends import entry
from flashattn.ops.attention import _empty, _no_keys
from flashattn.ops.registry import Op


def _impl(
    q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None, learnable_sink: Tensor | None, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    if _empty(q, k, max_seqlen_q, max_seqlen_k):
        out, lse = _no_keys(q, v, cu_seqlens_q is not None, learnable_sink)
        return out.to(out_dtype), lse
    return entry(q).attention_forward_fp8(
        q, k, v, q_descale, k_descale, v_descale, out_dtype=out_dtype, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )


def _fake(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
          softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, learnable_sink, out_dtype):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype)
    if cu_seqlens_q is None:
        b, sq, h, _ = q.shape
        return out, q.new_empty((b, h, sq), dtype=torch.float32)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


attn_fwd_fp8 = Op("attn_fwd_fp8", _impl, fake=_fake)


def attention_fp8(q, k, v, q_descale, k_descale, v_descale, *, out_dtype: torch.dtype, softmax_scale: float,
                  causal: bool, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                  learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0,
                  max_seqlen_k: int = 0) -> tuple[Tensor, Tensor]:
    """(out in out_dtype, lse float32) of checked arguments."""
    return attn_fwd_fp8(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k,
                        int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale), bool(causal),
                        int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
                        learnable_sink, out_dtype)
