"""merge_attention_states: exact attention over a union of disjoint key sets from the parts' (out, lse).

The rule (design.md) is the one split-KV decoding, cascade (shared-prefix) attention and ring attention use:
with m = max_i lse_i and w_i = exp(lse_i - m),

    out = Σ_i w_i out_i / Σ_i w_i,        lse = m + log Σ_i w_i.

An empty part (it saw no key) contributes nothing. Such a part may say so either way: lse = +inf, which is
what flash_attn_func / flash_attn_with_kvcache return for a row that sees no key (flash_attn's convention),
or lse = -inf (the natural value, exp(-inf) = 0; split partials use it). A row whose parts are all empty
gets out 0 and lse +inf, the public convention again, so merged results can be merged further.

Differentiable with respect to every out_i and lse_i (gradients 0 through empty parts).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from flashattn.errors import FlashAttnError
from flashattn.ops.merge import merge_states

__all__ = ["merge_attention_states"]


def _check_parts(outs: Sequence, lses: Sequence) -> bool:
    """Validates the parts; returns True for the varlen layout (out (total, h, d), lse (h, total))."""
    if len(outs) == 0 or len(outs) != len(lses):
        raise FlashAttnError(f"merge_attention_states needs as many outputs as LSEs, at least one; got "
                             f"{len(outs)} outputs and {len(lses)} LSEs")
    ref = outs[0]
    for i, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        for name, t in ((f"out[{i}]", o), (f"lse[{i}]", lse)):
            if not isinstance(t, Tensor):
                raise FlashAttnError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if o.dim() not in (3, 4):
            raise FlashAttnError(f"out[{i}] has shape {tuple(o.shape)}; expected (batch, seqlen_q, nheads, "
                                 f"headdim) or, varlen, (total_q, nheads, headdim)")
        if o.shape != ref.shape or o.dtype != ref.dtype or o.device != ref.device:
            raise FlashAttnError(f"out[{i}] is {tuple(o.shape)} {o.dtype} on {o.device} but out[0] is "
                                 f"{tuple(ref.shape)} {ref.dtype} on {ref.device}; the parts must match")
        if o.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise FlashAttnError(f"out[{i}] has dtype {o.dtype}; expected float16, bfloat16 or float32")
        if o.stride(-1) != 1:
            raise FlashAttnError(
                f"out[{i}] must have a contiguous last dimension, got strides {tuple(o.stride())}"
            )
        if lse.dtype != torch.float32:
            raise FlashAttnError(
                f"lse[{i}] has dtype {lse.dtype}; expected torch.float32 (softmax_lse as returned)"
            )
        if lse.device != o.device:
            raise FlashAttnError(
                f"lse[{i}] is on {lse.device} but out[{i}] on {o.device}; they must share a device"
            )
        want = (o.shape[0], o.shape[2], o.shape[1]) if o.dim() == 4 else (o.shape[1], o.shape[0])
        if tuple(lse.shape) != want:
            layout = "(batch, nheads, seqlen_q)" if o.dim() == 4 else "(nheads, total_q)"
            raise FlashAttnError(f"lse[{i}] has shape {tuple(lse.shape)}; expected {want} = {layout} for out "
                                 f"of shape {tuple(o.shape)}")
    return ref.dim() == 3


def merge_attention_states(out_a, lse_a, out_b=None, lse_b=None):
    """Merge attention results over disjoint key sets into the result over their union (exact).

    Two forms:
        merge_attention_states(out_a, lse_a, out_b, lse_b) -> (out, lse)
        merge_attention_states([out_0, out_1, ...], [lse_0, lse_1, ...]) -> (out, lse)

    Arguments:
        out_*: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32, as flash_attn_func
            returns it; or, for varlen results, (total_q, nheads, headdim). All parts share shape and dtype.
        lse_*: (batch, nheads, seqlen_q) float32, natural log, as flash_attn_func(return_attn_probs=True)
            or flash_attn_with_kvcache(return_softmax_lse=True) return it; varlen: (nheads, total_q).
            +inf or -inf marks a part in which the row saw no key (see the module docstring).

    Returns:
        out: like out_a, in its dtype (the merge itself runs in float32). 0 for rows no part saw a key for.
        lse: like lse_a, float32; +inf for rows no part saw a key for.

    Example, cascade attention: a prefix shared by the whole batch attended once, the suffixes per sequence:
        o_p, l_p, _ = flash_attn_func(q, k_prefix, v_prefix, return_attn_probs=True)
        o_s, l_s = flash_attn_with_kvcache(q, k_suffix_cache, v_suffix_cache, cache_seqlens=...,
                                           return_softmax_lse=True)
        out, lse = merge_attention_states(o_p, l_p, o_s, l_s)
    """
    if isinstance(out_a, (list, tuple)):
        if out_b is not None or lse_b is not None:
            raise FlashAttnError("merge_attention_states(outs, lses) takes two lists; out_b/lse_b must be "
                                 "None")
        outs, lses = list(out_a), list(lse_a)
    else:
        if out_b is None or lse_b is None:
            raise FlashAttnError("merge_attention_states needs out_a, lse_a, out_b, lse_b, or two lists")
        outs, lses = [out_a, out_b], [lse_a, lse_b]
    varlen = _check_parts(outs, lses)
    if varlen:
        outs = [o.unsqueeze(0) for o in outs]
        lses = [lse.unsqueeze(0) for lse in lses]
    out, lse = merge_states(outs, lses)
    if varlen:
        return out[0], lse[0]
    return out, lse
