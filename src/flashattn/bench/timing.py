"""Timers and memory probes: Triton's do_bench on the GPU, a median of repeats on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TimerConfig:
    # do_bench takes milliseconds of warmup / measurement and derives the call counts from a first estimate
    warmup_ms: int = 25
    rep_ms: int = 100
    # the CPU timer has no cache to flush; it stops at cpu_budget_s or cpu_max_reps, whichever comes first
    cpu_min_reps: int = 3
    cpu_max_reps: int = 20
    cpu_budget_s: float = 0.1

    @classmethod
    def quick(cls) -> TimerConfig:
        # a smoke run: on the CPU one timed call after the warmup where a call outlasts the budget (the
        # interpreted kernels take seconds)
        return cls(warmup_ms=5, rep_ms=20, cpu_min_reps=1, cpu_max_reps=3, cpu_budget_s=0.05)

    def describe(self, device: torch.device) -> str:
        if device.type == "cuda":
            return (
                f"triton.testing.do_bench(warmup={self.warmup_ms}, rep={self.rep_ms}, return_mode='median')"
            )
        return (
            f"median of {self.cpu_min_reps}..{self.cpu_max_reps} calls within {self.cpu_budget_s}s, 1 warmup"
        )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_first_call(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """Wall time of one call including compilation/autotuning; returns (result, seconds)."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - t0


def median_ms(fn: Callable[[], object], device: torch.device, cfg: TimerConfig) -> float:
    """Steady-state time of one call in milliseconds."""
    if device.type == "cuda":
        # imported here so that the CPU path works where Triton cannot be imported
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + cfg.cpu_budget_s
    while len(times) < cfg.cpu_min_reps or (len(times) < cfg.cpu_max_reps and time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def host_us(fn: Callable[[], object], device: torch.device, calls: int = 20) -> float | None:
    """Host time per call in microseconds: back-to-back calls without a sync, so the GPU queue absorbs the
    kernels (CUDA only). When it exceeds the kernels' time plus do_bench's L2 flush, `ms` measures the
    host."""
    if device.type != "cuda":
        return None
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    synchronize(device)
    return elapsed / calls * 1e6


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory one call allocates on top of what was live before it (inputs, saved graph): CUDA only."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return int(peak)
