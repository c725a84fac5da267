"""block_sparse_attn_func: exact attention restricted to a BlockMask, skipping the tiles it leaves empty."""

from __future__ import annotations

from flashattn import _validate
from flashattn.dropout import dropout_keep_mask
from flashattn.errors import FlashAttnError
from flashattn.masks import BlockMask, MaskRule
from flashattn.ops.attention import default_scale
from flashattn.ops.block_sparse import block_sparse_attention

__all__ = ["block_sparse_attn_func", "check_block_mask"]


def check_block_mask(block_mask, q, k) -> None:
    """The mask must describe this call: its seqlens, and batch / heads of 1 or the call's."""
    if not isinstance(block_mask, BlockMask):
        raise FlashAttnError(
            f"block_mask must be a flashattn.BlockMask (see BlockMask.causal, .from_mask_mod, ...), got "
            f"{type(block_mask).__name__}")
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    if (block_mask.seqlen_q, block_mask.seqlen_k) != (sq, sk):
        raise FlashAttnError(
            f"block_mask is for (seqlen_q, seqlen_k) = {(block_mask.seqlen_q, block_mask.seqlen_k)} but q "
            f"and k have {(sq, sk)}; build the mask for the call's lengths")
    mb, mh = block_mask.shape[:2]
    if mb not in (1, b):
        raise FlashAttnError(f"block_mask has batch {mb} but q has batch {b}; expected 1 (shared) or {b}")
    if mh not in (1, h):
        raise FlashAttnError(
            f"block_mask has {mh} heads but q has {h} query heads; expected 1 (shared) or {h} (masks are per "
            f"query head, also with GQA)")


def block_sparse_attn_func(
    q,
    k,
    v,
    block_mask,
    softmax_scale=None,
    dropout_p=0.0,
    softcap=0.0,
    return_attn_probs=False,
    deterministic=False,
):
    """Attention where query i sees key j only where block_mask allows it; tiles the mask leaves empty cost
    nothing. Equal to dense attention with block_mask.to_dense() as the mask. A mask that is exactly a band
    (BlockMask.full, causal, sliding_window, local_global without global tokens) runs the dense kernels:
    the result of flash_attn_func with that window_size. As there, the backward sums dQ in a varying order
    on the fast kernels (gradients equal within rounding from run to run, not bitwise) unless
    deterministic=True.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 (float32 accepted). Any strides with a
            contiguous last dimension.
        k: (batch, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 (GQA/MQA: query head i reads kv
            head i // (nheads // nheads_k)).
        v: (batch, seqlen_k, nheads_k, headdim_v).
        block_mask: flashattn.BlockMask of shape (1 or batch, 1 or nheads, seqlen_q, seqlen_k), any block
            size it was built with; on any device (its kernel tensors are copied to q's device once and
            cached). Causal patterns built by BlockMask are bottom-right aligned:
                seqlen_q = 2, seqlen_k = 5:  1 1 1 1 0
                                             1 1 1 1 1
        softmax_scale: float > 0, default 1 / sqrt(headdim).
        dropout_p: float in [0, 1), default 0.0. Same Philox mask convention as flash_attn_func.
        softcap: float >= 0, default 0.0 = off. Scores become softcap·tanh(score / softcap) before masking.
        return_attn_probs: bool, default False. Also return softmax_lse and S_dmask.
        deterministic: bool, default False. True: bitwise-reproducible gradients (the backward on kernels
            whose every gradient element has one writer, or a fixed order of adds), at some speed.

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v), q's dtype. Rows that see no key are 0 (their gradients
            too).
        softmax_lse (if return_attn_probs): (batch, nheads, seqlen_q) float32 natural-log LSE of the visible
            scores; +inf for rows that see no key.
        S_dmask (if return_attn_probs): None without dropout, else the bool keep mask (batch, nheads,
            seqlen_q, seqlen_k) that was drawn (dense: for tests).
    """
    _validate.check_qkv(q, k, v)
    _validate.check_scale(softmax_scale)
    _validate.check_dropout(dropout_p)
    _validate.check_softcap(softcap)
    check_block_mask(block_mask, q, k)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    kt = block_mask.to_kernel_tensors(q.device)
    rule = list(MaskRule.NONE) if kt.rule is None else kt.rule.as_list()
    out, lse, rng_state = block_sparse_attention(q, k, v, kt.tensors(), kt.block_m, kt.block_n, rule,
                                                 kt.partial_permille, scale, float(softcap), float(dropout_p),
                                                 bool(deterministic))
    if not return_attn_probs:
        return out
    s_dmask = None
    if dropout_p > 0:
        seed, offset = (int(x) for x in rng_state.tolist())
        b, sq, h, _ = q.shape
        s_dmask = dropout_keep_mask(seed, offset, b, h, sq, k.shape[1], dropout_p, device=q.device)
    return out, lse, s_dmask
