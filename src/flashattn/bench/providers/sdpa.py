"""`sdpa-*`: torch's scaled_dot_product_attention forced to one backend each."""

from __future__ import annotations

import functools

import torch

from ..case import Case
from .base import Prepared, Provider, make_leaves

_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}


def _setup(backend: str, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    leaves = make_leaves(q, k, v, "bhsd")
    qh, kh, vh = leaves
    if case.seqlen_q != case.seqlen_k and case.causal:
        # SDPA's is_causal is top-left aligned; bottom-right needs torch's CausalBias
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(case.seqlen_q, case.seqlen_k)
        kwargs = {"attn_mask": bias}
    else:
        kwargs = {"is_causal": case.causal}
    if case.nheads != case.nheads_k:
        kwargs["enable_gqa"] = True
    return Prepared(
        fwd=lambda: sdpa(qh, kh, vh, **kwargs),
        leaves=leaves,
        layout="bhsd",
        context=functools.partial(sdpa_kernel, getattr(SDPBackend, backend)),
    )


PROVIDERS = [
    Provider(name, functools.partial(_setup, backend), f"torch SDPA forced to SDPBackend.{backend}")
    for name, backend in _BACKENDS.items()
]
