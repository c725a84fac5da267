"""`sparse`: block-sparse attention against this project's dense kernel and flex with the same mask.

bf16, b=1, h=16, d=128, N = 16K and 64K (--quick: 8K). Per N: dense, causal, then local + global (the
FlashAttention paper's block-sparse setting; 64K fwd+bwd is its Path-256 row) and per-head random block
masks, each at block densities 50%, 20%, 10%, 5%. Local + global: N/256 global tokens (whole tiles), the
symmetric window chosen so that the 128x128 block density is the closest to the target; random: every head
its own draw with the diagonal kept. Rows carry `pattern`, `target_density`, `density` (the mask's real
block density), `element_density`, `window`, `global_tokens`, and after the run `speedup_vs_dense`: the
dense kernel's time (`flashattn`, pattern dense, same N and mode) over the row's. TFLOP/s count the visible
(query, key) pairs exactly. The dense kernel runs the dense and causal rows only (it cannot express the
others).

The check before timing compares every provider with the dense-mask fp64 oracle
(flashattn.reference) on the usual slice: batch 0, the first heads, blocks of the first and last
rows with every key, the mask rows cut from the BlockMask. The runner takes this suite's `oracle` in place of
the dense one and calls its `annotate` on the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..case import Case, Grid, canonical_dtype
from ..check import Oracle
from ..flops import MODE_FACTOR
from ..providers.sparse import BLOCK, MaskSpec, block_mask
from ..results import KEY_FIELDS
from .base import MS, PEAK_MEM, Suite, View

DENSITIES = (0.5, 0.2, 0.1, 0.05)


@dataclass(frozen=True)
class SparseGrid(Grid):
    densities: tuple[float, ...] = DENSITIES


def _grid(quick: bool) -> SparseGrid:
    return SparseGrid(
        dtype="bf16",
        seqlens=(8192,) if quick else (16384, 65536),
        headdims=(128,),
        causal=(False,),
        batch=1,
        nheads=16,
        densities=(0.5, 0.1) if quick else DENSITIES,
    )


def _local_global_density(n: int, window: int, global_tokens: int, block: int) -> float:
    """Block density of local_global(n, window, global_tokens) from the block corners (exact for tiles)."""
    nb = -(-n // block)
    r0 = torch.arange(nb).view(-1, 1) * block
    r1 = torch.clamp(r0 + block, max=n) - 1
    c0 = torch.arange(nb).view(1, -1) * block
    c1 = torch.clamp(c0 + block, max=n) - 1
    band = (c1 >= r0 - window) & (c0 <= r1 + window)
    hit = band | (c0 < global_tokens) | (r0 < global_tokens)
    return float(hit.float().mean())


def local_global_params(n: int, target: float, block: int = BLOCK) -> tuple[int, int]:
    """(window, global_tokens) whose block density is closest to target: N/256 global tokens rounded up to
    whole blocks (a block of global queries that ended mid-tile would make that block row partial on every
    key block: slow, and the padded part_bits as big as a dense bitmask), and the window found by
    bisection (density grows with it) in steps of 16."""
    g = -(-max(1, n // 256) // block) * block
    lo, hi = 0, n // 16
    while lo < hi:
        mid = (lo + hi) // 2
        if _local_global_density(n, 16 * mid, g, block) < target:
            lo = mid + 1
        else:
            hi = mid
    best = min({max(0, lo - 1), lo}, key=lambda w: abs(_local_global_density(n, 16 * w, g, block) - target))
    return 16 * best, g


def _case(n: int, h: int, d: int, dtype: str, batch: int, pattern: str, target: float, **params) -> Case:
    extra = {"pattern": pattern, "target_density": target, "block": BLOCK, "window": -1, "global_tokens": 0,
             "seed": 0, **params}
    case = Case(batch, h, h, n, n, d, pattern == "causal", dtype, extra)
    mask = block_mask(MaskSpec.of(case), torch.device("cpu"))
    extra["density"] = round(mask.density(), 4)
    extra["element_density"] = mask.density("element")
    return case


def build_cases(grid: Grid) -> list[Case]:
    dtype = canonical_dtype(grid.dtype)
    densities = getattr(grid, "densities", DENSITIES)
    out = []
    for d in grid.headdims:
        h = grid.nheads if grid.nheads is not None else max(1, grid.hidden // d)
        for n in grid.seqlens:
            b = grid.batch if grid.batch is not None else max(1, grid.tokens // n)
            out.append(_case(n, h, d, dtype, b, "dense", 1.0))
            out.append(_case(n, h, d, dtype, b, "causal", 0.5))
            for t in densities:
                w, g = local_global_params(n, t)
                out.append(_case(n, h, d, dtype, b, "local_global", t, window=w, global_tokens=g))
            for i, t in enumerate(densities):
                out.append(_case(n, h, d, dtype, b, "random", t, seed=1000 * i + n % 997))
    return out


def _skip(case: Case, provider: str) -> str | None:
    pattern = case.extra.get("pattern")
    if provider == "flashattn" and pattern not in ("dense", "causal"):
        return ("skipped: the dense kernel cannot express this mask; speedup_vs_dense compares with its time "
                "on the dense row of the same N")
    return None


class SparseOracle(Oracle):
    """The runner's Oracle with the dense-mask reference: each checked row block gets its rows of the mask
    (BlockMask.to_dense(rows=...)) and every key; fp64 for the reference, the input dtype for the
    yardstick."""

    def _run(self, fn, q, k, v, dout, dtype):
        from flashattn.reference import masked_attention_ref

        del fn  # the dense oracle's function; this one is decided by dtype
        s, case = self.slice, self.case
        mask = block_mask(MaskSpec.of(case), q.device)
        sub = [x[:1, :, : (s.heads_q if i in (0, 3) else s.heads_k)] for i, x in enumerate((q, k, v, dout))]
        outs, dqs = [], []
        dk = torch.zeros(sub[1].shape, dtype=torch.float64, device=q.device)
        dv = torch.zeros_like(dk)
        kb = sub[1].to(dtype).requires_grad_(self.grads)
        vb = sub[2].to(dtype).requires_grad_(self.grads)
        for r0, r1 in s.row_blocks:
            rows = mask.to_dense(rows=(r0, r1))[:1, : s.heads_q]  # (1, 1|heads_q, r1 - r0, sk)
            qb = sub[0][:, r0:r1].to(dtype).requires_grad_(self.grads)
            with torch.enable_grad():
                ob, _ = masked_attention_ref(qb, kb, vb, rows, upcast=dtype == torch.float64)
            outs.append(ob.detach().double())
            if self.grads:
                gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), sub[3][:, r0:r1].to(ob.dtype))
                dqs.append(gq.double())
                dk += gk.double()
                dv += gv.double()
        grads = [torch.cat(dqs, dim=1), dk, dv] if self.grads else []
        return torch.cat(outs, dim=1), grads


_SAME = ("mode", "dtype", "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "headdim")


def annotate(rows: list[dict]) -> None:
    """speedup_vs_dense (the dense kernel's ms on the dense row over the row's ms) and TFLOP/s of the
    visible pairs (element_density · sq · sk) on every measured row."""
    dense = {tuple(r.get(f) for f in _SAME): r for r in rows
             if r.get("provider") == "flashattn" and r.get("pattern") == "dense" and r.get("ms")}
    for r in rows:
        r.pop("speedup_vs_dense", None)
        if not r.get("ms") or r.get("error"):
            continue
        base = dense.get(tuple(r.get(f) for f in _SAME))
        if base is not None:
            r["speedup_vs_dense"] = base["ms"] / r["ms"]
        if r.get("element_density") is not None and r.get("mode") in MODE_FACTOR:
            pairs = r["element_density"] * r["seqlen_q"] * r["seqlen_k"]
            flops = 4.0 * r["batch"] * r["nheads"] * pairs * r["headdim"] * MODE_FACTOR[r["mode"]]
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12


@dataclass(frozen=True)
class SparseSuite(Suite):
    """A Suite with its own correctness oracle (`oracle`, used by the runner instead of the dense Oracle)
    and rows compared with each other after measuring (`annotate`)."""

    oracle: Callable[..., Oracle] = SparseOracle
    annotate: Callable[[list[dict]], None] = annotate


SPEEDUP = View("speedup_vs_dense", "speedup vs the dense kernel (dense row's ms / ms)", lambda x: f"{x:.2f}")

SUITE = SparseSuite(
    name="sparse",
    description=(
        "block-sparse attention, bf16, b=1, h=16, d=128, N 16K and 64K: dense, causal, local+global and "
        "per-head random block masks at block densities 50/20/10/5% (128x128 tiles); flashattn-sparse vs the "
        "dense kernel (flashattn) vs flex with the same mask"
    ),
    grid=_grid,
    providers=("flashattn-sparse", "flashattn", "flex-sparse"),
    modes=("fwd", "fwd+bwd"),
    device="cuda",
    views=(MS, SPEEDUP, PEAK_MEM),
    x_field="target_density",
    panel_fields=("pattern", "seqlen_q"),
    baseline="flashattn-sparse",
    skip=_skip,
    build_cases=build_cases,
    key_fields=(*KEY_FIELDS, "pattern", "target_density"),
)
