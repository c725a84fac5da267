"""The shared vocabulary of the IO model: a shape, a machine and the estimate every model returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

GB = 1e9  # traffic is reported in decimal GB, as Nsight Compute and the anchors do
GiB = 2**30  # memory footprints in GiB, as torch.cuda.max_memory_allocated is usually quoted

_DTYPE_BYTES = {
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp32": 4, "float32": 4, "float": 4, "fp8": 1, "float8": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of `dtype`: a name ("bf16", "float16", ...), a torch.dtype or an int."""
    if isinstance(dtype, int):
        if dtype <= 0:
            raise ValueError(f"dtype bytes must be positive, got {dtype}")
        return dtype
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype, without importing torch here
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        known = sorted(set(_DTYPE_BYTES))
        raise ValueError(f"dtype {dtype!r} is not known; expected one of {known} or a byte count")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class Machine:
    """What the model needs to know about a GPU.

    `l2_usable` is the fraction of L2 that data read by every SM can occupy. Hopper's L2 is two partitions and
    a line read from both halves of the chip can be held in both, so for K/V shared by all SMs the effective
    capacity approaches half the nominal size.
    """

    name: str
    sms: int
    l2_bytes: int
    matmul_flops: float  # measured dense bf16 matmul ceiling, FLOP/s
    bandwidth: float  # measured device-to-device copy, bytes (read + written) per second
    l2_usable: float = 0.5

    @property
    def l2_effective(self) -> float:
        return self.l2_bytes * self.l2_usable


# Ceilings measured on our H200 on 2026-11-29 (/work/shared/anchors/h200-2026-11-29.md).
H200 = Machine("H200", sms=132, l2_bytes=60 * 2**20, matmul_flops=780e12, bandwidth=4.27e12)


