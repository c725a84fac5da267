"""`fp8`: the FP8 (e4m3) inference forward beside the bf16 one: its speed, what quantising costs, and its
accuracy by quantisation recipe.

Speed (mode fwd): 16K tokens at hidden 2048 (d64 h32, d128 h16, d256 h8; N 1K..16K with b = 16K / N),
causal and not, the FlashAttention-3 paper's FP8 sweep. Side by side in one process:
- `flashattn-fp8`: per-head descales, V quantised seqlen-contiguous, so the timed call is the attention only
  (the default route: the Gluon FP8 variant from 2K tokens, else the Triton one);
- `flashattn-fp8-rowv`: V in the ordinary layout, read in place (the kernel transposes its tiles in
  registers: that cost);
- `flashattn-fp8-gluon` / `flashattn-fp8-triton`: flashattn-fp8 on the Gluon / the Triton forward's FP8
  variant, its route named (CUDA only);
- `flashattn-fp8+quant` / `flashattn-fp8+rot+quant`: quantize() of q, k, v from bf16 (with the rotation in
  the same passes) inside the timed call: above flashattn's time, quantising costs more than FP8 saves;
- `flashattn` (our bf16 forward, the harness's usual call) and `sdpa-cudnn` (bf16; CUDA only).
TFLOP/s by the FlashAttention convention (4·b·h·sq·sk·d over the visible pairs) for every provider, the
+quant ones included (their quantisation counts as time, not work); `bf16_speedup` is flashattn's time over
the row's. Each FP8 provider is checked before timing against the float64 oracle on the dequantised values of
its own e4m3 inputs, within twice the error of plain PyTorch at FP8's precision plus 1e-3
(check.Fp8Oracle); the bf16 providers against the float64 oracle as in every suite.

Accuracy (mode accuracy, rows beside the sweep): at b1, N = min(4096, the sweep's N), the sweep's d128 point
(h16), causal as the sweep, on N(0, 1) inputs and on inputs with outliers (0.1% of the q, k, v entries x10),
each FP8 recipe — per-tensor, per-head, per-tensor + rotation (incoherent processing), per-head + rotation —
and our bf16 kernel on the same bf16 inputs, all against the float64 oracle on the unquantised inputs: RMSE,
relative L1 (sum|o - ref| / sum|ref|), cosine similarity, and `rmse_gain`, per-tensor FP8's RMSE over the
row's. Target: per-tensor + rotation at least 2x lower RMSE than plain per-tensor on the outlier inputs
(`meets_target` on those rows).

Rows carry `inputs` ("normal" or "outliers") and, from the FP8 providers, `fp8_descale`, `fp8_rotated`,
`fp8_v_layout`, `fp8_quantize_timed`; the accuracy rows the fields of their recipe and no ms or TFLOP/s. The
full run (30 shapes x 7 providers, ~18 kernel variants to compile, the accuracy study) is sized for 3-5
minutes on an H200, an estimate until measured there; `--quick` times d128 at N 4K and 16K. On the CPU:
`--device cpu` with small `--seqlens`, `--headdims`, `--hidden` and `--tokens`, and `--dtype fp16` under
TRITON_INTERPRET=1 (the interpreter rounds to bf16 wrongly); sdpa-cudnn is skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..accuracy import errors, gaussian
from ..case import Case, Grid, torch_dtype
from ..check import FP8_FLOOR
from ..check import REFERENCE as DENSE_REFERENCE
from ..providers.fp8 import TILE_VARIANTS, Recipe, fp8_attention
from ..results import KEY_FIELDS
from .base import MS, TFLOPS, View
from .features import FeatureSuite

if TYPE_CHECKING:
    from ..runner import RunConfig

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (1024, 2048, 4096, 8192, 16384)
HEADDIMS = (64, 128, 256)
BF16 = "flashattn"
OURS = "flashattn-fp8"
PROVIDERS = (OURS, "flashattn-fp8-rowv", "flashattn-fp8-gluon", "flashattn-fp8-triton", "flashattn-fp8+quant",
             "flashattn-fp8+rot+quant", BF16, "sdpa-cudnn")
# the Gluon kernels do not run under the interpreter; the named-route ones are A/B timing of the GPU's routes
CUDA_ONLY = ("sdpa-cudnn", "flashattn-fp8-gluon", "flashattn-fp8-triton",
             *(name for name, _, _ in TILE_VARIANTS))

ACCURACY_MODE = "accuracy"
ACCURACY_SEQLEN = 4096
ACCURACY_HEADDIM = 128
INPUTS = ("normal", "outliers")
# the accuracy study's FP8 recipes (quantised outside any timing; V's layout does not change the result)
ACCURACY_RECIPES = {
    "fp8-tensor": Recipe("tensor"),
    "fp8-head": Recipe("head"),
    "fp8-tensor+rot": Recipe("tensor", rotate=True),
    "fp8-head+rot": Recipe("head", rotate=True),
}
GAIN_BASE = "fp8-tensor"
TARGET_PATH = "fp8-tensor+rot"
TARGET_INPUTS = "outliers"
TARGET_GAIN = 2.0
# what the accuracy rows are measured against, and what the FP8 providers are checked against
ACCURACY_REFERENCE = "flashattn.reference.attention_ref(upcast=True) on the unquantised inputs"
FP8_REFERENCE = ("flashattn.reference.attention_ref_fp8(upcast=True) on their dequantised e4m3 inputs, "
                 f"within 2x attention_ref_fp8(upcast=False)'s error + {FP8_FLOOR:g}")

KEY = (*KEY_FIELDS, "inputs")
SPEEDUP_FIELD = "bf16_speedup"
GAIN_FIELD = "rmse_gain"


def _grid(quick: bool) -> Grid:
    return Grid(
        dtype="bf16",
        seqlens=(4096, 16384) if quick else SEQLENS,
        headdims=(128,) if quick else HEADDIMS,
        causal=(False, True),
        tokens=TOKENS,
        hidden=HIDDEN,
    )


def build_cases(grid: Grid) -> list[Case]:
    """The grid's cases (b = tokens // N, h = hidden // d), on N(0, 1) inputs (the runner's draw)."""
    return [dataclasses.replace(c, extra={"inputs": "normal"}) for c in grid.cases()]


def skip(case: Case, provider: str) -> str | None:
    if provider in CUDA_ONLY and not torch.cuda.is_available():
        return f"skipped: {provider} runs on CUDA devices only"
    return None


def accuracy_cases(cases: list[Case]) -> list[Case]:
    """The accuracy study's shapes for a sweep: b = 1, the sweep's d128 point (else its first head dim) with
    its heads and dtype, N = min(ACCURACY_SEQLEN, that point's longest N), each causal value of the sweep,
    on each kind of INPUTS."""
    if not cases:
        return []
    point = next((c for c in cases if c.headdim == ACCURACY_HEADDIM), cases[0])
    n = min(ACCURACY_SEQLEN, max(c.seqlen_q for c in cases if c.headdim == point.headdim))
    causal = sorted({c.causal for c in cases})
    return [Case(1, point.nheads, point.nheads_k, n, n, point.headdim, cz, point.dtype, {"inputs": kind})
            for kind in INPUTS for cz in causal]


def accuracy_inputs(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (b, s, h, d) of an accuracy case in its dtype: N(0, 1), with outliers when the case says so."""
    gen = torch.Generator(device=device).manual_seed(seed)
    outliers = case.extra["inputs"] == "outliers"
    shapes = ((case.batch, case.seqlen_q, case.nheads, case.headdim),
              (case.batch, case.seqlen_k, case.nheads_k, case.headdim),
              (case.batch, case.seqlen_k, case.nheads_k, case.headdim_v))
    dtype = torch_dtype(case.dtype)
    return tuple(gaussian(*s, outliers=outliers, generator=gen, device=device, dtype=dtype) for s in shapes)


def _accuracy_row(suite: str, name: str, case: Case) -> dict[str, Any]:
    # no ms / tflops fields: the speed tables and plots leave these rows out
    return {"suite": suite, "provider": name, "mode": ACCURACY_MODE, **case.fields(), "error": None,
            "rmse": None, "rel_l1": None, "cosine": None, "max_abs_err": None,
            "reference": ACCURACY_REFERENCE}


def _bf16_forward(q, k, v, case: Case) -> torch.Tensor:
    import flashattn

    return flashattn.flash_attn_func(q, k, v, causal=case.causal)


def accuracy_rows(cfg: RunConfig) -> list[dict]:
    """Our bf16 kernel and each ACCURACY_RECIPES path on every accuracy case of the run's sweep, measured
    against the float64 oracle on the unquantised (bf16) inputs; a path that fails gets its error."""
    from flashattn.reference import attention_ref

    from ..progress import Progress
    from ..runner import describe_error

    cases = accuracy_cases(cfg.cases)
    paths = [BF16, *ACCURACY_RECIPES]
    progress = Progress(len(cases) * len(paths), f"suite {cfg.suite.name}: accuracy", quiet=cfg.quiet)
    rows: list[dict] = []
    try:
        inputs: dict[str, tuple] = {}
        for case in cases:
            kind = case.extra["inputs"]
            if kind not in inputs:
                inputs = {kind: accuracy_inputs(case, cfg.device, cfg.seed)}
            q, k, v = inputs[kind]
            ref = attention_ref(q, k, v, causal=case.causal, upcast=True)[0].double()
            for name in paths:
                row = _accuracy_row(cfg.suite.name, name, case)
                try:
                    with torch.no_grad():
                        if name == BF16:
                            out = _bf16_forward(q, k, v, case)
                        else:
                            recipe = ACCURACY_RECIPES[name]
                            row.update({f: recipe.info()[f] for f in ("fp8_descale", "fp8_rotated")})
                            out = fp8_attention(recipe.quantize(q, k, v), case, torch_dtype(case.dtype), {})
                    row.update(errors(out, ref))
                except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result, not a crash
                    row["error"] = describe_error(exc)
                rows.append(row)
                progress.step(f"{name:<15} {case.label()} {kind} | " + _summary(row))
            del ref
            _release(cfg.device)
    finally:
        progress.close()
    return rows


def _summary(row: dict) -> str:
    if row["error"]:
        return row["error"][:70]
    return f"RMSE {row['rmse']:.3g} rel L1 {row['rel_l1']:.3g} cos {row['cosine']:.6f}"


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


_GROUP = tuple(f for f in KEY if f not in ("suite", "provider"))


def _key(row: dict) -> tuple:
    return tuple(row.get(f) for f in _GROUP)


def annotate(rows: list[dict]) -> None:
    """`bf16_speedup` on every timed row: flashattn's ms over the row's at the same shape (above 1: faster
    than our bf16 forward; 1 on flashattn's own). On the accuracy rows `rmse_gain`: fp8-tensor's RMSE over the
    row's at the same case and inputs; `target` and `meets_target` (gain >= 2) on fp8-tensor+rot's rows
    with outliers."""
    ok = [r for r in rows if not r.get("error")]
    bf16 = {_key(r): r for r in ok
            if r.get("provider") == BF16 and r.get("mode") != ACCURACY_MODE and r.get("ms")}
    base = {_key(r): r for r in ok
            if r.get("provider") == GAIN_BASE and r.get("mode") == ACCURACY_MODE and r.get("rmse")}
    for r in rows:
        for f in (SPEEDUP_FIELD, GAIN_FIELD, "target", "meets_target"):
            r.pop(f, None)
        if r.get("error"):
            continue
        if r.get("mode") == ACCURACY_MODE:
            _annotate_accuracy(r, base.get(_key(r)))
        elif r.get("ms"):
            ref = bf16.get(_key(r))
            if ref is not None:
                r[SPEEDUP_FIELD] = ref["ms"] / r["ms"]


def _annotate_accuracy(row: dict, base: dict | None) -> None:
    if row.get("provider") == TARGET_PATH and row.get("inputs") == TARGET_INPUTS:
        row["target"] = f"{GAIN_BASE}'s RMSE / this one's; target >= {TARGET_GAIN:g}"
    if base is None or not row.get("rmse"):
        return
    row[GAIN_FIELD] = base["rmse"] / row["rmse"]
    if "target" in row:
        row["meets_target"] = row[GAIN_FIELD] >= TARGET_GAIN


def _fmt_err(x: float) -> str:
    return f"{x:.3g}"


SPEEDUP = View(SPEEDUP_FIELD, "speedup over flashattn bf16 (its time / this one's)", lambda x: f"{x:.2f}",
               plot=False)
RMSE = View("rmse", "RMSE vs the float64 oracle on the unquantised inputs", _fmt_err, higher_is_better=False,
            plot=False)
REL_L1 = View("rel_l1", "relative L1 error, sum|o - ref| / sum|ref|", _fmt_err, higher_is_better=False,
              plot=False)
COSINE = View("cosine", "cosine similarity to the oracle", lambda x: f"{x:.6f}", plot=False)
GAIN = View(GAIN_FIELD, f"{GAIN_BASE}'s RMSE / this one's (rotation's target: >= {TARGET_GAIN:g} on "
            "outliers)", lambda x: f"{x:.2f}", plot=False)


@dataclass(frozen=True)
class Fp8Suite(FeatureSuite):
    """A FeatureSuite with rows measured beside the sweep (`extra_rows(cfg)`, read by the runner) and the
    oracles its providers are checked against (`reference`, the results' meta)."""

    extra_rows: Callable[[RunConfig], list[dict]] | None = None
    reference: str | None = None


SUITE = Fp8Suite(
    name="fp8",
    description=(
        f"FP8 (e4m3) forward vs bf16, inference. Speed: {TOKENS} tokens, hidden {HIDDEN} (d64 h32, d128 h16, "
        "d256 h8), N 1K..16K, causal and not; flashattn-fp8 (per-head descales, V seqlen-contiguous, "
        "quantised before the timed call), flashattn-fp8-rowv (V in the ordinary layout, read in place), "
        "flashattn-fp8-gluon and flashattn-fp8-triton (each FP8 variant on its named route), "
        "flashattn-fp8+quant and "
        "flashattn-fp8+rot+quant (quantize() of q, k, v, rotated or not, inside the timed call), flashattn "
        "and sdpa-cudnn in bf16. The FP8 providers are checked "
        "against the float64 oracle on the dequantised values of their own e4m3 inputs, within 2x plain "
        "PyTorch's error at FP8's precision + 1e-3 (attention_ref_fp8). Accuracy (mode accuracy): b1 h16 "
        "N4096 d128, causal and not, N(0, 1) inputs and inputs with outliers (0.1% of the entries x10); "
        "each FP8 recipe and our bf16 kernel against the float64 oracle on the unquantised inputs; target: "
        f"per-tensor + rotation's RMSE at least {TARGET_GAIN:g}x below per-tensor's on the outliers"
    ),
    grid=_grid,
    providers=PROVIDERS,
    modes=("fwd",),
    device="cuda",
    views=(TFLOPS, SPEEDUP, MS, RMSE, REL_L1, COSINE, GAIN),
    baseline=OURS,
    skip=skip,
    build_cases=build_cases,
    key_fields=KEY,
    annotate=annotate,
    extra_rows=accuracy_rows,
    reference=f"{DENSE_REFERENCE}; the FP8 providers: {FP8_REFERENCE}",
)
