"""Providers for the `features` suite: the same attention under a sliding window or over packed sequences.

`flashattn-window` / `flashattn-varlen` call this project's public API with the case's window and packing;
`flex-window` / `flex-document` express the same masks as a flex_attention BlockMask. All four read the mask
from the case (`case.window`, `case.lengths`), so any combination of the two is timed and checked alike.
"""

from __future__ import annotations

import itertools

import torch

from ..case import Case
from .base import Prepared, Provider, first_tensor, make_leaves
from .flex import _compiled_flex


def cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _require_packed(case: Case) -> tuple[int, ...]:
    lengths = case.lengths
    if lengths is None:
        raise ValueError("this provider times packed sequences; the case has no lengths")
    total = sum(lengths)
    if case.batch != 1 or case.seqlen_q != total or case.seqlen_k != total:
        raise ValueError(
            f"packed sequences come as batch 1 of sum(lengths) = {total} tokens; got b={case.batch}, "
            f"sq={case.seqlen_q}, sk={case.seqlen_k}"
        )
    return lengths


def _setup_flashattn_window(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    import flashattn

    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    window = case.window
    return Prepared(
        fwd=lambda: first_tensor(
            flashattn.flash_attn_func(qb, kb, vb, causal=case.causal, window_size=window)
        ),
        leaves=leaves,
    )


def _setup_flashattn_varlen(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    import flashattn

    lengths = _require_packed(case)
    cu = cu_seqlens(lengths, q.device)
    longest = max(lengths)
    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    window = case.window

    def fwd() -> torch.Tensor:
        # the (1, total, h, d) leaves indexed to (total, h, d): views, so the timed call copies nothing
        out = flashattn.flash_attn_varlen_func(
            qb[0], kb[0], vb[0], cu, cu, longest, longest, causal=case.causal, window_size=window
        )
        return first_tensor(out).unsqueeze(0)

    return Prepared(fwd=fwd, leaves=leaves)


def mask_mod_for(case: Case, device: torch.device):
    """flex_attention mask_mod of the case's mask (packing, window, causal), or None for full attention."""
    from torch.nn.attention.flex_attention import and_masks

    left, right = case.window
    if case.causal:
        right = 0
    parts = []
    if case.lengths is not None:
        doc = torch.repeat_interleave(
            torch.arange(len(case.lengths), device=device), torch.tensor(case.lengths, device=device)
        )
        # packed sequences share offsets in q and k, so within a sequence the diagonal is q_idx itself
        offset = 0

        def same_doc(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        parts.append(same_doc)
    else:
        offset = case.seqlen_k - case.seqlen_q  # bottom-right, as flash_attn aligns
    if right >= 0:

        def not_after(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset + right

        parts.append(not_after)
    if left >= 0:

        def not_before(b, h, q_idx, kv_idx):
            return kv_idx >= q_idx + offset - left

        parts.append(not_before)
    return and_masks(*parts) if parts else None


def _setup_flex_masked(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if case.lengths is not None:
        _require_packed(case)
    mask_mod = mask_mod_for(case, q.device)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, case.seqlen_q, case.seqlen_k, device=q.device)
    # on the CPU (smoke tests only) eager flex is enough and skips an inductor C++ build per shape
    flex = _compiled_flex() if q.device.type == "cuda" else flex_attention
    leaves = make_leaves(q, k, v, "bhsd")
    qh, kh, vh = leaves
    gqa = case.nheads != case.nheads_k
    return Prepared(
        fwd=lambda: flex(qh, kh, vh, block_mask=block_mask, enable_gqa=gqa), leaves=leaves, layout="bhsd"
    )


WINDOW_PROVIDERS = ("flashattn-window", "flex-window")
VARLEN_PROVIDERS = ("flashattn-varlen", "flex-document", "flashattn-paged", "flashattn-paged-gather")

PROVIDERS = [
    Provider(
        "flashattn-window",
        _setup_flashattn_window,
        "this project: flashattn.flash_attn_func with the case's window_size",
    ),
    Provider(
        "flashattn-varlen",
        _setup_flashattn_varlen,
        "this project: flashattn.flash_attn_varlen_func over the packed sequences (one cu_seqlens for q, k)",
    ),
    Provider(
        "flex-window",
        _setup_flex_masked,
        "torch.compile(flex_attention), sliding-window mask_mod: the BlockMask skips blocks outside the band",
    ),
    Provider(
        "flex-document",
        _setup_flex_masked,
        "torch.compile(flex_attention) over the packed tokens as one sequence, document-mask BlockMask",
    ),
]
