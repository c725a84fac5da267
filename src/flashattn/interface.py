"""Public attention functions, drop-in compatible with flash_attn 2.x (names, argument order, defaults).

Layout: (batch, seqlen, nheads, headdim); varlen: (total_tokens, nheads, headdim) with int32 cu_seqlens.
Causal masking is aligned to the bottom-right corner of the score matrix: query i sees key j iff
j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:

    1 1 1 1 0
    1 1 1 1 1

and for seqlen_q = 5, seqlen_k = 2 the first three query rows see no key at all: their output is 0, their
gradients are 0 and their softmax_lse is +inf (never NaN). A sliding window (left, right) lets query i see the
keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] (-1: unbounded on that side),
intersected with the causal mask when causal=True.

Beyond flash_attn 2.x, every function takes two keyword arguments current models need:
  learnable_sink: (nheads,) float32, default None. Attention sinks: each head's softmax gets one more logit
      that takes probability mass but contributes no value; its gradient is returned.
  v with its own head dim (e.g. d_qk = 192, d_v = 128): out has v's head dim.
and flash_attn_func / flash_attn_varlen_func take FP8 (e4m3) q, k, v for inference, FlashAttention-3's way:
  q_descale, k_descale, v_descale: float32 (1,) or (batch, nheads_k) (q's also (batch, nheads)), keyword
      only, default None = 1. The value of x is x_fp8 · x_descale (flashattn.fp8.quantize).
  out_dtype: torch.dtype, keyword only, default None = bfloat16 for FP8 calls. See flashattn.interface_fp8.
"""

from flashattn import _validate, interface_fp8
from flashattn.errors import FlashAttnError
from flashattn.ops import attention as attention_ops
from flashattn.ops.attention import default_scale
from flashattn.ops.probs import attention_probs


def _defaults(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, learnable_sink) -> bool:
    """Every option at its default: the common call, valid as it is (the checks' numbers.Real instance tests
    are host time on every call)."""
    return (softmax_scale is None and alibi_slopes is None and learnable_sink is None
            and type(dropout_p) is float and dropout_p == 0.0 and type(softcap) is float and softcap == 0.0
            and type(window_size) is tuple and window_size == (-1, -1)
            and type(window_size[0]) is int and type(window_size[1]) is int)


def check_options(q, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, learnable_sink,
                   batch) -> tuple[int, int]:
    """Checks the options; returns the window as (left, right) ints, -1 for an unbounded side."""
    if _defaults(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, learnable_sink):
        return -1, -1
    _validate.check_scale(softmax_scale)
    _validate.check_dropout(dropout_p)
    window = _validate.check_window(window_size)
    _validate.check_softcap(softcap)
    h = q.shape[-2]
    _validate.check_per_head("alibi_slopes", alibi_slopes, h, batch, q.device, allow_batch=True)
    _validate.check_per_head("learnable_sink", learnable_sink, h, None, q.device, allow_batch=False)
    return window


