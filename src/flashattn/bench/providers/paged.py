"""`flashattn-paged` and `flashattn-paged-gather`: paged varlen prefill (flash_attn_varlen_func with a
block_table) on the packed-document cases, forward only (inference: no gradient). Each document's keys go to
pages of PAGE keys of their own, the pages shuffled through the pool; `flashattn-paged` is the launcher on
the call's own route, which reads the pools in the kernel where it can (routes.reads_pages), on the Triton
backend (the GPU; the CPU's interpreter under TRITON_INTERPRET=1), `flashattn-paged-gather` the
same keys first gathered into the packed layout (flashattn.paged.gather_pages, the path such calls took
before, and the one calls that need gradients take), then the packed call."""

from __future__ import annotations

import dataclasses

import torch

from ..case import Case
from .base import Prepared, Provider, make_leaves
from .features import _require_packed, cu_seqlens
from .ours import flash_attn_options

PAGE = 256  # a multiple of the Gluon forward's key tiles at every head dim


def paginate(k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], page: int, seed: int = 0):
    """(k_pool, v_pool, block_table) holding packed (total, hk, ·) k and v: document b's keys in its own
    pages, in order, the pages in a shuffled order through the pool; unused table columns point at page 0."""
    counts = [-(-n // page) for n in lengths]
    num_pages, max_pages = max(sum(counts), 1), max(max(counts), 1)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = torch.zeros(len(lengths), max_pages, dtype=torch.int32, device=k.device)
    pools = [x.new_zeros((num_pages, page, *x.shape[1:])) for x in (k, v)]
    start = used = 0
    for b, (n, c) in enumerate(zip(lengths, counts, strict=True)):
        table[b, :c] = order[used:used + c].int()
        for p in range(c):
            rows = slice(start + p * page, start + min(n, (p + 1) * page))
            for pool, x in zip(pools, (k, v), strict=True):
                pool[order[used + p], : rows.stop - rows.start] = x[rows]
        start, used = start + n, used + c
    return *pools, table


def _setup(gather: bool):
    def setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        import flashattn
        from flashattn import paged

        lengths = _require_packed(case)
        leaves = make_leaves(q, k, v, "bshd")
        qb, kb, vb = (x.detach()[0] for x in leaves)
        cu, longest = cu_seqlens(lengths, q.device), max(lengths)
        k_pool, v_pool, table = paginate(kb, vb, lengths, PAGE)
        options = flash_attn_options(case, q.device)
        if "learnable_sink" in options:
            options["learnable_sink"] = options["learnable_sink"].detach()

        info = {"page_size": PAGE}
        if gather:
            def fwd() -> torch.Tensor:
                with torch.no_grad():
                    k_packed, v_packed = paged.gather_pages(k_pool, v_pool, table, cu)
                    out = flashattn.flash_attn_varlen_func(qb, k_packed, v_packed, cu, cu, longest, longest,
                                                           causal=case.causal, **options)
                return out.unsqueeze(0)
        else:
            # the launcher on the paged call's own route (the pages read in the kernel where it can:
            # routes.reads_pages, which the row records)
            from flashattn.backends.triton import attention, routes

            call = dict(causal=case.causal, cu_seqlens_q=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                        window_size=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
                        learnable_sink=options.get("learnable_sink"))
            spec = dataclasses.replace(attention.spec_of(qb, k_pool[0], v_pool[0], **call), page_size=PAGE)
            route = routes.forward_route(spec)
            info.update(route_fwd=type(route).__name__, reads_pages=routes.reads_pages(spec, route))

            scale = qb.shape[-1] ** -0.5

            def fwd() -> torch.Tensor:
                with torch.no_grad():
                    out, _ = attention.attention_forward(qb, k_pool, v_pool, softmax_scale=scale,
                                                         cu_seqlens_k=cu, block_table=table, route=route,
                                                         **call)
                return out.unsqueeze(0)

        return Prepared(fwd=fwd, leaves=leaves, info=info)

    return setup


PROVIDERS = [
    Provider("flashattn-paged", _setup(False),
             f"this project: flash_attn_varlen_func with a block_table over pages of {PAGE} keys, no "
             "gradient (the kernel reads the pages where its route can; packed cases, forward only)"),
    Provider("flashattn-paged-gather", _setup(True),
             f"the same pages of {PAGE} keys gathered into the packed layout first (flashattn.paged."
             "gather_pages), then flash_attn_varlen_func (packed cases, forward only; A/B timing)"),
]
