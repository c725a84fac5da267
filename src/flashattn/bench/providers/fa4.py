"""`fa4`: FlashAttention-4 (package flash-attn-4, CuTe DSL), timed side by side whenever it imports."""

from __future__ import annotations

import torch

from ..case import Case
from .base import Prepared, Provider, first_tensor, make_leaves


def _setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    from flash_attn.cute.interface import flash_attn_func

    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    # returns (out, lse) in the versions we have seen; first_tensor keeps working if that changes
    return Prepared(fwd=lambda: first_tensor(flash_attn_func(qb, kb, vb, causal=case.causal)), leaves=leaves)


PROVIDERS = [Provider("fa4", _setup, "FlashAttention-4: flash_attn.cute.interface.flash_attn_func")]
