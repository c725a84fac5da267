"""FP8 calls of flash_attn_func and flash_attn_varlen_func: e4m3 q, k, v with float32 descales
(FlashAttention-3's `q_descale`, `k_descale`, `v_descale`), inference only.

The value of x is x_fp8 · descale (flashattn.fp8.quantize makes both). A descale is per tensor, shape (1,),
or per (sequence, kv head), shape (batch, nheads_k); q's may also be per query head, (batch, nheads) (what
quantize(q, "head") gives). None means 1. The output comes in out_dtype (default bfloat16), the LSE in
float32. Every option of the 16-bit forward but dropout is taken (causal, windows, softcap, ALiBi, sinks, GQA,
varlen). A call that would need gradients raises: there is no FP8 backward.

V's layout: the P·V product on FP8 tensor cores takes V K-major, i.e. with its seqlen dim contiguous. v may
come either way and is read in place: its last dim contiguous (Triton then transposes each tile with byte
permutes in registers), or its seqlen dim (quantize(v, ..., seq_contiguous=True) lays it out so).
"""

import torch
from torch import Tensor

from flashattn.errors import FlashAttnError
from flashattn.ops.attention import default_scale
from flashattn.ops.attention_fp8 import attention_fp8

FP8 = torch.float8_e4m3fn
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def wanted(q, q_descale, k_descale, v_descale) -> bool:
    """Whether a call is an FP8 one: e4m3 q, or any descale given."""
    return (getattr(q, "dtype", None) is FP8 or q_descale is not None or k_descale is not None
            or v_descale is not None)


def _descale(name: str, t, batch: int, heads: tuple[int, ...], device) -> Tensor:
    """A checked descale: None becomes ones (1,); a 0-d tensor (1,)."""
    if t is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    shapes = " or ".join(["(1,)", *(f"({batch}, {h})" for h in heads)])
    if not isinstance(t, Tensor) or t.dtype != torch.float32:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise FlashAttnError(f"{name} must be a float32 tensor of shape {shapes}, got {got}")
    if t.dim() == 0:
        t = t.reshape(1)
    if tuple(t.shape) != (1,) and tuple(t.shape) not in [(batch, h) for h in heads]:
        raise FlashAttnError(f"{name} has shape {tuple(t.shape)}; expected {shapes} (per tensor, or per "
                             f"sequence and head)")
    if t.device != device:
        raise FlashAttnError(f"{name} is on {t.device} but q is on {device}; they must share a device")
    return t


def check_dtypes(q, k, v) -> None:
    """An FP8 call's q, k, v: all e4m3 (then the layout checks take them with fp8=True)."""
    dtypes = tuple(getattr(t, "dtype", type(t).__name__) for t in (q, k, v))
    if any(d is not FP8 for d in dtypes):
        raise FlashAttnError(f"an FP8 call (e4m3 q or a descale given) takes torch.float8_e4m3fn q, k and v "
                             f"(flashattn.fp8.quantize), got {', '.join(map(str, dtypes))}")


def attention(q, k, v, q_descale, k_descale, v_descale, out_dtype, *, dropout_p, softmax_scale, causal,
              window, softcap, alibi_slopes, learnable_sink, return_attn_probs, batch: int,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """An FP8 call whose layout (check_dtypes, then _validate.check_qkv with fp8=True) and options are
    checked but for what FP8 adds (the descales, out_dtype, dropout and gradients); returns what
    flash_attn_func does."""
    if dropout_p:
        raise FlashAttnError(f"dropout_p is {dropout_p}; FP8 attention is inference only: pass 0.0")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise FlashAttnError("q, k or v requires grad, but FP8 attention has no backward (inference only): "
                             "call it under torch.no_grad() or on tensors that do not require grad")
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in _OUT_DTYPES:
        raise FlashAttnError(f"out_dtype is {out_dtype!r}; expected one of "
                             f"{', '.join(map(str, _OUT_DTYPES))}")
    h, hk = q.shape[-2], k.shape[-2]
    descales = (_descale("q_descale", q_descale, batch, (hk, h) if h != hk else (h,), q.device),
                _descale("k_descale", k_descale, batch, (hk,), q.device),
                _descale("v_descale", v_descale, batch, (hk,), q.device))
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    out, lse = attention_fp8(q, k, v, *descales, out_dtype=out_dtype, softmax_scale=scale, causal=causal,
                             window_size=window, softcap=float(softcap), alibi_slopes=alibi_slopes,
                             learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    # without dropout flash_attn's S_dmask is an empty tensor
    return (out, lse, out.new_empty(0)) if return_attn_probs else out
