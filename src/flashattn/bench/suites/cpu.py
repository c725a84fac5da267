"""`cpu`: a small suite that runs anywhere (the default without a GPU): ours vs naive vs SDPA, fp32 unless
--dtype says otherwise."""

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
    description="the CPU, b=2, h=4, d in {32, 64}, N 128..512, causal and not; fp32 (--dtype bf16 or fp16: "
                "the torch backend's fused route, ATen's CPU kernel, where fp32 stays on its chunked route)",
    grid=_grid,
    providers=("flashattn", "torch-backend", "naive", "sdpa-flash", "sdpa-math"),
    device="cpu",
    views=(MS, TFLOPS),
)
