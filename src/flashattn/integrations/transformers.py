"""flashattn as an attention implementation of Hugging Face transformers 5.x.

    from flashattn.integrations.transformers import register
    name = register()  # "fa_triton"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

`register` adds two entries under the same name: the attention function (`AttentionInterface`) and a mask
builder (`AttentionMaskInterface`). The mask builder hands the attention function at most a 2-D padding mask
``(batch, kv_len)`` bool (None when the model was given none), never the dense 4-D mask sdpa/eager need, so
padding costs no ``(q_len, kv_len)`` memory: a decode step (one query token) runs flash_attn_with_kvcache's
launch on the cache with the mask as its key_padding_mask (prepared once per signature and resized as a
dynamic cache grows: `_decode_step`), other calls with a mask run on the packed tokens through
flash_attn_varlen_func (`flashattn.modules.padded_attention`); causal and sliding-window masks come from the
kernels' own flags. Neither reads the mask on the host, so no call synchronises with the device but the
detection of packed sequences below (a mask-free call with position_ids that restart).

transformers routes every implementation whose name contains "flash" to its own flash-attn loader, so the
name must not contain "flash".

What maps, per call, from the model's attention module:
    query/key/value ``(b, h, s, d)`` -> flash_attn_func's ``(b, s, h, d)`` by a transpose (views, no copy);
    scaling -> softmax_scale; dropout -> dropout_p; softcap -> softcap; module.is_causal (or the is_causal
    kwarg) -> causal; sliding_window w -> window_size (w - 1, 0) when causal, (w - 1, w - 1) otherwise, and
    only when the keys are longer than the window (as transformers' own flash path does); s_aux (attention
    sinks, gpt-oss) -> learnable_sink; position_ids with restarts and no padding mask (packed sequences) ->
    one varlen segment per sequence.
Not expressible with the kernels (warned once): a prepared 4-D mask passed by the caller, served by
transformers' sdpa function; ``output_attentions=True``, served by `eager_attention`, which forms the weights
under the same mask (the 2-D padding mask and the module's causal / window flags, or the 4-D mask).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from flashattn import config, kvcache, modules
from flashattn.errors import FlashAttnError
from flashattn.interface import flash_attn_func
from flashattn.interface_varlen import flash_attn_varlen_func
from flashattn.kvcache import flash_attn_with_kvcache, tensor_key
from flashattn.ops import registry

__all__ = ["DEFAULT_NAME", "attention_forward", "eager_attention", "padding_mask", "register"]

DEFAULT_NAME = "fa_triton"

_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(reason: str, instead: str = "transformers' sdpa attention") -> None:
    if reason not in _warned:
        _warned.add(reason)
        _log.warning("flashattn: %s; this call uses %s instead", reason, instead)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> Tensor | None:
    """The mask builder registered with AttentionMaskInterface: the 2-D padding mask or None.

    ``attention_mask`` is the user's ``(batch, seen_tokens + q_length)`` mask; its last kv_length columns are
    the keys of this call (fewer than all seen tokens with a sliding-window cache). Whether every key is real
    is not asked (that would read the mask on the host). A decode step's mask shorter than the cache (a
    static cache, whose slots past the mask hold no key yet) is padded with False to kv_length: the step's
    shapes then stay the same from token to token, as CUDA graphs need. The causal/window pattern in
    ``mask_function`` is not materialised: the attention function gets it from the module's flags.
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if q_length == 1 and attention_mask.shape[1] < kv_length:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, kv_length - attention_mask.shape[1]))
    return attention_mask


