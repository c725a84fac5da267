"""Public attention functions, drop-in compatible with flash_attn 2.x (names, argument order, defaults).

Layout: (batch, seqlen, nheads, headdim). Causal masking is aligned to the bottom-right corner of the score
matrix: query i sees key j iff j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:

    1 1 1 1 0
    1 1 1 1 1

and for seqlen_q = 5, seqlen_k = 2 the first three query rows see no key at all: their output is 0, their
gradients are 0 and their softmax_lse is +inf (never NaN).
"""

from flashattn import _validate
from flashattn.autograd import attention
from flashattn.ops.attention import default_scale

_ISSUE7 = "comes with issue 7 (training features) and is not implemented yet"


def _check_features(dropout_p, window_size, softcap, alibi_slopes) -> None:
    _validate.check_dropout(dropout_p)
    _validate.check_window(window_size)
    _validate.check_softcap(softcap)
    if dropout_p > 0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout {_ISSUE7}; pass dropout_p=0.0")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)}: sliding-window attention {_ISSUE7}")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping {_ISSUE7}")
    if alibi_slopes is not None:
        raise NotImplementedError(f"alibi_slopes: ALiBi {_ISSUE7}")


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Exact softmax attention, computed tile by tile without materialising the score matrix.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 (float32 accepted). Any strides with a
            contiguous last dimension. headdim any value in 1..256.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device. nheads must be a multiple of nheads_k
            (GQA; nheads_k = 1 is MQA): query head i reads kv head i // (nheads // nheads_k).
        v: (batch, seqlen_k, nheads_k, headdim).
        dropout_p: float, default 0.0. Dropout on the attention probabilities (training only; not yet
            implemented: > 0 raises NotImplementedError).
        softmax_scale: float, default 1 / sqrt(headdim). Scale of QK^T before the softmax.
        causal: bool, default False. Bottom-right-aligned causal mask (see the module docstring).
        window_size: (left, right), default (-1, -1) = unbounded. Sliding window (not yet implemented).
        softcap: float, default 0.0 = off. Score softcapping c·tanh(s/c) (not yet implemented).
        alibi_slopes: (nheads,) or (batch, nheads) float32, default None (not yet implemented).
        deterministic: bool, default False. Bitwise-reproducible gradients. The kernels use no atomics, so the
            backward is deterministic either way, at no cost.
        return_attn_probs: bool, default False. Also return softmax_lse and S_dmask (for testing).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse (if return_attn_probs): (batch, nheads, seqlen_q) float32, natural-log log-sum-exp of each
            row's scaled scores; +inf for rows that see no key.
        S_dmask (if return_attn_probs): None (the dropout pattern exists only when dropout_p > 0).
    """
    _validate.check_qkv(q, k, v)
    _validate.check_scale(softmax_scale)
    _check_features(dropout_p, window_size, softcap, alibi_slopes)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = attention(q, k, v, scale, bool(causal), window_size, softcap, alibi_slopes, deterministic)
    if return_attn_probs:
        return out, lse, None
    return out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func on a packed projection.

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim). q, k and v are read in place (no copy); the gradient
            arrives in qkv's layout.
        Other arguments as flash_attn_func.
    Returns: as flash_attn_func.
    """
    _validate.check_packed("qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func with k and v packed together.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        kv: (batch, seqlen_k, 2, nheads_k, headdim), read in place.
        Other arguments as flash_attn_func.
    Returns: as flash_attn_func.
    """
    _validate.check_packed("kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)
