"""Tile shapes, warps and pipeline depths of the Triton backend's kernels: the shipped H200 table.

Measured on the H200 (scripts/tune_tiles.py; docs/tuning-log.md has the sweeps), so users pay no autotune
time; other GPUs take the same rows, which are Hopper/Ampere-safe. Under TRITON_INTERPRET=1 the tiles are
small and unequal (BLOCK_M != BLOCK_N) so that CPU tests cross tile, tail and diagonal-band boundaries at
small sizes. Experts replace rows through `flashattn.config` (FLASHATTN_CONFIG, `set_tiles`): a fifth number
caps the registers per thread (maxnreg), e.g. `dkdv=32,128,8,3,128`.

Which row a call takes is decided by flashattn.backends.triton.routes; this module only holds the numbers.
It imports neither torch nor Triton.
"""

import functools
from dataclasses import dataclass

from flashattn import config
from flashattn.errors import FlashAttnError


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # a register cap that lets more programs share an SM (None: ptxas decides)

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """"128,64,8,3" or "128,64,8,3,128" (with maxnreg)."""
        values = [int(x) for x in text.split(",")]
        if not 2 <= len(values) <= 5:
            raise FlashAttnError(f"a tile config has 2 to 5 numbers, got {text!r}")
        return cls(*values)


# (kernel, padded head dim) -> config, from the H200 tile sweep (bf16, N = 4K and 16K at 16K tokens). Head
# dims below 64 take the 64 row: the tiles are bound by the matmul shape.
_H200 = {
    ("fwd", 64): TileConfig(128, 64, 8, 3),
    ("fwd", 128): TileConfig(128, 128, 8, 3),
    ("fwd", 256): TileConfig(128, 64, 8, 2),
    ("dkdv", 64): TileConfig(32, 128, 4, 3),
    ("dkdv", 128): TileConfig(64, 128, 8, 3),
    ("dkdv", 256): TileConfig(64, 64, 8, 2),
    ("dq", 64): TileConfig(128, 64, 8, 3),
    ("dq", 128): TileConfig(128, 64, 8, 3),
    ("dq", 256): TileConfig(128, 32, 8, 2),
    # the warp-specialised forward (d = 64 and 128): block_m is two or three consumer warpgroups of 64 rows,
    # the stages are K/V ring slots (num_warps: the kernel fixes its own partitions)
    ("fwd_ws", 128): TileConfig(128, 128, 4, 2),
    # d = 64: three consumer warpgroups of 64 rows; 3 K/V stages (96 KiB) beside two Q tiles (48)
    ("fwd_ws", 64): TileConfig(192, 128, 4, 3),
    # d = 256: 64-key steps over 2 stages (128 KiB) beside one Q buffer (64), 1.20-1.22x the 32-key steps
    # beside two Q buffers (H100, b2 N8K h8, full and causal, one process:
    # benchmarks/results/2026-12-06-workloads-fa4-h100) though they spill ~0.1 KB beside the 64 x 256 float32
    # output per warpgroup (128 registers a thread). FP8 likewise: 1.27-1.37x its 32-key steps (H100, 16K
    # tokens h8, full / causal, beside two Q buffers; benchmarks/results/2026-12-07-fp8-tiles-h100)
    ("fwd_ws", 256): TileConfig(128, 64, 4, 2),
    # d_qk 129..192 (Q and K in three 64-wide chunks): 128-key steps, the registers of d = 128's (S 64 x 128,
    # O 64 x dv per consumer); their 2-stage ring (160 KiB at dv = 128) leaves room for one Q buffer (48)
    ("fwd_ws", 192): TileConfig(128, 128, 4, 2),
    # the warp-specialised backward (d = 64 and 128): block_m query rows per step, block_n keys per program
    # (two consumers of 64; the kernel asserts 128), the stages are (Q, dO) ring slots. d = 64: 128-row steps
    # (two stages fill the shared memory) +3-4% over 64-row ones without the mask, once the row statistics
    # moved from registers to shared memory (they spilled 0.9 KB before); d = 128 has shared memory for
    # 64-row steps over two stages only
    ("bwd_ws", 64): TileConfig(128, 128, 4, 2),
    ("bwd_ws", 128): TileConfig(64, 128, 4, 2),
    # d 129..256 (attn_bwd_dsplit.py: FA3's d = 256 partition): 64 query rows a step, 64 keys a program, two
    # Q stages (the dO stages are what shared memory leaves: routes.gluon_backward_route)
    ("bwd_ws", 256): TileConfig(64, 64, 4, 2),
}
# Causal rows of the long table where they differ: the d=64 backward keeps 64-row steps (with the deferred dQ
# their four dSᵀ buffers allow), 2% ahead of 128-row ones at 1K causal and 1% behind at 16K
_H200_CAUSAL = {
    ("bwd_ws", 64): TileConfig(64, 128, 4, 3),
}

