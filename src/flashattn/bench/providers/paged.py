"""`flashattn-paged` and `flashattn-paged-gather`: paged varlen prefill (flash_attn_varlen_func with a
block_table) on the packed-document cases, forward only (inference: no gradient). Each document's keys go to
pages of PAGE keys of their own, the pages shuffled through the pool; `flashattn-paged` is the public call,
which reads the pools in the kernel where its route can (routes.reads_pages), `flashattn-paged-gather` the
same keys first gathered into the packed layout (flashattn.paged.gather_pages, the path such calls took
before, and the one calls that need gradients take), then the packed call."""

from __future__ import annotations

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

        def fwd() -> torch.Tensor:
            with torch.no_grad():
                if gather:
                    k_packed, v_packed = paged.gather_pages(k_pool, v_pool, table, cu)
                    out = flashattn.flash_attn_varlen_func(qb, k_packed, v_packed, cu, cu, longest, longest,
                                                           causal=case.causal, **options)
                else:
                    out = flashattn.flash_attn_varlen_func(qb, k_pool, v_pool, cu, cu, longest, longest,
                                                           causal=case.causal, block_table=table, **options)
            return out.unsqueeze(0)

        return Prepared(fwd=fwd, leaves=leaves, info={"page_size": PAGE})

    return setup


PROVIDERS = [
    Provider("flashattn-paged", _setup(False),
             f"this project: flash_attn_varlen_func with a block_table over pages of {PAGE} keys, no "
             "gradient (the kernel reads the pages where its route can; packed cases, forward only)"),
    Provider("flashattn-paged-gather", _setup(True),
             f"the same pages of {PAGE} keys gathered into the packed layout first (flashattn.paged."
             "gather_pages), then flash_attn_varlen_func (packed cases, forward only; A/B timing)"),
]
