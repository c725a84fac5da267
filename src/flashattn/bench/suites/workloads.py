"""`workloads`: the attention calls of today's training recipes, one point each, beside FA4 and SDPA-cuDNN.

Each workload is the shape a training step actually runs, bf16, forward and backward:
- docs: 16K tokens packed as documents, causal, h16 d128: a long-tailed draw (19 documents of 145..3417
  tokens, log-uniform, so most are short while the long ones hold most tokens) and the features suite's
  four-document packing;
- window: sliding windows at b1 N16K h16 d128: (4095, 0) and (1023, 0) causal, (1024, 1024) not;
- softcap: 50 (Gemma-2 style), causal 8K b2, d128 h16 and d256 h8;
- sink: a learnable per-head sink (gpt-oss style), d64 h32 causal 8K b2, alone and with a (128, 0) window;
- gqa: 32 query heads on 8 and on 1 (MQA) kv heads, d128 causal 8K b2;
- d256: b2 h8 8K, full and causal;
- dv: d_qk 192 / d_v 128 (DeepSeek's prefill), causal 8K b2 h16.
Ours (`flashattn`) and FA4 (`fa4`) take every option the case carries (varlen for documents); SDPA has no
varlen, window, softcap or sink argument, so `sdpa-cudnn` runs the GQA, d256 and dv workloads and the others
are skipped with that reason. Every provider is checked against the float64 oracle with the same options
before it is timed (softcap 50 moves unit-variance scores by less than bf16 rounds them, so in bf16 that
check vouches for the output, not for the cap: the CPU tests show a dropped cap failing in fp32). TFLOP/s
count visible pairs only (per document, the exact band of a window) at 2·pairs·(d + dv) forward, 2.5x
backward; `flashattn_speedup` is a provider's time over ours at the same workload and mode (above 1: ours
is faster).

Rows carry `workload` (its name), `window_left`, `window_right`, `lengths` (null unless packed), `softcap`,
`sink` and `headdim_v`. No sweep: one point per workload, so flashattn and sdpa-cudnn take under two
minutes on an H200, compiles included (FA4's compiles come on top). `--seqlens` (the 8K workloads' N) and
`--tokens` (the 16K ones') shrink it, windows in proportion, for smoke runs; `--quick` keeps the first
workload of each kind.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..case import Case, Grid, canonical_dtype
from ..results import KEY_FIELDS
from .base import MS, TFLOPS, View, fmt_rate
from .features import FeatureSuite, packed_lengths

TOKENS = 16384  # the packed and windowed workloads: b=1, N = TOKENS
SEQLEN = 8192  # the rest: b=2 at N = SEQLEN
SOFTCAP = 50.0
# the long-tailed draw: fixed, so every run and every GPU times the same packing; this seed gives 19
# documents of 145..3417 tokens at 16K, ten of them under 500
LONGTAIL_SEED = 7
# no document fills a whole tile of the kernels (64 or 128 rows): every one has a ragged last tile
TILE = 64
BASELINE = "flashattn"
# the providers that take every option of a case (window, packing, softcap, sink); the others run only the
# workloads that are plain attention apart from GQA and head dims
FULL_OPTIONS = (BASELINE, "fa4", "torch-backend", "flashattn-triton-bwd", "flashattn-baseline")
_NHEADS = 16  # nominal, for Grid: the heads of each workload are its own


def longtail_lengths(tokens: int, seed: int = LONGTAIL_SEED) -> tuple[int, ...]:
    """Document lengths in [tokens/128, tokens/4] (128..4K at 16K tokens) summing to exactly `tokens`.

    Log-uniform: as many documents of 128..256 tokens as of 2K..4K, the long-tailed mix of a pretraining
    corpus. The last document takes the remainder; where that is a multiple of TILE a token moves between
    it and another one, then the order is shuffled so that the remainder is not always last.
    """
    lo = max(1, tokens // 128)
    hi = max(2 * lo, tokens // 4)
    rng = random.Random(seed)
    lengths, left = [], tokens
    # left - lo >= hi - lo + 1 > lo throughout, so each draw has at least two lengths to land on
    while left > hi:
        top = min(hi, left - lo)
        n = min(top, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(top + 1))))))
        if n % TILE:
            lengths.append(n)
            left -= n
    lengths.append(left)
    if left % TILE == 0 and len(lengths) > 1:
        step = 1 if left < hi else -1
        donors = [i for i, n in enumerate(lengths[:-1]) if (n - step) % TILE and lo <= n - step <= hi]
        if donors:
            lengths[donors[0]] -= step
            lengths[-1] += step
    rng.shuffle(lengths)
    return tuple(lengths)


def scaled(width: int, n: int, base: int) -> int:
    """A window of `width` at the workload's own N = base, kept in proportion at a smaller N (smoke runs):
    (4095, 0) at 16K is (63, 0) at 256."""
    return width if n == base else max(1, width * n // base)


@dataclass(frozen=True)
class WorkloadGrid(Grid):
    """The workloads' sizes: `seqlens` the N of the b=2 workloads (8K), `tokens` the packed and windowed
    ones' (16K); `quick` keeps the first workload of each kind. Heads, head dims and batch are each
    workload's own: the grid's nheads is nominal, and overriding them is refused."""

    quick: bool = False


def _grid(quick: bool) -> WorkloadGrid:
    return WorkloadGrid(
        dtype="bf16",
        seqlens=(SEQLEN,),
        headdims=(),
        causal=(False, True),
        tokens=TOKENS,
        nheads=_NHEADS,
        quick=quick,
    )


def _case(kind: str, name: str, b: int, h: int, hk: int, n: int, d: int, causal: bool, dtype: str, *,
          window=(-1, -1), lengths=None, softcap=0.0, sink=False, headdim_v=None) -> tuple[str, Case]:
    extra = {
        "workload": name,
        "window_left": window[0],
        "window_right": window[1],
        "lengths": None if lengths is None else list(lengths),
        "softcap": softcap,
        "sink": sink,
        "headdim_v": headdim_v or d,
    }
    return kind, Case(b, h, hk, n, n, d, causal, dtype, extra)


def _check_overrides(grid: Grid) -> None:
    if (grid.headdims or grid.batch is not None or grid.tokens is None or grid.nheads != _NHEADS
            or grid.hidden is not None or grid.nheads_k is not None):
        raise ValueError(
            "the workloads suite fixes batch, heads and head dims per workload; only --seqlens (the 8K "
            "workloads' N), --tokens (the 16K ones'), --causal and --dtype change it"
        )


def workload_cases(grid: Grid) -> list[tuple[str, Case]]:
    """(kind, case) for every workload, in the order of the module docstring."""
    _check_overrides(grid)
    dt = canonical_dtype(grid.dtype)
    t = grid.tokens
    out = [
        _case("docs", "docs-longtail", 1, 16, 16, t, 128, True, dt, lengths=longtail_lengths(t)),
        _case("docs", "docs-4", 1, 16, 16, t, 128, True, dt, lengths=packed_lengths(t)),
    ]
    for left, right, causal in ((4095, 0, True), (1023, 0, True), (1024, 1024, False)):
        w = (scaled(left, t, TOKENS), scaled(right, t, TOKENS) if right else 0)
        out.append(_case("window", f"window-{w[0]}-{w[1]}", 1, 16, 16, t, 128, causal, dt, window=w))
    for n in grid.seqlens:
        for d, h in ((128, 16), (256, 8)):
            out.append(_case("softcap", f"softcap-d{d}", 2, h, h, n, d, True, dt, softcap=SOFTCAP))
        w = (scaled(128, n, SEQLEN), 0)
        out.append(_case("sink", "sink", 2, 32, 32, n, 64, True, dt, sink=True))
        out.append(_case("sink", f"sink-window-{w[0]}", 2, 32, 32, n, 64, True, dt, window=w, sink=True))
        out.append(_case("gqa", "gqa-32-8", 2, 32, 8, n, 128, True, dt))
        out.append(_case("gqa", "mqa-32-1", 2, 32, 1, n, 128, True, dt))
        for causal in (False, True):
            out.append(_case("d256", f"d256-{'causal' if causal else 'full'}", 2, 8, 8, n, 256, causal, dt))
        out.append(_case("dv", "d192-dv128", 2, 16, 16, n, 192, True, dt, headdim_v=128))
    return out


def build_cases(grid: Grid) -> list[Case]:
    cases = [(kind, case) for kind, case in workload_cases(grid) if case.causal in grid.causal]
    if getattr(grid, "quick", False):
        first: dict[str, Case] = {}
        for kind, case in cases:
            first.setdefault(kind, case)
        return list(first.values())
    return [case for _, case in cases]


def missing_options(case: Case) -> list[str]:
    """What a case asks for beyond plain (causal, GQA) attention with any head dims."""
    wanted = (
        ("packed documents (varlen)", case.lengths is not None),
        ("a sliding window", case.window != (-1, -1)),
        ("softcap", case.softcap > 0),
        ("a learnable sink", case.has_sink),
    )
    return [what for what, asked in wanted if asked]


def skip(case: Case, provider: str) -> str | None:
    """Providers without the options (SDPA, flex, naive, the routed A/B providers) would time, and fail the
    check on, attention without them: they are skipped on those workloads, saying what they lack."""
    missing = [] if provider in FULL_OPTIONS else missing_options(case)
    if missing:
        return f"skipped: {provider} has no argument for {' or '.join(missing)}"
    return None


SPEEDUP_FIELD = "flashattn_speedup"
_GROUP = tuple(f for f in (*KEY_FIELDS, "workload") if f not in ("suite", "provider"))


def annotate(rows: list[dict]) -> None:
    """`flashattn_speedup` on every other provider's measured row: its ms over flashattn's at the same
    workload, shape and mode, i.e. flashattn's TFLOP/s over its (the FLOPs are counted alike)."""
    ours = {
        tuple(r.get(f) for f in _GROUP): r
        for r in rows
        if r.get("provider") == BASELINE and r.get("ms") and not r.get("error")
    }
    for r in rows:
        r.pop(SPEEDUP_FIELD, None)
        if r.get("provider") == BASELINE or r.get("error") or not r.get("ms"):
            continue
        base = ours.get(tuple(r.get(f) for f in _GROUP))
        if base is not None:
            r[SPEEDUP_FIELD] = r["ms"] / base["ms"]


