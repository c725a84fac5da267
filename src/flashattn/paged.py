"""Paged KV for varlen prefill: `flash_attn_varlen_func(..., block_table=...)`.

With a block table, k and v are page pools (num_pages, page_size, nheads_k, headdim) and the keys of sequence
b are positions [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]) of its pages: position p lives in page
block_table[b, p // page_size], row p % page_size.

Two ways to run one. Where the Gluon forward serves the call and its key tiles each lie in one page
(routes.reads_pages: page_size a multiple of the route's key tile, 16-bit pools), the kernel reads the pages
itself, mapping each key tile through the table. Otherwise (and for calls that need gradients, which flow
back into the pools through the gather) `gather_pages` copies the keys into the packed (total_k, nheads_k,
headdim) layout the varlen kernels read, then the usual varlen path runs: one read and one write of the
attended keys and values besides the kernel's own reads, a small fraction of a long prompt's time. Neither
reads a device value on the host: the packed tensors are sized by a host-side bound (the block table's
capacity per sequence), and every index is clamped into the pool, so a bad table entry reads another page,
never outside the pool. `check_page_entries` (flashattn.config's check_indices) names a bad entry first.
"""

import torch
from torch import Tensor

from flashattn import _validate
from flashattn._validate_cache import check_block_table, checks_enabled
from flashattn.errors import FlashAttnError

_POOL = "(num_pages, page_size, nheads_k, headdim) with a block_table"


def check_paged(q: Tensor, k: Tensor, v: Tensor, block_table: Tensor, batch: int, max_seqlen_k: int,
                fp8: bool = False) -> None:
    """The pools' and the block table's shapes, dtypes and devices; fp8: e4m3 pools (an FP8 call)."""
    check_block_table(block_table, batch, q)
    dtypes = {"dtypes": _validate.FP8_DTYPES} if fp8 else {}
    _validate.check_tensor("k", k, 4, _POOL, **dtypes)
    _validate.check_tensor("v", v, 4, _POOL, **dtypes)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; they must share a device")
    if v.shape[:3] != k.shape[:3]:
        raise FlashAttnError(f"v has shape {tuple(v.shape)} but k {tuple(k.shape)}; their page pools must "
                             f"match in (num_pages, page_size, nheads_k)")
    capacity = block_table.shape[1] * k.shape[1]
    if max_seqlen_k > capacity:
        raise FlashAttnError(f"max_seqlen_k is {max_seqlen_k} but block_table holds {block_table.shape[1]} "
                             f"pages of {k.shape[1]} keys = {capacity}; expected max_seqlen_k <= max_pages * "
                             f"page_size")


def check_page_entries(k: Tensor, block_table: Tensor, cu_seqlens_k: Tensor) -> None:
    """Where flashattn.config's check_indices is on (one device-to-host copy): every block-table entry a
    sequence uses (its first ceil(length / page_size) columns) names a page of the pool."""
    if not checks_enabled(k):
        return
    page_size, num_pages = k.shape[1], k.shape[0]
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    cols = torch.arange(block_table.shape[1], device=k.device).view(1, -1)
    used = cols < ((lens + page_size - 1) // page_size).view(-1, 1)
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, col = (int(x) for x in bad.nonzero()[0])
        raise FlashAttnError(f"block_table[{b}, {col}] = {int(block_table[b, col])}; expected a page "
                             f"of the pool in [0, {num_pages})")


def gather_pages(k: Tensor, v: Tensor, block_table: Tensor, cu_seqlens_k: Tensor,
                 max_seqlen_k: int | None = None) -> tuple[Tensor, Tensor]:
    """(k, v) packed (batch · max_seqlen_k, nheads_k, headdim[_v]) from the page pools: sequence b's keys at
    rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]), zeros past cu_seqlens_k[-1] (no sequence's rows).

    The packed size is a bound known on the host (max_seqlen_k, default the block table's capacity
    max_pages · page_size), not cu_seqlens_k[-1]: reading that would synchronise with the device. Every index
    the gather derives from cu_seqlens_k and block_table is clamped into the pool, so bad values give wrong
    keys, never an index error. Differentiable: gradients reach the pools.
    """
    page_size, num_pages = k.shape[1], k.shape[0]
    batch, max_pages = block_table.shape
    rows = batch * (max_pages * page_size if max_seqlen_k is None else max_seqlen_k)
    token = torch.arange(rows, device=k.device)
    cu = cu_seqlens_k.long()
    seq = torch.searchsorted(cu[1:], token, right=True).clamp_(max=batch - 1)
    pos = token - cu[seq]
    page = block_table.long()[seq, (pos // page_size).clamp_(0, max_pages - 1)].clamp_(0, num_pages - 1)
    slot = pos % page_size
    # rows past the last sequence read a clamped slot: zero them, so that no gradient flows back through them
    keep = (token < cu[-1]).view(-1, 1, 1)
    return torch.where(keep, k[page, slot], 0), torch.where(keep, v[page, slot], 0)
