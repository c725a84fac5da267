"""How far an output is from a reference, by the measures the FP8 attention papers report, and the inputs
with outliers they measure on.

out and ref: tensors of one shape, any dtype (compared in float64, as a whole: the measures are of the
output, not of one row). Non-finite values propagate (NaN out), so a broken output never looks accurate.
"""

from __future__ import annotations

import math

import torch

# 0.1% of the entries ten times larger: the outlier features of trained activations, as the FP8 papers test
OUTLIER_FRACTION = 1e-3
OUTLIER_FACTOR = 10.0


def _pair(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but ref {tuple(ref.shape)}; they must match")
    return out.detach().double().flatten(), ref.detach().double().flatten()


def rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sqrt(mean((out - ref)²)); 0 for empty tensors."""
    o, r = _pair(out, ref)
    return float((o - r).square().mean().sqrt()) if o.numel() else 0.0


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """sum|out - ref| / sum|ref|; 0 where both are all zero, inf where only ref is."""
    o, r = _pair(out, ref)
    err, size = float((o - r).abs().sum()), float(r.abs().sum())
    if size == 0:
        return 0.0 if err == 0 else math.inf
    return err / size


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """<out, ref> / (|out| |ref|) over all entries: 1 for the same direction; 1 where both are zero, 0 where
    only one is (nothing to compare the direction of)."""
    o, r = _pair(out, ref)
    no, nr = float(o.norm()), float(r.norm())
    if no == 0 or nr == 0:
        return 1.0 if no == nr else 0.0
    return float(o @ r) / (no * nr)


def max_abs(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref|; 0 for empty tensors."""
    o, r = _pair(out, ref)
    return float((o - r).abs().max()) if o.numel() else 0.0


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Every measure above, keyed as the fp8 suite's rows name them."""
    return {"rmse": rmse(out, ref), "rel_l1": rel_l1(out, ref), "cosine": cosine(out, ref),
            "max_abs_err": max_abs(out, ref)}


def gaussian(*shape: int, outliers: bool = False, generator: torch.Generator | None = None,
             device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N(0, 1) entries of `shape` in `dtype`; with `outliers`, a random OUTLIER_FRACTION of them multiplied
    by OUTLIER_FACTOR (drawn in float32 from `generator`, which lives on `device`)."""
    x = torch.randn(*shape, generator=generator, device=device)
    if outliers:
        mask = torch.rand(*shape, generator=generator, device=device) < OUTLIER_FRACTION
        x = torch.where(mask, x * OUTLIER_FACTOR, x)
    return x.to(dtype)
