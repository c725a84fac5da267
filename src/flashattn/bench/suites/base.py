"""What a suite is: a grid of cases, default providers and modes, and how its results are best read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..case import Case, Grid
from ..results import KEY_FIELDS


def fmt_rate(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def fmt_ms(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def fmt_gib(x: float) -> str:
    return f"{x / 2**30:.3g}"


def fmt_gb(x: float) -> str:
    return f"{x / 1e9:.3g}"


@dataclass(frozen=True)
class View:
    """One way of reading the rows: a field, its label and formatting, and which direction is better."""

    metric: str
    label: str
    fmt: Callable[[float], str]
    higher_is_better: bool = True
    log_y: bool = False
    plot: bool = True  # also drawn as a PNG (ms is only tabulated: TFLOP/s shows the same, normalised)
    plot_scale: float = 1.0  # divide the value by this for plots (bytes -> GiB)


TFLOPS = View("tflops", "TFLOP/s", fmt_rate)
MS = View("ms", "ms", fmt_ms, higher_is_better=False, log_y=True, plot=False)
PEAK_MEM = View(
    "peak_mem_bytes", "peak extra memory (GiB)", fmt_gib, higher_is_better=False, log_y=True, plot_scale=2**30
)
# rows measured with `flashattn bench --ncu`: DRAM bytes read + written by one call (Nsight Compute)
DRAM = View("dram_bytes", "DRAM traffic, one call (GB, Nsight Compute)", fmt_gb, higher_is_better=False,
            plot=False)


def no_skip(case: Case, provider: str) -> str | None:
    return None


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    grid: Callable[[bool], Grid]  # quick -> the grid to sweep
    providers: tuple[str, ...]
    modes: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
    # "cuda" suites refuse to start on the CPU unless --device cpu is given (their shapes take hours there)
    device: str | None = None
    views: tuple[View, ...] = (TFLOPS,)
    x_field: str = "seqlen_q"
    panel_fields: tuple[str, ...] = ("headdim", "causal")
    # the provider the ratio lines compare everyone else to
    baseline: str = "flashattn"
    # a reason to not run a provider on a case, reported in the row instead of silently dropping it
    skip: Callable[[Case, str], str | None] = no_skip
    # suites whose cases are not a plain seqlen x headdim grid (decode: kv_len, page_size) replace this
    build_cases: Callable[[Grid], list[Case]] = Grid.cases
    # what identifies a row when runs are merged; suites with extra shape fields (kv_len, ...) extend it
    key_fields: tuple[str, ...] = KEY_FIELDS
    # a suite that is not a sweep of attention calls (e2e trains a model) runs itself: (args, device) -> rc
    run: Callable[..., int] | None = None


DEFAULT = Suite(
    name="",
    description="fallback used to render results of a suite this install does not know",
    grid=lambda quick: Grid("bf16", (), ()),
    providers=(),
)
