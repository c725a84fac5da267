"""The cases the workers run, by name. Imported by the test module (to parametrise) and by every worker.

Sizes: at world size W the padded sequences have 8·W tokens (8 a rank; zigzag chunks of 4), so a window of
3 is narrower than a shard and skips steps. Most cases run the torch backend; the ``interp`` cases run the
Triton kernels through the interpreter (tiny shapes: it is slow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from cp_checks import Problem, VarlenProblem, check_padded, check_varlen
from cp_special import SPECIAL

FP32, FP16 = torch.float32, torch.float16
WORLDS = (2, 3, 4)


@dataclass(frozen=True)
class Case:
    name: str
    worlds: tuple[int, ...]
    fn: Callable[[int, int], None]


CASES: dict[str, Case] = {}


def _add(name: str, worlds, fn) -> None:
    if name in CASES:
        raise ValueError(f"duplicate case {name}")
    CASES[name] = Case(name, tuple(worlds), fn)


def _padded(name: str, worlds, make: Callable[[int], Problem]) -> None:
    """A padded case; ``make(world)`` builds the problem for each world size."""
    for w in worlds:
        _add(f"{name}-w{w}", (w,), lambda rank, world, make=make: check_padded(make(world), rank, world))


def _heads(world: int) -> int:
    return 6 if world == 3 else 4  # Ulysses needs nheads divisible by the world size


# -- every method x layout x causal x dtype ------------------------------------------------------------------
for method in ("ring", "ulysses"):
    for layout in ("contiguous", "zigzag", "striped"):
        for causal in (False, True):
            for dtype in (FP32, FP16):
                def make(w, method=method, layout=layout, causal=causal, dtype=dtype):
                    h = _heads(w)
                    # ring: GQA; Ulysses: MQA in fp16 (K/V replicated over the group), GQA in fp32
                    hk = h // 2 if method == "ring" or dtype == FP32 else 1
                    return Problem(method=method, layout=layout, causal=causal, dtype=dtype, sq=8 * w, h=h,
                                   hk=hk)
                mask = "causal" if causal else "full"
                tag = f"{method}-{layout}-{mask}-{'fp16' if dtype == FP16 else 'fp32'}"
                _padded(tag, WORLDS, make)

for layout in ("contiguous", "zigzag", "striped"):
    for causal in (False, True):
        _padded(f"hybrid-{layout}-{'causal' if causal else 'full'}", (4,),
                lambda w, layout=layout, causal=causal: Problem(method="hybrid", layout=layout, causal=causal,
                                                                dtype=FP16, sq=32, h=4, hk=2, hybrid=(2, 2)))


# -- windows narrower than a shard: steps skipped, relays cut short ------------------------------------------
def _expect(computed: Callable[[int, int], int], down: int, up: Callable[[int], int]):
    def check(rank, world, stats):
        want = dict(world=world, down_steps=down, up_steps=up(world), forward_computed=computed(rank, world),
                    backward_computed=computed(rank, world))
        want["forward_skipped"] = want["backward_skipped"] = world - want["forward_computed"]
        got = {key: getattr(stats, key) for key in want}
        assert got == want, f"rank {rank}: stats {got}, expected {want}"
    return check


# contiguous causal, window 3 < 8: rank r needs only its own block and r − 1's
_padded("window-contiguous-causal-narrow", WORLDS, lambda w: Problem(
    layout="contiguous", causal=True, window=(3, -1), sq=8 * w,
    expect=_expect(lambda r, w: 1 if r == 0 else 2, down=1, up=lambda w: 0)))
# two-sided window: r − 1 and r + 1 (the up relay brings r + 1 in one round)
_padded("window-contiguous-twosided-narrow", WORLDS, lambda w: Problem(
    layout="contiguous", window=(2, 5), sq=8 * w,
    expect=_expect(lambda r, w: 1 + (r > 0) + (r < w - 1), down=1, up=lambda w: 1 if w > 2 else 0)))
# zigzag causal, window 3 < chunk 4: chunk r needs chunk r − 1 (rank r − 1), chunk 2W−1−r needs 2W−2−r (r + 1)
_padded("window-zigzag-causal-narrow", WORLDS, lambda w: Problem(
    causal=True, window=(3, -1), sq=8 * w, dtype=FP16,
    expect=_expect(lambda r, w: 1 + (r > 0) + (r < w - 1), down=1, up=lambda w: 1 if w > 2 else 0)))
_padded("window-striped-causal", WORLDS, lambda w: Problem(layout="striped", causal=True, window=(5, -1),
                                                           sq=8 * w))
_padded("window-wide-zigzag", WORLDS, lambda w: Problem(window=(11, 3), sq=8 * w, dtype=FP16))
_padded("window-ulysses-zigzag", WORLDS, lambda w: Problem(method="ulysses", causal=True, window=(3, -1),
                                                           sq=8 * w, h=_heads(w)))

# -- features ---------------------------------------------------------------------------------------------
_padded("softcap-zigzag-causal", WORLDS, lambda w: Problem(causal=True, softcap=3.0, sq=8 * w, dtype=FP16))
_padded("softcap-ulysses", (2, 4), lambda w: Problem(method="ulysses", softcap=3.0, sq=8 * w))
_padded("alibi-zigzag-causal", WORLDS, lambda w: Problem(causal=True, alibi="h", sq=8 * w))
_padded("alibi-contiguous-batch", WORLDS, lambda w: Problem(layout="contiguous", alibi="bh", sq=8 * w,
                                                            dtype=FP16))
_padded("alibi-striped-window", (2, 4), lambda w: Problem(layout="striped", causal=True, window=(6, -1),
                                                          alibi="bh", sq=8 * w))
_padded("alibi-ulysses-zigzag", (2, 4), lambda w: Problem(method="ulysses", causal=True, alibi="bh",
                                                          sq=8 * w))
_padded("sink-zigzag-causal", WORLDS, lambda w: Problem(causal=True, sink=True, sq=8 * w, dtype=FP16))
_padded("sink-window-mqa", (2, 4), lambda w: Problem(layout="contiguous", causal=True, window=(3, -1),
                                                     sink=True, hk=1, sq=8 * w))
_padded("sink-ulysses", (2, 3), lambda w: Problem(method="ulysses", sink=True, sq=8 * w, h=_heads(w), hk=1))
_padded("headdim-40", WORLDS, lambda w: Problem(causal=True, d=40, sq=8 * w, dtype=FP16))
_padded("headdim-59-dv-24", (2, 3), lambda w: Problem(layout="striped", d=59, dv=24, sq=8 * w, h=_heads(w),
                                                      method="ulysses" if w == 3 else "ring"))
_padded("headdim-59-ring", (4,), lambda w: Problem(layout="contiguous", causal=True, d=59, sq=8 * w))
# seqlen_q != seqlen_k: bottom-right causal over the global lengths
_padded("cross-lengths-causal", WORLDS, lambda w: Problem(causal=True, sq=8 * w, sk=16 * w))
_padded("cross-lengths-window", (2, 3), lambda w: Problem(layout="contiguous", causal=True, window=(9, -1),
                                                          sq=16 * w, sk=8 * w, dtype=FP16))
_padded("cross-lengths-ulysses", (2, 4), lambda w: Problem(method="ulysses", causal=True, sq=8 * w,
                                                           sk=16 * w))
_padded("bf16-ring-zigzag-causal", WORLDS, lambda w: Problem(causal=True, sq=8 * w, dtype=torch.bfloat16))
_padded("bf16-ulysses-striped", (2, 4), lambda w: Problem(method="ulysses", layout="striped", sq=8 * w,
                                                          dtype=torch.bfloat16))
_padded("everything-ring", WORLDS, lambda w: Problem(causal=True, window=(10, -1), softcap=4.0, alibi="h",
                                                     sink=True, hk=1, d=24, sq=8 * w, dtype=FP16))
_padded("everything-hybrid", (4,), lambda w: Problem(method="hybrid", hybrid=(2, 2), causal=True,
                                                     window=(10, -1), softcap=4.0, alibi="bh", sink=True,
                                                     hk=1, d=24, sq=32))
_padded("hybrid-ring4-ulysses1", (4,), lambda w: Problem(method="hybrid", hybrid=(4, 1), causal=True, sq=32))
_padded("hybrid-ring1-ulysses4", (4,), lambda w: Problem(method="hybrid", hybrid=(1, 4), causal=True, sq=32,
                                                         layout="striped"))


# -- varlen -------------------------------------------------------------------------------------------------
def _varlen(name: str, worlds, p: VarlenProblem) -> None:
    for w in worlds:
        _add(f"varlen-{name}-w{w}", (w,), lambda rank, world, p=p: check_varlen(p, rank, world))


SHORT_DOCS = (5, 0, 1, 13, 3, 24, 2)  # lengths 0 and 1, and shorter than 2·world at every world size
_varlen("causal", WORLDS, VarlenProblem(SHORT_DOCS, causal=True))
_varlen("full-fp16", WORLDS, VarlenProblem(SHORT_DOCS, dtype=FP16, hk=1))
_varlen("window", WORLDS, VarlenProblem(SHORT_DOCS, causal=True, window=(4, -1), dtype=FP16))
_varlen("window-twosided", (2, 4), VarlenProblem(SHORT_DOCS, window=(3, 2)))
_varlen("alibi", (2, 3), VarlenProblem(SHORT_DOCS, causal=True, alibi="bh"))
_varlen("alibi-h-window", (4,), VarlenProblem(SHORT_DOCS, causal=True, alibi="h", window=(6, 1)))
_varlen("sink-softcap", WORLDS, VarlenProblem(SHORT_DOCS, causal=True, sink=True, softcap=3.0, dtype=FP16))
_varlen("headdim-40", (2,), VarlenProblem((9, 16, 1), causal=True, d=40, h=2, hk=2))


def _varlen_narrow(rank, world, stats):
    # documents of 8·W (chunks of 4) and window 3: only the neighbours' blocks, in one round
    assert (stats.down_steps, stats.up_steps) == (1, 1 if world > 2 else 0), stats


_varlen("window-narrow-skips", (3, 4), VarlenProblem((24, 32, 32), causal=True, window=(3, -1),
                                                     expect=_varlen_narrow))

# -- through the Triton interpreter (slow: tiny shapes, world size 2) ----------------------------------------
_tiny = Problem(b=1, sq=16, h=2, hk=1, backend="triton")
_padded("interp-ring-zigzag-causal", (2,), lambda w: replace(_tiny, causal=True, dtype=FP16))
_padded("interp-ring-window-trimmed", (2,), lambda w: replace(_tiny, layout="contiguous", causal=True,
                                                              window=(3, 2)))
_padded("interp-ring-alibi", (2,), lambda w: replace(_tiny, causal=True, alibi="h"))
_padded("interp-ulysses-striped", (2,), lambda w: replace(_tiny, method="ulysses", layout="striped", hk=2,
                                                          dtype=FP16))
_varlen("interp", (2,), VarlenProblem((1, 0, 7, 12), causal=True, h=2, hk=1, dtype=FP16, backend="triton"))

# -- errors, determinism, layouts, groups --------------------------------------------------------------------
for name, (worlds, fn) in SPECIAL.items():
    for w in worlds:
        _add(f"{name}-w{w}", (w,), fn)


# -- on GPUs through NCCL (test_cp_gpu.py runs them by name; no CPU world picks them) ------------------------
BF16 = torch.bfloat16


def _gpu(name: str, make: Callable[[int], Problem | VarlenProblem]) -> None:
    def fn(rank, world, make=make):
        p = make(world)
        (check_varlen if isinstance(p, VarlenProblem) else check_padded)(p, rank, world)
    _add(name, (), fn)
    GPU_CASES.append(name)


GPU_CASES: list[str] = []
_gpu_big = Problem(b=2, h=8, hk=2, d=128, backend="triton", device="cuda", dtype=BF16)
_gpu("gpu-ring-zigzag-causal", lambda w: replace(_gpu_big, causal=True, sq=512 * w))
_gpu("gpu-ring-contiguous-window", lambda w: replace(_gpu_big, layout="contiguous", causal=True,
                                                     window=(100, -1), sq=512 * w, dtype=FP16))
_gpu("gpu-ring-everything", lambda w: replace(_gpu_big, causal=True, window=(300, -1), softcap=5.0, alibi="h",
                                              sink=True, d=96, sq=256 * w))
_gpu("gpu-ulysses-zigzag", lambda w: replace(_gpu_big, method="ulysses", causal=True, sq=512 * w))
_gpu("gpu-varlen-causal", lambda w: VarlenProblem((300, 1, 0, 1000, 77), causal=True, h=8, hk=2, d=64,
                                                  dtype=BF16, backend="triton", device="cuda"))
for name in ("gpu-deterministic", "gpu-overlap-transfer"):
    _add(name, (), SPECIAL[name][1])
    GPU_CASES.append(name)


def names_for(world: int) -> list[str]:
    return [c.name for c in CASES.values() if world in c.worlds]
