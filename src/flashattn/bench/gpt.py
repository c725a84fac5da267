"""A GPT-2-shaped decoder for end-to-end training benchmarks, with the attention implementation pluggable.

GPT2_SMALL is GPT-2 small (12 layers, 12 heads, width 768, vocab 50304 = 50257 padded to a multiple of 128,
learned positions, tied embeddings, pre-LayerNorm, GELU MLP 4x): 124M parameters at 1024 positions. Every
provider trains the same module; only the call inside `CausalSelfAttention` differs, fed the same fused QKV
projection (batch, seqlen, 3, nheads, headdim) and returning (batch, seqlen, nheads, headdim).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPT2_SMALL", "AttentionImpl", "GPTConfig", "attention_impl", "ATTENTION_IMPLS"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    max_seqlen: int = 1024

    def with_(self, **changes) -> GPTConfig:
        return replace(self, **changes)


GPT2_SMALL = GPTConfig()


@dataclass
class AttentionImpl:
    """A causal attention for the model: `fn(qkv)` with qkv (b, s, 3, h, d) -> (b, s, h, d).

    `prepare(seqlen, device)` runs once per shape outside the timed steps (a flex BlockMask, a naive mask);
    `context()` is entered around a whole training run (forcing an SDPA backend).
    """

    name: str
    description: str
    fn: Callable[[Tensor], Tensor]
    prepare: Callable[[int, torch.device], None] = lambda seqlen, device: None
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)


def _flashattn() -> AttentionImpl:
    from flashattn import flash_attn_qkvpacked_func

    return AttentionImpl(
        "flashattn",
        "this project: flash_attn_qkvpacked_func(causal=True), reading q/k/v in place from the projection",
        lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True),
    )


def _sdpa(backend: str) -> AttentionImpl:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (b, s, 3, h, d) -> 3 x (b, h, s, d) views
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    return AttentionImpl(
        f"sdpa-{backend.lower().split('_')[0]}",
        f"torch SDPA forced to SDPBackend.{backend}, is_causal=True",
        fn,
        context=lambda: sdpa_kernel(getattr(SDPBackend, backend)),
    )


def _flex() -> AttentionImpl:
    from torch.nn.attention.flex_attention import create_block_mask

    from .providers.flex import _compiled_flex

    masks: dict = {}

    def prepare(seqlen, device):
        if seqlen not in masks:
            masks[seqlen] = create_block_mask(
                lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, seqlen, seqlen, device=device
            )

    def fn(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return _compiled_flex()(q, k, v, block_mask=masks[q.shape[2]]).transpose(1, 2)

    return AttentionImpl("flex", "torch.compile(flex_attention) with a causal BlockMask", fn, prepare)


def _naive() -> AttentionImpl:
    from .providers.naive import causal_drop_mask, naive_attention

    masks: dict = {}

    def prepare(seqlen, device):
        masks.setdefault(seqlen, causal_drop_mask(seqlen, seqlen, device))

    def fn(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return naive_attention(q, k, v, causal=True, drop=masks[q.shape[2]]).transpose(1, 2)

    return AttentionImpl(
        "naive", "explicit softmax(QKᵀ·scale + causal mask)·V, scores materialised", fn, prepare
    )


ATTENTION_IMPLS: dict[str, Callable[[], AttentionImpl]] = {
    "flashattn": _flashattn,
    "sdpa-cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": lambda: _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": lambda: _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-math": lambda: _sdpa("MATH"),
    "flex": _flex,
    "naive": _naive,
}


def attention_impl(name: str) -> AttentionImpl:
    try:
        return ATTENTION_IMPLS[name]()
    except KeyError:
        raise KeyError(
            f"unknown attention {name!r} for the e2e model; known: {', '.join(ATTENTION_IMPLS)}"
        ) from None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attn: AttentionImpl):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn = attn

    def forward(self, x: Tensor) -> Tensor:
        b, s, e = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim)
        return self.proj(self.attn.fn(qkv).reshape(b, s, e))  # (b, s, h, d) -> (b, s, e)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn: AttentionImpl):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, attn)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attn: AttentionImpl):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.max_seqlen, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, attn) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "fc_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """idx, targets (b, s) int64 -> mean next-token cross-entropy."""
        s = idx.shape[1]
        if s > self.cfg.max_seqlen:
            raise ValueError(f"seqlen {s} > max_seqlen {self.cfg.max_seqlen} of the position table")
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (b, s, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_flops_per_token(cfg: GPTConfig, n_params: int, seqlen: int) -> float:
    """6·N for the weights (forward + backward) plus causal attention's 6·L·s·e (QKᵀ and PV over half the
    square, 3x for the backward) per token: the PaLM appendix B count, halved for causality."""
    return 6.0 * n_params + 6.0 * cfg.n_layer * seqlen * cfg.n_embd
