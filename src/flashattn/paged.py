"""Paged KV for varlen prefill: `flash_attn_varlen_func(..., block_table=...)`.

With a block table, k and v are page pools (num_pages, page_size, nheads_k, headdim) and the keys of sequence
b are positions [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]) of its pages: position p lives in page
block_table[b, p // page_size], row p % page_size. `packed_from_pages` gathers them into the packed
(total_k, nheads_k, headdim) layout the varlen kernels read, then the usual varlen path runs.

The gather costs one read and one write of the attended keys and values (plus a device-to-host copy of
cu_seqlens_k[-1] for the packed size), next to the kernel's own reads of them; a prefill reads every key once
per block of queries anyway, so it is a small fraction for long prompts. Gradients flow back into the pools
through the gather.
"""

import torch
from torch import Tensor

from flashattn import _validate
from flashattn._validate_cache import check_block_table, checks_enabled
from flashattn.errors import FlashAttnError

_POOL = "(num_pages, page_size, nheads_k, headdim) with a block_table"


def check_paged(q: Tensor, k: Tensor, v: Tensor, block_table: Tensor, batch: int, max_seqlen_k: int) -> None:
    check_block_table(block_table, batch, q)
    _validate.check_tensor("k", k, 4, _POOL)
    _validate.check_tensor("v", v, 4, _POOL)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
    if v.shape[:3] != k.shape[:3]:
        raise FlashAttnError(f"v has shape {tuple(v.shape)} but k {tuple(k.shape)}; their page pools must "
                             "match "
                             f"in (num_pages, page_size, nheads_k)")
    capacity = block_table.shape[1] * k.shape[1]
    if max_seqlen_k > capacity:
        raise FlashAttnError(f"max_seqlen_k is {max_seqlen_k} but block_table holds "
                             f"{block_table.shape[1]} pages "
                             f"of {k.shape[1]} keys = {capacity}; expected max_seqlen_k <= max_pages * "
                             "page_size")


def packed_from_pages(k: Tensor, v: Tensor, block_table: Tensor,
                      cu_seqlens_k: Tensor) -> tuple[Tensor, Tensor]:
    """(k, v) packed (total_k, nheads_k, headdim[_v]) from the page pools."""
    page_size, num_pages = k.shape[1], k.shape[0]
    if checks_enabled(k):
        # the entries the keys use must name pages of the pool (one device-to-host copy); an out-of-range
        # index in the gather below would be a device-side assert, not a message
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        cols = torch.arange(block_table.shape[1], device=k.device).view(1, -1)
        used = cols < ((lens + page_size - 1) // page_size).view(-1, 1)
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bool(bad.any()):
            b, col = (int(x) for x in bad.nonzero()[0])
            raise FlashAttnError(f"block_table[{b}, {col}] = {int(block_table[b, col])}; expected a page "
                                 "of the "
                                 f"pool in [0, {num_pages})")
    total_k = int(cu_seqlens_k[-1])
    token = torch.arange(total_k, device=k.device)
    seq = torch.searchsorted(cu_seqlens_k[1:].long(), token, right=True)
    pos = token - cu_seqlens_k.long()[seq]
    page = block_table.long()[seq, pos // page_size]
    slot = pos % page_size
    return k[page, slot], v[page, slot]