def _scale_and_lengths(q, k, softmax_scale, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> tuple:
    """(softmax scale, max_seqlen_q, max_seqlen_k) as the op takes them: the default scale where none is
    given, the padded layout's lengths from the shapes."""
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return scale, max_seqlen_q, max_seqlen_k


def _attend(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
            learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(out, softmax_lse, rng_state) of checked arguments, with autograd: the op's arguments in its order."""
    scale, max_seqlen_q, max_seqlen_k = _scale_and_lengths(q, k, softmax_scale, cu_seqlens_q, max_seqlen_q,
                                                           max_seqlen_k)
    return attention_ops.attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                  scale, bool(causal), int(window[0]), int(window[1]), float(softcap),
                                  alibi_slopes, float(dropout_p), learnable_sink, bool(deterministic))


def forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic, probs,
            learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """(out, softmax_lse, S_dmask, rng_state) of checked arguments, with autograd: what the public functions
    and flash_attn_interface's private ones share. probs: compute S_dmask (with dropout; else it is the
    empty tensor flash_attn returns)."""
    out, lse, rng_state = _attend(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                                  deterministic, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k)
    if probs and dropout_p > 0:
        # flash_attn's S_dmask, from the forward's own (seed, offset): the probabilities and the keep mask
        # the kernels used
        scale, max_seqlen_q, max_seqlen_k = _scale_and_lengths(q, k, softmax_scale, cu_seqlens_q,
                                                               max_seqlen_q, max_seqlen_k)
        s_dmask = attention_probs(q, k, rng_state, softmax_scale=scale, causal=causal, window_size=window,
                                  softcap=float(softcap), alibi_slopes=alibi_slopes,
                                  dropout_p=float(dropout_p), cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_k=max_seqlen_k)
    else:
        s_dmask = q.new_empty(0)  # flash_attn returns an empty tensor without dropout
    return out, lse, s_dmask, rng_state


def _run(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
         return_attn_probs, learnable_sink, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
         max_seqlen_k=None):
    if return_attn_probs:
        out, lse, s_dmask, _ = forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap,
                                       alibi_slopes, deterministic, True, learnable_sink, cu_seqlens_q,
                                       cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return out, lse, s_dmask
    # out alone: no S_dmask placeholder to allocate
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                   learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)[0]


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
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Exact softmax attention, computed tile by tile without materialising the score matrix.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 (float32 accepted). Any strides with a
            contiguous last dimension. headdim any value in 1..256. batch and seqlen_q may be 0 (empty
            outputs); seqlen_k may be 0 (every row sees no key).
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device. nheads must be a multiple of nheads_k
            (GQA; nheads_k = 1 is MQA): query head i reads kv head i // (nheads // nheads_k).
        v: (batch, seqlen_k, nheads_k, headdim_v); headdim_v may differ from headdim (1..256).
        dropout_p: float in [0, 1), default 0.0. Dropout on the attention probabilities (pass 0.0 at
            evaluation). The mask is drawn from torch's RNG (torch.manual_seed makes it repeatable) and
            regenerated in the backward, never stored.
        softmax_scale: float > 0, default 1 / sqrt(headdim). Scale of QK^T before the softmax.
        causal: bool, default False. Bottom-right-aligned causal mask (see the module docstring).
        window_size: (left, right), a tuple, list or 2-element integer tensor of ints, default (-1, -1).
            Sliding window local attention; a negative side (-1, or anything below) is unbounded.
        softcap: float >= 0, default 0.0 = off. Scores become softcap·tanh(score / softcap) (after scaling,
            before masking).
        alibi_slopes: (nheads,) or (batch, nheads) float32, default None. Adds -slope·|i + seqlen_k -
            seqlen_q - j| to the score of query i and key j (after softcap).
        deterministic: bool, default False. Bitwise-reproducible gradients (the same inputs give the same
            bits on every run). Without it, the fastest backward may sum dQ in a varying order.
        return_attn_probs: bool, default False. Also return softmax_lse and S_dmask (for testing; with
            dropout it costs one more kernel, which writes the O(seqlen_q·seqlen_k) S_dmask).
        learnable_sink: (nheads,) float32, keyword only, default None. See the module docstring.
        q_descale, k_descale, v_descale: float32 (1,) or (batch, nheads_k), q_descale also (batch, nheads),
            keyword only, default None = 1. With torch.float8_e4m3fn q, k, v: an FP8 call (inference only:
            no dropout, no gradients), x = x_fp8 · x_descale. v may have its seqlen dim contiguous instead
            of its last (the K-major layout of the FP8 P·V product; either is read in place).
        out_dtype: torch.dtype, keyword only, default None = q's dtype, bfloat16 for an FP8 call (which
            takes bfloat16, float16 or float32).

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v), q's dtype (out_dtype for an FP8 call).
        softmax_lse (if return_attn_probs): (batch, nheads, seqlen_q) float32, natural-log log-sum-exp of each
            row's scores (without dropout; including the sink); +inf for rows that see no key.
        S_dmask (if return_attn_probs): flash_attn's. Without dropout an empty tensor (shape (0,), q's dtype).
            With dropout (batch, nheads, seqlen_q rounded up to 128, seqlen_k rounded up to 128) in q's
            dtype: entry (i, j) is exp(s_ij - m), s the scaled score and m the running max of row i over the
            key tiles at and after j's (tiles flash_attn_interface._get_block_size_n wide, visited last to
            first, as flash_attn's tests decode it: normalize_flash_attn_S), negative (sign bit set, also
            on -0.0) where the dropout dropped the entry; 0 where the query sees no key and past seqlen_q /
            seqlen_k. ~torch.signbit(S_dmask) is the keep mask the kernels used.
    """
    if interface_fp8.wanted(q, q_descale, k_descale, v_descale):
        interface_fp8.check_dtypes(q, k, v)
        _validate.check_qkv(q, k, v, fp8=True)
        window = check_options(q, dropout_p, softmax_scale, window_size, softcap, alibi_slopes,
                               learnable_sink, q.shape[0])
        return interface_fp8.attention(
            q, k, v, q_descale, k_descale, v_descale, out_dtype, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, return_attn_probs=return_attn_probs,
            batch=q.shape[0])
    _validate.check_qkv(q, k, v)
    window = check_options(q, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, learnable_sink,
                            q.shape[0])
    if out_dtype is not None and out_dtype != q.dtype:
        raise FlashAttnError(f"out_dtype is {out_dtype}; a 16-bit call returns q's dtype ({q.dtype})")
    return _run(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                return_attn_probs, learnable_sink)


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
    *,
    learnable_sink=None,
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
                           deterministic, return_attn_probs, learnable_sink=learnable_sink)


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
    *,
    learnable_sink=None,
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
                           deterministic, return_attn_probs, learnable_sink=learnable_sink)
