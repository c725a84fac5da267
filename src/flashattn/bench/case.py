"""What one measurement is about: the problem shape (`Case`), the grid a suite sweeps (`Grid`), the modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODES = ("fwd", "bwd", "fwd+bwd")

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16' (rows store torch's own dtype names so they read the same in every tool)."""
    try:
        return _DTYPE_ALIASES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; expected one of bf16, fp16, fp32") from None


def torch_dtype(name: str):
    import torch

    return getattr(torch, canonical_dtype(name))


@dataclass(frozen=True)
class Case:
    """One attention problem: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim).

    `extra` carries suite-specific fields (a decode suite's kv_len, page_size, ...) into the result row.
    """

    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.nheads % self.nheads_k:
            raise ValueError(
                f"nheads_k={self.nheads_k} does not divide nheads={self.nheads}; "
                "nheads must be a multiple of nheads_k (GQA)"
            )

    def fields(self) -> dict[str, Any]:
        """The shape part of a result row."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out

    @property
    def work(self) -> int:
        """Size of the score matrix: grows with every dimension that makes a provider run out of memory."""
        return self.batch * self.nheads * self.seqlen_q * self.seqlen_k

    def label(self) -> str:
        n = (
            f"N={self.seqlen_q}"
            if self.seqlen_q == self.seqlen_k
            else f"sq={self.seqlen_q} sk={self.seqlen_k}"
        )
        h = f"h={self.nheads}" if self.nheads == self.nheads_k else f"h={self.nheads}/{self.nheads_k}"
        return f"b={self.batch} {h} {n} d={self.headdim}{' causal' if self.causal else ''} {self.dtype}"


@dataclass(frozen=True)
class Grid:
    """A sweep over seqlen × headdim × causal.

    Batch is fixed (`batch`) or derived from a token budget (`tokens // seqlen`, the FlashAttention papers'
    setup), and heads likewise from `nheads` or `hidden // headdim`, so each row of a sweep does similar work.
    """

    dtype: str
    seqlens: tuple[int, ...]
    headdims: tuple[int, ...]
    causal: tuple[bool, ...] = (False, True)
    batch: int | None = None
    tokens: int | None = None
    nheads: int | None = None
    hidden: int | None = None
    nheads_k: int | None = None

    def __post_init__(self) -> None:
        if (self.batch is None) == (self.tokens is None):
            raise ValueError("a grid needs exactly one of batch and tokens")
        if (self.nheads is None) == (self.hidden is None):
            raise ValueError("a grid needs exactly one of nheads and hidden")

    def override(self, **changes: Any) -> Grid:
        """Command-line overrides; setting batch clears tokens (nheads clears hidden) and vice versa."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if "batch" in changes:
            changes.setdefault("tokens", None)
        if "tokens" in changes:
            changes.setdefault("batch", None)
        if "nheads" in changes:
            changes.setdefault("hidden", None)
        if "hidden" in changes:
            changes.setdefault("nheads", None)
        return dataclasses.replace(self, **changes)

    def cases(self) -> list[Case]:
        out = []
        for d in self.headdims:
            h = self.nheads if self.nheads is not None else max(1, self.hidden // d)
            hk = self.nheads_k if self.nheads_k is not None else h
            for causal in self.causal:
                for n in self.seqlens:
                    b = self.batch if self.batch is not None else max(1, self.tokens // n)
                    out.append(Case(b, h, hk, n, n, d, causal, canonical_dtype(self.dtype)))
        return out