@dataclass(frozen=True)
class AttnShape:
    """One attention call. Layout (batch, seqlen, nheads, headdim); `window` = (left, right), -1 = unbounded.

    `density` is the fraction of (query tile, key tile) pairs a block-sparse mask keeps, on top of
    causal/window.
    """

    batch: int
    nheads: int
    seqlen_q: int
    headdim: int
    nheads_k: int | None = None
    seqlen_k: int | None = None
    dtype_bytes: int = 2
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    density: float = 1.0

    def __post_init__(self) -> None:
        if self.nheads_k is None:
            object.__setattr__(self, "nheads_k", self.nheads)
        if self.seqlen_k is None:
            object.__setattr__(self, "seqlen_k", self.seqlen_q)
        object.__setattr__(self, "window", tuple(self.window))
        for name in ("batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "headdim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.nheads % self.nheads_k:
            raise ValueError(
                f"nheads_k={self.nheads_k} does not divide nheads={self.nheads}; "
                "nheads must be a multiple of nheads_k (GQA)"
            )
        if len(self.window) != 2 or any(w < -1 for w in self.window):
            raise ValueError(f"window must be (left, right) with -1 meaning unbounded, got {self.window!r}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")

    @property
    def group(self) -> int:
        """Query heads per kv head (1 = MHA)."""
        return self.nheads // self.nheads_k

    @property
    def bounds(self) -> tuple[int, int]:
        """(left, right) reach around the aligned diagonal, -1 = unbounded; causal caps right at 0."""
        left, right = self.window
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        return left, right

    @property
    def masked(self) -> bool:
        return self.bounds != (-1, -1)

    def visible_keys(self, row_lo: int, row_hi: int) -> tuple[int, int]:
        """Keys [lo, hi) seen by at least one query row in [row_lo, row_hi)."""
        left, right = self.bounds
        offset = self.seqlen_k - self.seqlen_q  # bottom-right alignment
        lo = 0 if left < 0 else max(0, row_lo + offset - left)
        hi = self.seqlen_k if right < 0 else min(self.seqlen_k, row_hi - 1 + offset + right + 1)
        return lo, max(lo, hi)

    def visible_rows(self, key_lo: int, key_hi: int) -> tuple[int, int]:
        """Query rows [lo, hi) that see at least one key in [key_lo, key_hi)."""
        left, right = self.bounds
        offset = self.seqlen_k - self.seqlen_q
        lo = 0 if right < 0 else max(0, key_lo - offset - right)
        hi = self.seqlen_q if left < 0 else min(self.seqlen_q, key_hi - 1 - offset + left + 1)
        return lo, max(lo, hi)

    def visible_pairs(self) -> int:
        """(query, key) pairs the mask lets through, per head."""
        return sum(hi - lo for lo, hi in (self.visible_keys(i, i + 1) for i in range(self.seqlen_q)))

    def convention_flops(self) -> int:
        """Forward matmul FLOPs by the FlashAttention benchmarks' convention: 4·b·h·sq·sk·d, half when causal.

        The convention is for square causal masks; a window or a causal mask with sq != sk (decoding, say)
        counts the visible pairs instead. Block sparsity scales by density.
        """
        b, h, d = self.batch, self.nheads, self.headdim
        if self.window != (-1, -1) or (self.causal and self.seqlen_q != self.seqlen_k):
            pairs = self.visible_pairs()
        else:
            pairs = self.seqlen_q * self.seqlen_k * (0.5 if self.causal else 1.0)
        return round(4 * b * h * d * pairs * self.density)


@dataclass(frozen=True)
class IOEstimate:
    """Predicted HBM (DRAM) traffic, FLOPs and extra memory of one kernel launch or a sequence of them.

    bytes_read: DRAM reads, L2-aware: re-reads of the same tile by concurrently running programs are served by
        L2 when the in-flight working set fits. This is the number Nsight Compute's `dram__bytes_read.sum` is
        expected to match within +-20%.
    bytes_read_no_l2: upper bound: every tile load goes to DRAM.
    bytes_written: DRAM writes (the same with or without L2).
    flops: matmul FLOPs the kernels execute (whole tiles, masked or not).
    flops_convention: the FlashAttention benchmark convention (forward 4·b·h·sq·sk·d, half when causal;
        backward 2.5x forward), which TFLOP/s figures are quoted in.
    peak_extra_bytes: memory the call allocates beyond its inputs, at its peak.
    parts: the kernel launches this estimate is the sum of, in launch order.
    detail: named model quantities (tile counts, K/V passes, ...), for reports and tests.
    """

    name: str
    bytes_read: int
    bytes_written: int
    flops: int
    peak_extra_bytes: int
    flops_convention: int = 0
    bytes_read_no_l2: int | None = None
    parts: tuple[IOEstimate, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.bytes_read_no_l2 is None:
            object.__setattr__(self, "bytes_read_no_l2", self.bytes_read)

    @property
    def total_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def total_bytes_no_l2(self) -> int:
        return self.bytes_read_no_l2 + self.bytes_written

    @property
    def intensity(self) -> float:
        """Executed FLOPs per DRAM byte (L2-aware)."""
        return self.flops / self.total_bytes if self.total_bytes else math.inf

    def roofline_time(
        self, peak_flops: float = H200.matmul_flops, bandwidth: float = H200.bandwidth, *, no_l2: bool = False
    ) -> float:
        """Lower bound on the run time in seconds: the slower of doing the FLOPs and moving the bytes."""
        moved = self.total_bytes_no_l2 if no_l2 else self.total_bytes
        return max(self.flops / peak_flops, moved / bandwidth)

    def bound(self, machine: Machine = H200) -> str:
        """Which side of the machine's ridge point the estimate falls on: "memory" or "compute"."""
        return "compute" if self.intensity >= machine.matmul_flops / machine.bandwidth else "memory"

    def to_dict(self, machine: Machine = H200) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "parts"}
        out.update(
            total_bytes=self.total_bytes,
            total_bytes_no_l2=self.total_bytes_no_l2,
            intensity=self.intensity,
            roofline_time_s=self.roofline_time(machine.matmul_flops, machine.bandwidth),
            bound=self.bound(machine),
            parts=[p.to_dict(machine) for p in self.parts],
        )
        return out


def combine(
    name: str,
    parts: list[IOEstimate] | tuple[IOEstimate, ...],
    *,
    peak_extra_bytes: int | None = None,
    flops_convention: int | None = None,
    **detail: Any,
) -> IOEstimate:
    """The estimate of running `parts` one after another.

    Peak memory defaults to the sum of the parts' peaks: right when every part's allocations stay alive to
    the end (forward outputs during backward, gradients), an upper bound otherwise. The convention FLOPs
    default to the parts' sum; a pass whose convention is not per kernel (the backward's 2.5x) passes its own.
    """
    parts = tuple(parts)
    if peak_extra_bytes is None:
        peak_extra_bytes = sum(p.peak_extra_bytes for p in parts)
    if flops_convention is None:
        flops_convention = sum(p.flops_convention for p in parts)
    return IOEstimate(
        name=name,
        bytes_read=sum(p.bytes_read for p in parts),
        bytes_written=sum(p.bytes_written for p in parts),
        flops=sum(p.flops for p in parts),
        peak_extra_bytes=peak_extra_bytes,
        flops_convention=flops_convention,
        bytes_read_no_l2=sum(p.bytes_read_no_l2 for p in parts),
        parts=parts,
        detail=dict(detail),
    )
