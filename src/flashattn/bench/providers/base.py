"""What a provider is: a setup factory that turns a case and its inputs into a callable to time."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..case import Case

LAYOUTS = ("bshd", "bhsd")


@dataclass
class Prepared:
    """A provider ready to run one case.

    `fwd()` is exactly what gets timed: every layout change, mask construction and compilation setup happens
    in the factory, outside it. `leaves` are q, k, v as `fwd` reads them (the layout of its output too),
    requiring grad; the runner differentiates with `torch.autograd.grad(out, leaves, dout)`.
    `context` is entered once around the first call, the check and the timing, rather than per call, so that
    forcing an SDPA backend, say, costs nothing inside the timed region. `info`: fields the provider adds to
    each of its result rows (which kernels this project's call runs, for one). `oracle`: for a provider that
    does not compute on the case's inputs but on a copy of its own (FP8: their e4m3 quantisation), the check
    of its output against that copy, called with the run's check budget in bytes and used instead of the
    case's oracle (check.Fp8Oracle is one); None: the case's.
    """

    fwd: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    layout: str = "bshd"
    context: Callable[[], AbstractContextManager] = field(default=contextlib.nullcontext)
    info: dict = field(default_factory=dict)
    oracle: Callable[[int], Any] | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {LAYOUTS}")


@dataclass(frozen=True)
class Provider:
    name: str
    setup: Callable[[Case, torch.Tensor, torch.Tensor, torch.Tensor], Prepared]
    description: str = ""


def make_leaves(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh leaves in `layout` from (b, s, h, d) inputs; a contiguous copy only when the layout changes."""
    return tuple(from_bshd(x, layout).detach().requires_grad_() for x in (q, k, v))  # type: ignore[return-value]


def from_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bshd" else x.transpose(1, 2).contiguous()


def to_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bshd" else x.transpose(1, 2)


def first_tensor(result: object) -> torch.Tensor:
    """Some APIs return (out, lse, ...) depending on version or flags; the benchmark only needs out."""
    if isinstance(result, (tuple, list)):
        return result[0]
    return result  # type: ignore[return-value]
