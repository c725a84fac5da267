"""`cpu`: a small fp32 suite that runs anywhere (the default without a GPU): ours vs naive vs SDPA."""

from __future__ import annotations

from ..case import Grid
from .base import MS, TFLOPS, Suite


def _grid(quick: bool) -> Grid:
    return Grid(
        dtype="fp32",
        seqlens=(64, 128) if quick else (128, 256, 512),
        headdims=(32,) if quick else (32, 64),
        causal=(False, True),
        batch=2,
        nheads=4,
    )


SUITE = Suite(
    name="cpu",
    description="fp32 on the CPU, b=2, h=4, d in {32, 64}, N 128..512, causal and not",
    grid=_grid,
    providers=("flashattn", "torch-backend", "naive", "sdpa-flash", "sdpa-math"),
    device="cpu",
    views=(MS, TFLOPS),
)