# Short sequences (max of sq, sk up to the row's limit): few key tiles per program, so a program's prologue
# and epilogue weigh; 64x64 tiles (about 112 KiB of shared memory) let two programs share an SM and overlap
# them. From the short-sequence tile sweep (N = 1K and 2K): forward d=128 +8% / +24% at N=1K (non-causal /
# causal), +2% / +12% at 2K; the d=64 backward +11% to +18% through the dQ kernel alone. The d=64 forward
# gains only at 1K: +2% / +5%, but -8% / -2% at 2K (the bench, long and short rows side by side). Entries not
# listed keep the long row.
_H200_SHORT = {  # (kernel, head dim) -> (longest sequence it is used for, config)
    ("fwd", 64): (1024, TileConfig(64, 64, 4, 3)),
    ("fwd", 128): (2048, TileConfig(64, 64, 4, 3)),
    ("dq", 64): (2048, TileConfig(64, 64, 4, 3)),
    # the d=64 Gluon forward: at N = 1K causal, 192-row tiles lose 14% to 128-row ones (the diagonal's masked
    # share grows with the tile), and tie without the mask
    ("fwd_ws", 64): (1024, TileConfig(128, 128, 4, 3)),
}
# Causal rows where they differ from _H200_SHORT's. The d=64 Gluon forward with tree reductions: two
# consumers beat three by 4% at 2K and 4K causal, and lose 2-4% at 8K and 16K causal and 2-4K without the mask
_H200_SHORT_CAUSAL = {
    ("fwd_ws", 64): (4096, TileConfig(128, 128, 4, 3)),
}
# The FP8 forward's rows where they differ, outside a band: at d = 128 three consumer warpgroups of 64 rows
# (serial steps), 1.09-1.14x two (H100, b1 N16K h16: 920 against 842 TFLOP/s, then 937 against 825 in
# benchmarks/results/2026-12-07-fp8-d128-rows-h100; causal 867 against 839, within the run's noise, and that
# build spills: 2026-12-07-fp8-tiles2-h100). The other FP8 rows are the 16-bit ones
# (benchmarks/results/2026-12-07-fp8-tiles-h100)
_H200_FP8 = {
    ("fwd_ws", 128): TileConfig(192, 128, 4, 2),
}
_LIMITS = sorted({limit for limit, _ in [*_H200_SHORT.values(), *_H200_SHORT_CAUSAL.values()]})

_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1),
    "dkdv": TileConfig(16, 32, 4, 1),
    "dq": TileConfig(32, 16, 4, 1),
}


def tile_config(kernel: str, block_d: int, cuda: bool, seqlen: int | None = None,
                causal: bool = False, fp8: bool = False) -> TileConfig:
    """The config for `kernel` ('fwd' | 'dkdv' | 'dq' | 'fwd_ws' | 'bwd_ws') at padded head dim `block_d`
    on a CUDA device (`cuda`) or the interpreter; `seqlen` (the longer of sq and sk; None: long) picks the
    short-sequence rows, `causal` the causal (or banded) variant of a row where one is listed, `fp8` an FP8
    call's row where one is listed for calls without a band (else the 16-bit one)."""
    override = config.tile_overrides.get(kernel)
    if override is not None:
        return override
    if fp8 and cuda and not causal and (kernel, block_d) in _H200_FP8:
        return _H200_FP8[(kernel, block_d)]
    # the smallest row limit that covers seqlen (None: long): a handful of distinct cache keys
    bucket = next((lim for lim in _LIMITS if seqlen is not None and seqlen <= lim), None)
    return _table_entry(kernel, block_d, cuda, bucket, causal)


