"""The call specs the routing tests start from (flashattn.backends.triton.routes.Spec)."""

from __future__ import annotations

import dataclasses

from flashattn.backends.triton import routes

CAUSAL = (-1, 0)  # the window of a causal call


def spec(**kw) -> routes.Spec:
    """A plain d = 128 bf16 call on an H200 with TMA-ready tensors, 2K tokens, GQA 4/2; kw replaces fields."""
    base = routes.Spec(batch=1, nheads=4, nheads_k=2, seqlen_q=2048, seqlen_k=2048, headdim=128,
                       headdim_v=128)
    return dataclasses.replace(base, **kw)
