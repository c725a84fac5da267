"""nn.Module wrappers around the attention functions, after flash_attn.modules.mha.

- `SelfAttention` / `CrossAttention`: the inner attention over already projected q/k/v (padded layout, or
  varlen layout with ``cu_seqlens``), with dropout active in training mode only.
- `MultiHeadAttention`: fused QKV projection ``Wqkv``, GQA/MQA, causal or sliding-window masks, optional
  rotary embeddings, dropout, ``out_proj``; loads and writes ``torch.nn.MultiheadAttention`` state dicts.
- `padded_attention`: attention over a batch with padding masks (Hugging Face's 2-D masks), computed on the
  unpadded tokens so padded keys cost nothing and padded queries get output 0.

All modules are batch-first: activations are ``(batch, seqlen, embed_dim)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashattn.bert_padding import index_first_axis, index_put_first_axis, unpad_indices_static
from flashattn.errors import FlashAttnError
from flashattn.interface import flash_attn_func
from flashattn.interface_varlen import flash_attn_varlen_func
from flashattn.rotary import RotaryEmbedding

__all__ = ["CrossAttention", "MultiHeadAttention", "SelfAttention", "padded_attention"]


def padded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor,
    query_padding_mask: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """flash_attn_func over a padded batch: padded keys are never attended to, padded queries output 0.

    Arguments:
        q: ``(batch, seqlen_q, nheads, headdim)``; k, v: ``(batch, seqlen_k, nheads_k, headdim)``.
        key_padding_mask: ``(batch, seqlen_k)`` bool, True = real token (Hugging Face's convention; the
            opposite of nn.MultiheadAttention's key_padding_mask).
        query_padding_mask: ``(batch, seqlen_q)`` bool, default: the last seqlen_q columns of
            key_padding_mask (the queries are the newest keys, as in a decoder with or without a cache).
        kwargs: those of flash_attn_varlen_func (dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, learnable_sink).

    Causal and window masks are aligned on each sequence's real tokens: query i of a sequence sees its key
    j iff ``j <= i + real_k - real_q``. With the queries being the last tokens of the keys and padding on
    either side (or anywhere), that is exactly "sees the real keys at or before its own position".

    No device synchronisation: the masks are never read on the host (bert_padding.unpad_indices_static); the
    kernels run over batch · seqlen packed rows, the padding ones last and covered by no sequence.
    """
    b, sq = q.shape[:2]
    sk = k.shape[1]
    if key_padding_mask.shape != (b, sk):
        raise FlashAttnError(
            f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected (batch, seqlen_k) = "
            f"{(b, sk)}"
        )
    key_padding_mask = key_padding_mask.bool()
    if query_padding_mask is None:
        if sq > sk:
            raise FlashAttnError(
                f"seqlen_q {sq} > seqlen_k {sk}: pass query_padding_mask, the queries are not the last keys"
            )
        query_padding_mask = key_padding_mask[:, sk - sq :]
    # packed without reading the masks on the host (no device sync): every token, the padding ones last, and
    # the padded lengths as max_seqlen; the padding rows are zeroed on the way in, so that no gradient the
    # kernels leave in rows of no sequence flows back, and on the way out, where they give the padded output 0
    q_idx, cu_q, q_real = unpad_indices_static(query_padding_mask)
    k_idx, cu_k, k_real = unpad_indices_static(key_padding_mask)
    q_real, k_real = q_real.view(-1, 1, 1), k_real.view(-1, 1, 1)
    q_unpad = torch.where(q_real, index_first_axis(q.flatten(0, 1), q_idx), 0)
    k_unpad, v_unpad = (torch.where(k_real, index_first_axis(x.flatten(0, 1), k_idx), 0) for x in (k, v))
    out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, sq, sk, **kwargs)
    return index_put_first_axis(torch.where(q_real, out, 0), q_idx, b * sq).unflatten(0, (b, sq))


class SelfAttention(nn.Module):
    """Attention over a packed qkv, like flash_attn.modules.mha.SelfAttention.

    Arguments:
        causal: default causal mask (bottom-right aligned); forward's ``causal`` overrides it per call.
        softmax_scale: default ``1 / sqrt(headdim)``.
        attention_dropout: dropout probability on the attention weights, applied in training mode only.
        window_size: ``(left, right)``, -1 = unbounded.
        deterministic: bitwise-reproducible backward.
    """

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        window_size=(-1, -1),
        deterministic=False,
    ):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop_p = attention_dropout
        self.window_size = tuple(window_size)
        self.deterministic = deterministic

    def _kwargs(self, causal):
        return dict(
            dropout_p=self.drop_p if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal if causal is None else causal,
            window_size=self.window_size,
            deterministic=self.deterministic,
        )

    def forward(self, qkv: Tensor, causal: bool | None = None, cu_seqlens=None, max_seqlen=None) -> Tensor:
        """qkv ``(batch, seqlen, 3, nheads, headdim)``, or ``(total, 3, nheads, headdim)`` with cu_seqlens
        ``(batch+1,)`` int32 and max_seqlen; returns ``(batch, seqlen, nheads, headdim)`` or ``(total, ...)``.
        """
        q, k, v = qkv.unbind(-3)
        if cu_seqlens is not None:
            return flash_attn_varlen_func(
                q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **self._kwargs(causal)
            )
        return flash_attn_func(q, k, v, **self._kwargs(causal))

    def extra_repr(self) -> str:
        return f"causal={self.causal}, attention_dropout={self.drop_p}, window_size={self.window_size}"


class CrossAttention(SelfAttention):
    """Attention of q over a packed kv, like flash_attn.modules.mha.CrossAttention (same arguments as
    SelfAttention). kv may have fewer heads than q (GQA/MQA)."""

    def forward(
        self,
        q: Tensor,
        kv: Tensor,
        causal: bool | None = None,
        cu_seqlens=None,
        max_seqlen=None,
        cu_seqlens_k=None,
        max_seqlen_k=None,
    ) -> Tensor:
        """q ``(batch, seqlen_q, nheads, headdim)``, kv ``(batch, seqlen_k, 2, nheads_k, headdim)``; or the
        varlen layouts ``(total_q, nheads, headdim)`` and ``(total_k, 2, nheads_k, headdim)`` with cu_seqlens
        (queries), cu_seqlens_k (keys) and their max lengths. Returns q's layout with v's head dim."""
        k, v = kv.unbind(-3)
        if cu_seqlens is not None:
            if cu_seqlens_k is None:
                raise FlashAttnError("cu_seqlens was given without cu_seqlens_k; varlen needs both")
            return flash_attn_varlen_func(
                q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **self._kwargs(causal)
            )
        return flash_attn_func(q, k, v, **self._kwargs(causal))


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection.

    Arguments:
        embed_dim: model width; ``head_dim = embed_dim // num_heads``.
        num_heads: query heads.
        num_heads_kv: key/value heads (GQA; 1 = MQA), default num_heads; must divide num_heads.
        bias: biases in Wqkv and out_proj.
        dropout: dropout on the attention weights, training mode only.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)`` sliding window, -1 = unbounded.
        rotary_dim: rotate the first rotary_dim features of q and k (RoPE); 0 = no rotary.
        rotary_base, rotary_interleaved: see flashattn.rotary.
        softmax_scale: default ``1 / sqrt(head_dim)``.

    ``Wqkv`` maps ``embed_dim -> (num_heads + 2 * num_heads_kv) * head_dim``, its output rows ordered q, k, v,
    heads within each: the layout of nn.MultiheadAttention's ``in_proj_weight`` (see from_torch).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_heads_kv: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        rotary_dim: int = 0,
        rotary_base: float = 10000.0,
        rotary_interleaved: bool = False,
        softmax_scale: float | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if embed_dim % num_heads:
            raise FlashAttnError(f"embed_dim={embed_dim} is not a multiple of num_heads={num_heads}")
        if num_heads_kv < 1 or num_heads % num_heads_kv:
            raise FlashAttnError(
                f"num_heads_kv={num_heads_kv} does not divide num_heads={num_heads}; "
                "num_heads must be a multiple of num_heads_kv (GQA)"
            )
        self.embed_dim, self.num_heads, self.num_heads_kv = embed_dim, num_heads, num_heads_kv
        self.head_dim = embed_dim // num_heads
        if rotary_dim > self.head_dim:
            raise FlashAttnError(f"rotary_dim={rotary_dim} is larger than head_dim={self.head_dim}")
        self.rotary_emb = RotaryEmbedding(rotary_dim, rotary_base, rotary_interleaved) if rotary_dim else None
        factory = {"device": device, "dtype": dtype}
        qkv_dim = (num_heads + 2 * num_heads_kv) * self.head_dim
        self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias, **factory)
        self.inner_attn = SelfAttention(causal, softmax_scale, dropout, window_size)

    @property
    def causal(self) -> bool:
        return self.inner_attn.causal

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """x ``(batch, seqlen, embed_dim)`` -> ``(batch, seqlen, embed_dim)``.

        attention_mask: ``(batch, seqlen)`` bool, True = real token (Hugging Face's convention, the opposite
        of nn.MultiheadAttention's key_padding_mask). Padded tokens are neither attended to nor attend; their
        output is out_proj's bias.
        """
        b, s, _ = x.shape
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = self.Wqkv(x)  # (b, s, (h + 2 hk) d)
        q = qkv[..., : h * d].unflatten(-1, (h, d))  # views, no copies: the kernels take strided inputs
        k = qkv[..., h * d : (h + hk) * d].unflatten(-1, (hk, d))
        v = qkv[..., (h + hk) * d :].unflatten(-1, (hk, d))
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k)
        attn = self.inner_attn
        if attention_mask is None:
            out = flash_attn_func(q, k, v, **attn._kwargs(None))
        else:
            out = padded_attention(q, k, v, attention_mask, **attn._kwargs(None))
        return self.out_proj(out.reshape(b, s, h * d))  # (b, s, h, d) -> (b, s, h d)

    # -- nn.MultiheadAttention state dicts ------------------------------------------------------------------

    def load_torch_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True):
        """Load an ``nn.MultiheadAttention(embed_dim, num_heads, bias=...)`` state dict.

        What maps (num_heads_kv == num_heads only; nn.MultiheadAttention has no GQA):
            in_proj_weight ``(3E, E)`` -> Wqkv.weight;  in_proj_bias ``(3E,)`` -> Wqkv.bias;
            out_proj.weight -> out_proj.weight;  out_proj.bias -> out_proj.bias.
        What does not: bias_k / bias_v (add_bias_kv=True) and q/k/v_proj_weight (kdim or vdim differing
        from embed_dim) have no counterpart and raise ValueError. Configuration is not part of a state dict:
        causal, batch_first (this module is always batch-first) and dropout are set on the module.
        """
        unsupported = [k for k in state_dict if k in ("bias_k", "bias_v") or k.endswith("_proj_weight")]
        unsupported = [k for k in unsupported if k != "in_proj_weight"]
        if unsupported:
            raise FlashAttnError(
                f"state dict keys {unsupported} have no counterpart in MultiHeadAttention: add_bias_kv and "
                "kdim/vdim != embed_dim are not supported"
            )
        self._check_torch_compatible()
        rename = {"in_proj_weight": "Wqkv.weight", "in_proj_bias": "Wqkv.bias"}
        return self.load_state_dict({rename.get(k, k): t for k, t in state_dict.items()}, strict=strict)

    def torch_state_dict(self) -> dict[str, Tensor]:
        """The weights as an nn.MultiheadAttention state dict (the mapping of load_torch_state_dict)."""
        self._check_torch_compatible()
        rename = {"Wqkv.weight": "in_proj_weight", "Wqkv.bias": "in_proj_bias"}
        return {rename.get(k, k): t for k, t in self.state_dict().items()}

    def _check_torch_compatible(self) -> None:
        if self.num_heads_kv != self.num_heads:
            raise FlashAttnError(
                f"num_heads_kv={self.num_heads_kv} != num_heads={self.num_heads}: nn.MultiheadAttention has "
                "no grouped-query attention, its in_proj packs as many k/v heads as q heads"
            )

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **kwargs) -> MultiHeadAttention:
        """A MultiHeadAttention with ``mha``'s weights, dtype, device, heads, bias and dropout.

        kwargs set what nn.MultiheadAttention leaves to the call (causal, window_size, rotary_dim, ...).
        ``mha(x, x, x, attn_mask=causal_mask, need_weights=False)[0]`` then equals
        ``from_torch(mha, causal=True)(x)`` for batch-first x; for ``batch_first=False`` modules pass
        ``x.transpose(0, 1)`` here and transpose the output back.
        """
        if getattr(mha, "add_zero_attn", False):
            raise FlashAttnError(
                "nn.MultiheadAttention(add_zero_attn=True) has no counterpart in MultiHeadAttention"
            )
        if mha.bias_k is not None or not mha._qkv_same_embed_dim:
            raise FlashAttnError(
                "nn.MultiheadAttention with add_bias_kv=True or kdim/vdim != embed_dim has no counterpart in "
                "MultiHeadAttention"
            )
        weight = mha.in_proj_weight
        kwargs.setdefault("dropout", mha.dropout)
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            bias=mha.in_proj_bias is not None,
            device=weight.device,
            dtype=weight.dtype,
            **kwargs,
        )
        new.load_torch_state_dict(mha.state_dict())
        return new

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_heads_kv={self.num_heads_kv}, "
            f"head_dim={self.head_dim}"
        )