@functools.lru_cache(maxsize=64)
def _table_entry(kernel: str, block_d: int, cuda: bool, seqlen: int | None = None,
                 causal: bool = False) -> TileConfig:
    # cached: this runs on every call, and small problems are bound by the host-side launch cost
    if not cuda:
        return _INTERPRETER[kernel]
    keys = sorted(d for (k, d) in _H200 if k == kernel)
    key = max([d for d in keys if d <= block_d], default=keys[0])
    long = (_H200_CAUSAL if causal and (kernel, key) in _H200_CAUSAL else _H200)[(kernel, key)]
    short = _H200_SHORT_CAUSAL if causal and (kernel, key) in _H200_SHORT_CAUSAL else _H200_SHORT
    limit, cfg = short.get((kernel, key), (0, long))
    return cfg if seqlen is not None and seqlen <= limit else long


_SMEM_BUDGET = 200 * 1024  # bytes of the split kernel's K/V stage buffers; a block gets up to 227 KiB


def decode_tiles(block_d: int, elem_size: int, paged: bool, cuda: bool, many_programs: bool = False
                 ) -> TileConfig:
    """Tiles of the split-KV decode kernel. block_m caps the packed query rows per program (the real
    BLOCK_M is the next power of two of group·seqlen_q, at least 16, at most this); block_n is the key tile.

    A paged cache gets two more pipeline stages: the block-table read feeding each K/V load is pipelined
    too, and with the contiguous stage count the K/V tiles end up single-buffered (sm_90 TTGIR of Triton 3.6:
    3 and 4 stages give one K/V buffer, 5 give two). With many programs (more than one wave of splits: batch
    16 x 8 KV heads) a paged cache reads faster through 64-key tiles: +3% to +10% at batch 16 in two H200
    sweeps, where at batch 1 (16 splits) they lost up to 16%; contiguous caches showed no such pattern. Only
    where it was measured: 16-bit caches at head dim 128 (others keep their tiles; the FP8 sweep at b16
    64K paged found its 128-key, 5-stage tile as fast as 7 stages and 1.3-1.5x faster than 8 warps). The
    overrides `decode` and `decode_paged` replace them.
    """
    override = config.tile_overrides.get("decode_paged" if paged else "decode")
    if override is not None:
        return override
    return _decode_entry(block_d, elem_size, paged, cuda, many_programs)


@functools.cache
def _decode_entry(block_d: int, elem_size: int, paged: bool, cuda: bool, many_programs: bool) -> TileConfig:
    if not cuda:
        # key tiles of 32 against pages of 16: the CPU tests gather tiles across page boundaries
        return TileConfig(32, 32, 4, 1)
    block_n = 128 if block_d <= 128 else 64
    if many_programs and block_d == 128 and elem_size == 2:
        block_n = 64
    if elem_size > 2:
        block_n //= 2
    extra = 2 if paged else 0
    stages = (3 if block_d <= 128 else 2) + extra
    # stages - 1 - extra buffers of a K and a V tile are in flight
    while stages > 2 + extra and (stages - 1 - extra) * 2 * block_n * block_d * elem_size > _SMEM_BUDGET:
        stages -= 1
    # fp32 tiles spill at 4 warps (ptxas, sm_90a); 8 warps halve the registers each thread holds
    return TileConfig(64, block_n, 8 if elem_size > 2 else 4, stages)


def decode_programs_per_sm(block_d: int, elem_size: int) -> int:
    """Split-kernel programs an SM runs at once, as the split count plans for them. An FP8 cache's programs
    are small enough for two (Nsight Compute on the H200, b16 64K: 193 registers a thread at 4 warps, 2 CTAs
    resident per SM), and filling both slots was 1.15-1.3x faster than planning for one in the sweep (b16:
    2 splits against 3, b1: 32 against 16). Elsewhere one: 16-bit and fp32 caches were tuned so, FP8 caches
    at other head dims are unmeasured."""
    return 2 if elem_size == 1 and block_d == 128 else 1
