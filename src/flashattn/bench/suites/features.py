"""`features`: the feature workloads: packed variable-length batches and sliding windows.

varlen: 16K tokens packed as sequences of mixed lengths (a fixed random draw, 128..8K) against the same
tokens as equal-length batches (b=4 N=4K, b=2 N=8K); causal and not. Target: varlen TFLOP/s at least 0.90x
the equal-length batch nearest the packed mean length.
window: left = right = 1024 at N = 16K against full attention at the same shape, non-causal. Target:
forward+backward at least 6x faster than full.

TFLOP/s count only the pairs that take part: per-sequence pairs for packed batches (half the square when
causal, as train does), the exact band for windows. Each row also carries `feature`, `window_left`,
`window_right`, `lengths` (null unless packed) and `tokens`; `target_ratio` / `target` / `meets_target`
compare the rows of a feature with their baseline (see `annotate`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from ..case import Case, Grid, canonical_dtype
from ..providers.features import VARLEN_PROVIDERS, WINDOW_PROVIDERS
from ..results import KEY_FIELDS
from .base import MS, TFLOPS, Suite, View, fmt_rate

TOKENS = 16384
WINDOW = 1024
# fixed, so every run and every GPU times the same packing; this seed draws (394, 4808, 3641, 7541) at 16K:
# mean exactly 4K (the b=4 baseline), one short sequence, and no length a multiple of the kernels' tiles
LENGTHS_SEED = 10
VARLEN_TARGET = 0.90
WINDOW_TARGET = 6.0
WINDOW_TARGET_MODE = "fwd+bwd"
# the equal-length batches of the same tokens: b=4 N=T/4 and b=2 N=T/2
EQUAL_BATCHES = (4, 2)


def packed_lengths(tokens: int, seed: int = LENGTHS_SEED) -> tuple[int, ...]:
    """Sequence lengths in [tokens/128, tokens/2] (128..8K at 16K tokens) summing to exactly `tokens`.

    Lengths are drawn uniformly (mean near tokens/4, so about four sequences at 16K), the last one takes the
    remainder, then the order is shuffled so that the remainder is not always last.
    """
    lo = max(1, tokens // 128)
    hi = max(2 * lo, tokens // 2)
    if tokens < lo:
        raise ValueError(f"cannot pack {tokens} tokens")
    rng = random.Random(seed)
    lengths, left = [], tokens
    # left >= lo holds throughout: every draw leaves at least lo, and hi >= 2 lo keeps the range non-empty
    while left > hi:
        n = rng.randint(lo, min(hi, left - lo))
        lengths.append(n)
        left -= n
    lengths.append(left)
    rng.shuffle(lengths)
    return tuple(lengths)


def window_for(seqlen: int) -> int:
    """1024 at the target's 16K; small overrides (CPU smoke runs) keep a band narrower than the sequence."""
    return min(WINDOW, max(1, seqlen // 16))


@dataclass(frozen=True)
class FeatureGrid(Grid):
    """The train-style grid plus what shapes the features: `seqlens` are the window cases' N, `tokens` the
    varlen budget (and batch = tokens // N of the window cases); `quick` keeps one packed case, causal, and
    one equal-length batch."""

    quick: bool = False


def _grid(quick: bool) -> FeatureGrid:
    return FeatureGrid(
        dtype="bf16",
        seqlens=(TOKENS,),
        headdims=(128,),
        causal=(False, True),
        tokens=TOKENS,
        nheads=16,
        quick=quick,
    )


def _extra(feature: str, tokens: int, window=(-1, -1), lengths=None) -> dict:
    return {
        "feature": feature,
        "window_left": window[0],
        "window_right": window[1],
        "lengths": None if lengths is None else list(lengths),
        "tokens": tokens,
    }


def nearest_equal(tokens: int, lengths: tuple[int, ...], seqlens: tuple[int, ...]) -> int:
    """The equal length closest (on a log scale) to the packed mean: the varlen target's baseline."""
    mean = tokens / len(lengths)
    return min(seqlens, key=lambda n: (abs(math.log(n / mean)), n))


def build_cases(grid: Grid) -> list[Case]:
    dtype = canonical_dtype(grid.dtype)
    tokens = grid.tokens if grid.tokens is not None else grid.batch * max(grid.seqlens)
    lengths = packed_lengths(tokens)
    equal = tuple(tokens // b for b in EQUAL_BATCHES if tokens // b >= 1)
    varlen_causal = grid.causal
    if getattr(grid, "quick", False):
        # flex compiles dominate the run: one packed case (causal, as training packs) and its one baseline
        equal = (nearest_equal(tokens, lengths, equal),)
        varlen_causal = (True,) if True in grid.causal else grid.causal
    # the target is non-causal; a grid asking for causal only gets the causal sliding window (left, 0)
    window_causal = (False,) if False in grid.causal else (True,)
    out = []
    for d in grid.headdims:
        h = grid.nheads if grid.nheads is not None else max(1, grid.hidden // d)
        hk = grid.nheads_k if grid.nheads_k is not None else h
        for causal in varlen_causal:
            packed = _extra("varlen", tokens, lengths=lengths)
            out.append(Case(1, h, hk, tokens, tokens, d, causal, dtype, packed))
            for n in equal:
                out.append(Case(tokens // n, h, hk, n, n, d, causal, dtype, _extra("varlen", tokens)))
        for causal in window_causal:
            for n in grid.seqlens:
                b = grid.batch if grid.batch is not None else max(1, tokens // n)
                w = window_for(n)
                win = (w, 0 if causal else w)
                out.append(Case(b, h, hk, n, n, d, causal, dtype, _extra("window", b * n, window=win)))
                out.append(Case(b, h, hk, n, n, d, causal, dtype, _extra("window", b * n)))
    return out


def applies(case: Case, provider: str) -> bool:
    """Window providers on window cases, varlen ones on packed cases, everyone else on the plain baselines
    (they ignore the masks, so on a masked case they would only be reported wrong)."""
    if case.lengths is not None:
        return provider in VARLEN_PROVIDERS
    if case.window != (-1, -1):
        return provider in WINDOW_PROVIDERS
    return provider not in VARLEN_PROVIDERS + WINDOW_PROVIDERS


_SAME = ("mode", "dtype", "nheads", "nheads_k", "headdim", "causal", "tokens")


def annotate(rows: list[dict]) -> None:
    """`target_ratio` on every packed and windowed row, against `flashattn` on the plain baseline:

    - packed: its TFLOP/s over flashattn's on the equal-length batch nearest the packed mean (target 0.90);
    - window: flashattn's full-attention ms over its ms at the same shape, a speedup (target 6x, fwd+bwd).
    `meets_target` is set on the rows the targets are about (flashattn-varlen; flashattn-window fwd+bwd).
    """
    base = {}
    for r in rows:
        if r.get("provider") == "flashattn" and r.get("lengths") is None and r.get("window_left", -1) == -1:
            base.setdefault(r.get("feature"), []).append(r)
    for r in rows:
        for f in ("target_ratio", "target", "meets_target"):
            r.pop(f, None)
        if r.get("feature") == "varlen" and r.get("lengths"):
            _annotate_varlen(r, base.get("varlen", []))
        elif r.get("feature") == "window" and r.get("window_left", -1) != -1:
            _annotate_window(r, base.get("window", []))


def _match(row: dict, candidates: list[dict], more: Callable[[dict], bool]) -> dict | None:
    for c in candidates:
        if all(c.get(f) == row.get(f) for f in _SAME) and more(c) and not c.get("error"):
            return c
    return None


def _annotate_varlen(row: dict, candidates: list[dict]) -> None:
    lengths = tuple(row["lengths"])
    seqlens = tuple(sorted({c["seqlen_q"] for c in candidates if all(c.get(f) == row.get(f) for f in _SAME)}))
    if not seqlens:
        return
    n = nearest_equal(row["tokens"], lengths, seqlens)
    ref = _match(row, candidates, lambda c: c["seqlen_q"] == n)
    row["target"] = f"TFLOP/s / flashattn's at b={row['tokens'] // n} N={n}; target >= {VARLEN_TARGET:.2f}"
    if ref is None or not row.get("tflops") or not ref.get("tflops"):
        return
    row["target_ratio"] = row["tflops"] / ref["tflops"]
    if row["provider"] == "flashattn-varlen":
        row["meets_target"] = row["target_ratio"] >= VARLEN_TARGET


def _annotate_window(row: dict, candidates: list[dict]) -> None:
    ref = _match(row, candidates, lambda c: (c["batch"], c["seqlen_q"]) == (row["batch"], row["seqlen_q"]))
    row["target"] = (
        f"speedup over flashattn's full attention at the same shape; target >= {WINDOW_TARGET:g}x "
        f"({WINDOW_TARGET_MODE})"
    )
    if ref is None or not row.get("ms") or not ref.get("ms"):
        return
    row["target_ratio"] = ref["ms"] / row["ms"]
    if row["provider"] == "flashattn-window" and row["mode"] == WINDOW_TARGET_MODE:
        row["meets_target"] = row["target_ratio"] >= WINDOW_TARGET


@dataclass(frozen=True)
class FeatureSuite(Suite):
    """A Suite whose cases are not all for every provider (`applies`, read by the runner) and whose rows
    are compared with each other once measured (`annotate`, run on every save)."""

    applies: Callable[[Case, str], bool] = lambda case, provider: True
    annotate: Callable[[list[dict]], None] = lambda rows: None


TARGET = View(
    "target_ratio",
    "vs baseline (varlen: TFLOP/s / equal lengths, target 0.90; window: speedup over full, target 6 fwd+bwd)",
    lambda x: f"{x:.2f}",
    plot=False,
)

_LENGTHS = packed_lengths(TOKENS)

SUITE = FeatureSuite(
    name="features",
    description=(
        f"feature workloads (defaults), bf16, h=16, d=128. varlen: {TOKENS} tokens packed as lengths "
        f"{list(_LENGTHS)} (seed {LENGTHS_SEED}) vs equal lengths b=4 N=4K and b=2 N=8K, causal and not; "
        f"window: left = right = {WINDOW} vs full at b=1 N=16K, non-causal. TFLOP/s count visible pairs "
        "only: per sequence when packed (half when causal), the band for windows"
    ),
    grid=_grid,
    providers=("flashattn-varlen", "flashattn", "flex-document", "flashattn-window", "flex-window"),
    device="cuda",
    views=(
        TARGET,
        View(TFLOPS.metric, TFLOPS.label, fmt_rate, plot=False),
        MS,
    ),
    baseline="flashattn-varlen",
    build_cases=build_cases,
    key_fields=(*KEY_FIELDS, "feature", "window_left", "window_right", "tokens"),
    applies=applies,
    annotate=annotate,
)
