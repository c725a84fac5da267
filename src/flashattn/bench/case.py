"""What one measurement is about: the problem shape (`Case`), the grid a suite sweeps (`Grid`), the modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODES = ("fwd", "bwd", "fwd+bwd")
# the seed of Case.learnable_sink's values
SINK_SEED = 1234

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
    """One attention problem: q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim),
    v (batch, seqlen_k, nheads_k, headdim_v).

    `extra` carries suite-specific fields (a decode suite's kv_len, page_size, ...) into the result row, and
    the options the providers and the oracle read from it (window, lengths, softcap, sink, headdim_v).
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
    def window(self) -> tuple[int, int]:
        """flash_attn's window_size (left, right), -1 = unbounded; suites set it through `extra`."""
        return (int(self.extra.get("window_left", -1)), int(self.extra.get("window_right", -1)))

    @property
    def lengths(self) -> tuple[int, ...] | None:
        """Packed sequences (varlen): batch 1, q and k both hold sum(lengths) tokens, each sequence attends
        only within itself, causal and window aligned per sequence. None for a plain batch."""
        lengths = self.extra.get("lengths")
        return None if lengths is None else tuple(int(n) for n in lengths)

    @property
    def headdim_v(self) -> int:
        """v's (and the output's) head dim; suites set it through `extra` where it differs from headdim."""
        return int(self.extra.get("headdim_v") or self.headdim)

    @property
    def softcap(self) -> float:
        """flash_attn's softcap (0: none); suites set it through `extra`."""
        return float(self.extra.get("softcap") or 0.0)

    @property
    def has_sink(self) -> bool:
        """A learnable sink (one logit per query head in every softmax denominator), `extra` field `sink`."""
        return bool(self.extra.get("sink"))

    def learnable_sink(self, device, requires_grad: bool = False):
        """The case's sink logits, float32 (nheads,), or None without one.

        A fixed draw, so that every provider and the oracle see the same values. Of order one: a row that sees
        a few keys (causal, the first rows; a short window) then gives the sink a large share of the softmax,
        so a provider that drops it is told apart.
        """
        if not self.has_sink:
            return None
        import torch

        gen = torch.Generator().manual_seed(SINK_SEED)
        sink = torch.randn(self.nheads, generator=gen, dtype=torch.float32)
        return sink.to(device).requires_grad_(requires_grad)

    @property
    def masked(self) -> bool:
        """A mask beyond plain (causal) attention, which the oracle and the FLOP count must know about."""
        return self.lengths is not None or self.window != (-1, -1)

    def visible_pairs(self) -> float:
        """(query, key) pairs in the softmax, summed over the batch or the packed sequences.

        Full attention keeps the papers' convention (half the square when causal and sq = sk); a window is
        counted exactly, since the whole point of one is the pairs it leaves out.
        """
        if self.lengths is not None:
            return float(sum(window_pairs(n, n, self.causal, self.window) for n in self.lengths))
        return self.batch * window_pairs(self.seqlen_q, self.seqlen_k, self.causal, self.window)

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
        mask = ""
        if self.lengths is not None:
            mask += f" varlen({len(self.lengths)} seqs)"
        if self.window != (-1, -1):
            mask += f" window={self.window}"
        if self.softcap:
            mask += f" softcap={self.softcap:g}"
        if self.has_sink:
            mask += " sink"
        d = f"d={self.headdim}" + (f" dv={self.headdim_v}" if self.headdim_v != self.headdim else "")
        return f"b={self.batch} {h} {n} {d}{' causal' if self.causal else ''}{mask} {self.dtype}"


def window_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] = (-1, -1)) -> float:
    """Visible (query, key) pairs of one sequence under flash_attn's masks (bottom-right aligned).

    Query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded; causal forces
    right = 0). Without a window this is flops.visible_pairs, the papers' convention.
    """
    from .flops import visible_pairs

    left, right = window
    if left < 0 and right < 0:
        return visible_pairs(seqlen_q, seqlen_k, causal)
    if causal:
        right = 0
    off = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + off - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + off + right)
        total += max(0, hi - lo + 1)
    return float(total)


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
