"""`flashattn::attn_probs`: the attention probabilities in flash_attn's S_dmask form (kernels/triton/probs.py
says what the form is), for `return_attn_probs=True` with dropout. No autograd: flash_attn's S_dmask is for
inspecting a call, not for differentiating through.

The key tiles' width is flash_attn's `_get_block_size_n` (its tests decode S_dmask with it):
flashattn.dropout's s_dmask_block_n, for a device here (`block_size_n`); flashattn.flash_attn_interface
exposes it under flash_attn's name.
"""

import torch
from torch import Tensor

from flashattn.backends import entry
from flashattn.dropout import s_dmask_block_n, s_dmask_shape
from flashattn.ops.registry import Op
from flashattn.ops.rng import unpack


def block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """S_dmask's key-tile width for a call on `device` (flash_attn's `_get_block_size_n`)."""
    device = torch.device(device)
    sm8x = False
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm8x = major == 8 and minor > 0
    return s_dmask_block_n(head_dim, is_dropout, is_causal, sm8x)


def _impl(
    q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Tensor | None, dropout_p: float, rng_state: Tensor, block_n: int,
) -> Tensor:
    seed, offset = unpack(rng_state, dropout_p)
    return entry(q).attention_probs(
        q, k, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=seed, rng_offset=offset,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, block_n=block_n,
    )


def _fake(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
          window_right, softcap, alibi_slopes, dropout_p, rng_state, block_n):
    if cu_seqlens_q is None:
        b, h = q.shape[0], q.shape[2]
    else:
        b, h = cu_seqlens_q.shape[0] - 1, q.shape[1]
    return q.new_empty(s_dmask_shape(b, h, max_seqlen_q, max_seqlen_k))


attn_probs = Op("attn_probs", _impl, fake=_fake)


def attention_probs(q, k, rng_state, *, softmax_scale: float, causal: bool, window_size=(-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> Tensor:
    """S_dmask of the call whose forward drew rng_state: dropout.s_dmask_shape(batch, nheads, max_seqlen_q,
    max_seqlen_k) in q's dtype (padded layout: max_seqlen_* = seqlen_*)."""
    block_n = block_size_n(q.device, q.shape[-1], dropout_p > 0, causal)
    return attn_probs(q.detach(), k.detach(), cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                      int(max_seqlen_k), float(softmax_scale), bool(causal), int(window_size[0]),
                      int(window_size[1]), float(softcap), alibi_slopes, float(dropout_p), rng_state, block_n)
