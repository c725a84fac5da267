"""`short`: forwards of few query rows against many keys (speculative decoding's verification, multi-token
prediction, small prefill chunks). K and V dominate the bytes, so what counts is how often they are read:
the Gluon forward packs a GQA group's heads into its 128-row query tiles where few rows would leave them
mostly empty (FA3's pack_gqa, routes.gqa_pack; `flashattn-unpacked`: a tile per head, K and V read once per
query head), the split-KV forward (`flashattn-short-split`: the decode kernel, a GQA group's rows packed
into one block) reads them once per KV head, its splits spread over the SMs. `seqlens` are the keys; each
sweeps seqlen_q 1, 4, 16 and 64, batch 1 and 8, GQA 32/8 and MQA 32/1."""

from __future__ import annotations

from ..case import Case, Grid, canonical_dtype
from .base import MS, TFLOPS, Suite

QUERY_ROWS = (1, 4, 16, 64)
BATCHES = (1, 8)
HEADS_K = (8, 1)


def _grid(quick: bool) -> Grid:
    return Grid(dtype="bf16", seqlens=(4096,) if quick else (4096, 32768), headdims=(128,), causal=(True,),
                batch=1, nheads=32)


def build_cases(grid: Grid) -> list[Case]:
    """Every (batch, heads_k, keys, query rows, head dim, causal) of the sweep; the grid's batch and nheads_k
    are replaced by the suite's own."""
    dtype = canonical_dtype(grid.dtype)
    return [Case(b, grid.nheads or 32, hk, sq, sk, d, causal, dtype)
            for b in BATCHES for hk in HEADS_K for sk in grid.seqlens for sq in QUERY_ROWS
            for d in grid.headdims for causal in grid.causal]


SUITE = Suite(
    name="short",
    description=("bf16 forwards of 1-64 query rows against 4K and 32K keys, h32 with 8 or 1 KV heads, d128, "
                 "causal (bottom-right), batch 1 and 8: the split-KV forward beside the default route"),
    grid=_grid,
    providers=("flashattn", "flashattn-short-split", "sdpa-cudnn"),
    modes=("fwd",),
    device="cuda",
    views=(MS, TFLOPS),
    build_cases=build_cases,
)
