"""`train`: the anchors grid, forward/backward TFLOP/s at 16K tokens and hidden size 2048 (FA2/FA3 papers)."""

from __future__ import annotations

from ..case import Case, Grid
from .base import Suite

_NAIVE_MAX_SEQLEN = 8192


def _grid(quick: bool) -> Grid:
    return Grid(
        dtype="bf16",
        seqlens=(1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384),
        headdims=(64, 128) if quick else (64, 128, 256),
        causal=(False, True),
        tokens=16384,
        hidden=2048,
    )


def _skip(case: Case, provider: str) -> str | None:
    if provider == "naive" and case.seqlen_q > _NAIVE_MAX_SEQLEN:
        gib = case.work * 4 / 2**30
        return (
            f"skipped: naive materialises b·h·sq·sk scores ({gib:.0f} GiB per fp32 copy here); "
            f"like the anchors page, it is run up to N={_NAIVE_MAX_SEQLEN} only"
        )
    return None


SUITE = Suite(
    name="train",
    description="bf16, batch = 16384 // N, nheads = 2048 // d, d in {64, 128, 256}, N 1K..16K, causal or not",
    grid=_grid,
    providers=("flashattn", "sdpa-flash", "sdpa-cudnn", "flex", "naive", "sdpa-efficient", "fa4"),
    device="cuda",
    skip=_skip,
)