def _packed_cu_seqlens(position_ids: Tensor, batch: int, seqlen: int) -> tuple[Tensor, int] | None:
    """cu_seqlens over the flattened ``(batch * seqlen)`` tokens when position_ids restart inside a row.

    A new sequence starts at every row start and wherever the position does not step by +1, the rule
    transformers' mask builders use to detect packed sequences. None when every row is one sequence.
    """
    pos = position_ids.expand(batch, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if int(starts.sum()) == batch:
        return None
    start_idx = starts.flatten().nonzero().flatten()
    cu = torch.cat([start_idx, start_idx.new_tensor([batch * seqlen])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The function registered with AttentionInterface (the signature transformers calls it with).

    query ``(b, h, sq, d)``, key/value ``(b, h_kv, sk, d)``, attention_mask None or ``(b, sk)`` bool from
    `padding_mask`. Returns ``(out (b, sq, h, d), None)``: no attention weights, like transformers' sdpa and
    flash paths.
    """
    if kwargs.get("output_attentions"):
        # the weights are asked for: the kernels never form them, so this call computes them (eager)
        _warn_once("output_attentions=True (the kernels never form the attention weights)", "eager")
        return eager_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               sliding_window=sliding_window, softcap=softcap, is_causal=is_causal,
                               s_aux=s_aux)
    fallback = _fallback_reason(attention_mask, kwargs)
    if fallback is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if s_aux is not None:
            raise NotImplementedError(f"flashattn: attention sinks (s_aux) together with {fallback}")

        _warn_once(fallback)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    b, _, sq, _ = query.shape
    sk = key.shape[2]
    if (sq == 1 and s_aux is None and not dropout and (sliding_window is None or sk <= sliding_window)
            and registry.eager(query)):
        out = _decode_step(query, key, value, attention_mask, scaling, causal, float(softcap or 0.0))
        if out is not None:
            return out, None
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (b, h, s, d) -> (b, s, h, d), views
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    window = (-1, -1)
    if sliding_window is not None and sk > sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    opts = dict(
        dropout_p=float(dropout),
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=float(softcap or 0.0),
        # attention sinks (gpt-oss): one extra logit per head in the softmax, in scaled-score units like ours
        learnable_sink=None if s_aux is None else s_aux.float(),
    )
    if attention_mask is not None and attention_mask.shape[1] < sk:
        # a static cache: the slots past the mask were never written
        k, v = k[:, : attention_mask.shape[1]], v[:, : attention_mask.shape[1]]
    if (sq == 1 and window == (-1, -1) and s_aux is None and not opts["dropout_p"]
            and (attention_mask is None or attention_mask.shape[1] == k.shape[1])):
        # a decode step: the split-KV kernel over the cache as it is, padding read by the kernel
        out = flash_attn_with_kvcache(q, k, v, softmax_scale=scaling, causal=causal, softcap=opts["softcap"],
                                      key_padding_mask=attention_mask)
        return out, None
    if attention_mask is not None:
        # causal: the queries are the newest keys; otherwise (encoders, cross-attention) every query is real
        queries = None if causal else attention_mask.new_ones((b, sq))
        return modules.padded_attention(q, k, v, attention_mask, queries, **opts), None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and sq == sk and sq > 1:
        packed = _packed_cu_seqlens(position_ids, b, sq)
        if packed is not None:
            cu, max_len = packed
            flat = (x.reshape(b * sq, *x.shape[2:]) for x in (q, k, v))
            out = flash_attn_varlen_func(*flat, cu, cu, max_len, max_len, **opts)
            return out.view(b, sq, *out.shape[1:]), None
    return flash_attn_func(q, k, v, **opts), None


# decode steps' prepared launches: by exact signature, and by family (the signature but the caches' length,
# which a dynamic cache grows by a key a step: a new length resizes its family's launch, no new preparation)
_CACHED_STEPS = 256
_steps: dict = {}
_families: dict = {}


def _decode_step(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 scaling: float | None, causal: bool, softcap: float) -> Tensor | None:
    """The output (b, 1, h, d) of one query token against the cache, flash_attn_with_kvcache's, from
    transformers' tensors as they are: query (b, h, 1, d), key / value (b, h_kv, sk, d), attention_mask None
    or (b, sk') bool (sk' < sk: a static cache's written slots). None where the call is not a decode step
    this path serves (another mask length, mixed dtypes): the general path takes it.

    A prepared launch that reads only its tensors' addresses takes them untransposed (the transposed views'
    shapes and strides, fixed at preparation, are the signature's), so a repeated step makes no view."""
    sk = key.shape[2]
    if attention_mask is not None and attention_mask.shape[1] != sk:
        if attention_mask.shape[1] > sk:
            return None
        sk = attention_mask.shape[1]
        key, value = key[:, :, :sk], value[:, :, :sk]
    sig = (tensor_key(query), tensor_key(key), tensor_key(value), tensor_key(attention_mask), scaling, causal,
           softcap, config.backend, config.generation)
    launch = _steps.get(sig)
    if launch is None:
        launch = _prepare_step(query, key, value, attention_mask, scaling, causal, softcap)
        if launch is None:
            return None
        if len(_steps) >= _CACHED_STEPS:
            _steps.clear()
        _steps[sig] = launch
    if launch.prepared.addresses_only:
        out, _ = launch(query, key, value, None, None, None, None, None, None, None, None, None,
                        attention_mask, None, None, False)
    else:
        out, _ = launch(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, None,
                        None, None, None, None, None, None, attention_mask, None, None, False)
    return out


def _prepare_step(query, key, value, attention_mask, scaling, causal, softcap):
    """The kvcache.Launch of a decode step's new signature: its family's resized to this length, or
    checked and prepared (the checks raise flash_attn_with_kvcache's errors); None for mixed dtypes."""
    if not query.dtype == key.dtype == value.dtype:
        return None
    sk = key.shape[2]
    # the checks that see the length: k and v alike, the mask (b, sk) and contiguous along it
    family = None
    if sk > 1 and value.shape[2] == sk:
        family = (tensor_key(query), key.shape[:2], key.shape[3], key.stride(3), value.shape[:2],
                  value.shape[3], value.stride(3), key.dtype, key.device,
                  None if attention_mask is None else (attention_mask.shape[0], attention_mask.stride(1),
                                                       attention_mask.dtype, attention_mask.device),
                  scaling, causal, softcap, config.backend, config.generation)
        known = _families.get(family)
        if known is not None:
            ks, vs = key.stride(), value.stride()  # (b, h, s, d) -> the caches' (batch, seq, head)
            launch = known.resized(sk, (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1]),
                                   0 if attention_mask is None else attention_mask.stride(0))
            if launch is not None:
                _families[family] = launch
                return launch
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    none = dict(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                cache_leftpad=None, block_table=None, alibi_slopes=None, k_descale=None, v_descale=None)
    checked = kvcache.check_call(q, k, v, **none, key_padding_mask=attention_mask, softmax_scale=scaling,
                                 causal=causal, window_size=(-1, -1), softcap=softcap, num_splits=0)
    launch = kvcache.prepare_launch(checked, q, k, v, **none, key_padding_mask=attention_mask, causal=causal,
                                    rotary_interleaved=True, num_splits=0)
    if family is not None:
        if len(_families) >= _CACHED_STEPS:
            _families.clear()
        _families[family] = launch
    return launch


def _fallback_reason(attention_mask, kwargs) -> str | None:
    if attention_mask is not None and attention_mask.dim() != 2:
        return f"a prepared {attention_mask.dim()}-D attention mask (only 2-D padding masks map onto kernels)"
    return None


def _window(sliding_window: int | None, sk: int, causal: bool) -> tuple[int, int]:
    """The (left, right) window of a sliding_window w, as transformers' flash path sets it: only when the
    keys are longer than the window."""
    if sliding_window is None or sk <= sliding_window:
        return -1, -1
    return sliding_window - 1, 0 if causal else sliding_window - 1


def _visible(attention_mask: Tensor | None, b: int, sq: int, sk: int, causal: bool,
             window: tuple[int, int], device) -> Tensor:
    """bool (b, 1, sq, sk): query i sees key j. A 2-D padding mask (b, sk) hides padded keys and the module's
    flags add the causal (bottom-right aligned) and window pattern; a prepared 4-D bool mask is used as is."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.bool().expand(b, 1, sq, sk)
    i = torch.arange(sq, device=device).view(-1, 1) + (sk - sq)  # the key position aligned with query i
    j = torch.arange(sk, device=device).view(1, -1)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    vis = vis.view(1, 1, sq, sk)
    if attention_mask is not None:
        vis = vis & attention_mask.bool().view(b, 1, 1, sk)
    return vis.expand(b, 1, sq, sk)


def eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                    softcap=None, is_causal=None, s_aux=None):
    """Attention that forms its weights, for output_attentions=True, with the mask this integration's path
    would apply: the 2-D padding mask from `padding_mask` with the module's causal / sliding-window flags, or
    a prepared 4-D mask (bool, or additive float) as given. Scores in the inputs' dtype, softmax in float32,
    like transformers' eager attention; attention sinks (s_aux) as one more logit per head.

    query (b, h, sq, d), key / value (b, h_kv, sk, d). Returns (out (b, sq, h, d), weights (b, h, sq, sk));
    a row that sees no key gets weights 0 and output 0.
    """
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    b, h, sq, d = query.shape
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] < key.shape[2]:
        # a static cache: the slots past the mask were never written
        key, value = key[:, :, : attention_mask.shape[1]], value[:, :, : attention_mask.shape[1]]
    sk = key.shape[2]
    group = h // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    if value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    scores = torch.matmul(query, key.transpose(2, 3)) * (d ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.is_floating_point():
        scores = scores + attention_mask[..., :sk]
    else:
        vis = _visible(attention_mask, b, sq, sk, causal, _window(sliding_window, sk, causal), query.device)
        scores = scores.masked_fill(~vis, float("-inf"))
    if s_aux is not None:
        sink = s_aux.to(scores.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
        scores = torch.cat([scores, sink], dim=-1)
    weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(query.dtype)
    if s_aux is not None:
        weights = weights[..., :-1]
    dropped = torch.nn.functional.dropout(weights, p=float(dropout), training=bool(module.training))
    out = torch.matmul(dropped, value).transpose(1, 2).contiguous()
    return out, weights


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashattn with transformers under ``name``; returns it, for ``attn_implementation=name``.

    Idempotent. Raises ValueError for a name containing "flash" (transformers would hand such a name to its
    own flash-attn loader and never call this function).
    """
    if "flash" in name.lower():
        raise FlashAttnError(
            f"name={name!r} contains 'flash': transformers sends every such attn_implementation to its own "
            f"flash-attn loader. Use a name without it, e.g. {DEFAULT_NAME!r}"
        )
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name