SPEEDUP = View(
    SPEEDUP_FIELD,
    "flashattn speedup: this provider's time / flashattn's (above 1: flashattn faster)",
    lambda x: f"{x:.2f}",
    plot=False,
)

_LONGTAIL = longtail_lengths(TOKENS)

SUITE = FeatureSuite(
    name="workloads",
    description=(
        f"training workloads, one point each, bf16, beside FA4 and SDPA-cuDNN. Packed documents, {TOKENS} "
        f"tokens causal h16 d128: {len(_LONGTAIL)} long-tailed ({min(_LONGTAIL)}..{max(_LONGTAIL)}, seed "
        f"{LONGTAIL_SEED}) and {list(packed_lengths(TOKENS))}. Windows (4095, 0), (1023, 0) causal and "
        "(1024, 1024) at b1 N16K h16 d128. At 8K b2, causal unless said: softcap 50 (d128 h16, d256 h8); a "
        "learnable sink, d64 h32, alone and with window (128, 0); GQA 32/8 and MQA 32/1 d128; d256 h8 full "
        "and causal; d192/dv128 h16. TFLOP/s count visible pairs, 2·pairs·(d + dv) forward; SDPA has no "
        "varlen, window, softcap or sink argument, so it runs GQA, d256 and dv only"
    ),
    grid=_grid,
    providers=(BASELINE, "fa4", "sdpa-cudnn"),
    modes=("fwd", "bwd"),
    device="cuda",
    views=(View(TFLOPS.metric, TFLOPS.label, fmt_rate, plot=False), SPEEDUP, MS),
    skip=skip,
    build_cases=build_cases,
    key_fields=(*KEY_FIELDS, "workload"),
    annotate=annotate,
)
