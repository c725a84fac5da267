"""`fa4`: FlashAttention-4 (package flash-attn-4, CuTe DSL), timed side by side whenever it imports.

It gets what the case carries, in FA4's own spelling (flash_attn.cute.interface): a window with None for an
unbounded side (flash_attn's -1), softcap, a float32 learnable sink, and packed sequences through its
flash_attn_varlen_func. A plain case passes none of them, so the train suite's call is unchanged. k and v
with fewer heads (GQA) and a v head dim of its own go in as they are; FA4 decides pack_gqa itself.
"""

from __future__ import annotations

import torch

from ..case import Case
from .base import Prepared, Provider, first_tensor, make_leaves
from .features import _require_packed, cu_seqlens
from .ours import flash_attn_options


def fa4_options(case: Case, device: torch.device) -> dict:
    # ours, but FA4 spells an unbounded window side None
    options = flash_attn_options(case, device)
    if "window_size" in options:
        options["window_size"] = tuple(None if w < 0 else w for w in options["window_size"])
    return options


def _setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    # imported here: FA4 is there only where its wheels came along, and never on the CPU
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func

    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    options = fa4_options(case, q.device)
    if case.lengths is not None:
        lengths = _require_packed(case)
        cu, longest = cu_seqlens(lengths, q.device), max(lengths)

        def fwd() -> torch.Tensor:
            out = flash_attn_varlen_func(
                qb[0], kb[0], vb[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                max_seqlen_k=longest, causal=case.causal, **options,
            )  # fmt: skip
            return first_tensor(out).unsqueeze(0)

        return Prepared(fwd=fwd, leaves=leaves)
    # returns (out, lse) in the versions we have seen; first_tensor keeps working if that changes
    return Prepared(
        fwd=lambda: first_tensor(flash_attn_func(qb, kb, vb, causal=case.causal, **options)),
        leaves=leaves,
    )


PROVIDERS = [
    Provider(
        "fa4",
        _setup,
        "FlashAttention-4: flash_attn.cute.interface.flash_attn_func (flash_attn_varlen_func on packed "
        "cases) with the case's window, softcap and sink",
    )
]
