"""`memory`: peak extra memory of forward+backward vs sequence length, up to where naive runs out."""

from __future__ import annotations

from ..case import Grid
from .base import PEAK_MEM, TFLOPS, Suite


def _grid(quick: bool) -> Grid:
    top = 16 if quick else 17  # 64K or 128K
    return Grid(
        dtype="bf16",
        seqlens=tuple(2**e for e in range(10, top + 1, 2 if quick else 1)),
        headdims=(128,),
        causal=(True,),
        batch=1,
        nheads=16,
    )


SUITE = Suite(
    name="memory",
    description="bf16, b=1, h=16, d=128, causal, N 1K..128K, forward+backward: peak memory beyond the inputs",
    grid=_grid,
    providers=("flashattn", "sdpa-flash", "sdpa-cudnn", "naive"),
    modes=("fwd+bwd",),
    device="cuda",
    views=(PEAK_MEM, TFLOPS),
    panel_fields=("headdim",),
)
