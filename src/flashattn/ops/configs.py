"""Tile shapes, warps and pipeline depths for the attention kernels.

A shipped table for the H200 (measured with `scripts/tune.py`, benchmarks/NOTES.md) so users pay no autotune
time; other GPUs take the generic Hopper/Ampere-safe row. Under TRITON_INTERPRET=1 the tiles are small and
unequal (BLOCK_M != BLOCK_N) so that CPU tests cross tile, tail and diagonal-band boundaries at small sizes.
`FLASHATTN_CONFIG="fwd=128,64,8,3;dkdv=64,128,8,2;dq=128,64,8,2"` overrides any entry (tuning and benchmarks);
a fifth number caps the registers per thread (maxnreg), e.g. `dkdv=32,128,8,3,128`.
"""

import functools
from dataclasses import dataclass

import torch

from flashattn import _env


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # a register cap that lets more programs share an SM (None: ptxas decides)

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        return cls(*(int(x) for x in text.split(",")))


# (kernel, padded head dim) -> config, from the sweep in benchmarks/results/tune-h200-2026-11-29 (bf16,
# N = 4K and 16K at 16K tokens). Head dims below 64 take the 64 row: the tiles are bound by the matmul shape.
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
    # the warp-specialised forward (ops/attention_ws.py, d = 64 and 128): block_m is two or three consumer
    # warpgroups of 64 rows, the stages are K/V ring slots (num_warps: the kernel fixes its own partitions)
    ("fwd_ws", 128): TileConfig(128, 128, 4, 2),
    # d = 64: three consumer warpgroups of 64 rows (NOTES v33); 3 K/V stages (96 KiB) beside two Q tiles (48)
    ("fwd_ws", 64): TileConfig(192, 128, 4, 3),
    # the warp-specialised backward (d = 64 and 128): block_m query rows per step, block_n keys per program
    # (two consumers of 64; the kernel asserts 128), the stages are (Q, dO) ring slots. d = 64: 128-row steps
    # (two stages fill the shared memory) +3-4% over 64-row ones without the mask, once v41 took the row
    # statistics out of the registers (they spilled 0.9 KB before, NOTES v21, v42); d = 128 has shared memory
    # for 64-row steps over two stages only
    ("bwd_ws", 64): TileConfig(128, 128, 4, 2),
    ("bwd_ws", 128): TileConfig(64, 128, 4, 2),
}
# Causal rows of the long table where they differ: the d=64 backward keeps 64-row steps (with the deferred dQ
# their four dSᵀ buffers allow), 2% ahead of 128-row ones at 1K causal and 1% behind at 16K (NOTES v42)
_H200_CAUSAL = {
    ("bwd_ws", 64): TileConfig(64, 128, 4, 3),
}

# Short sequences (max of sq, sk up to the row's limit): few key tiles per program, so a program's prologue
# and epilogue weigh; 64x64 tiles (about 112 KiB of shared memory) let two programs share an SM and overlap
# them. From `scripts/tune.py --short` (results/h200-2026-11-29-s3/tune_short.json, N = 1K and 2K): forward
# d=128 +8% / +24% at N=1K (non-causal / causal), +2% / +12% at 2K; the d=64 backward +11% to +18% through
# the dQ kernel alone. The d=64 forward gains only at 1K: +2% / +5%, but -8% / -2% at 2K (the bench, long and
# short rows side by side: results/h200-2026-11-29-s3/recheck). Entries not listed keep the long row.
_H200_SHORT = {  # (kernel, head dim) -> (longest sequence it is used for, config)
    ("fwd", 64): (1024, TileConfig(64, 64, 4, 3)),
    ("fwd", 128): (2048, TileConfig(64, 64, 4, 3)),
    ("dq", 64): (2048, TileConfig(64, 64, 4, 3)),
    # the d=64 Gluon forward: at N = 1K causal, 192-row tiles lose 14% to 128-row ones (the diagonal's masked
    # share grows with the tile), and tie without the mask (NOTES v33)
    ("fwd_ws", 64): (1024, TileConfig(128, 128, 4, 3)),
}
# Causal rows where they differ from _H200_SHORT's. The d=64 Gluon forward with v40's tree reductions: two
# consumers beat three by 4% at 2K and 4K causal, and lose 2-4% at 8K and 16K causal and 2-4K without the mask
# (NOTES v40)
_H200_SHORT_CAUSAL = {
    ("fwd_ws", 64): (4096, TileConfig(128, 128, 4, 3)),
}
_LIMITS = sorted({limit for limit, _ in [*_H200_SHORT.values(), *_H200_SHORT_CAUSAL.values()]})

_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1),
    "dkdv": TileConfig(16, 32, 4, 1),
    "dq": TileConfig(32, 16, 4, 1),
}


def _overrides() -> dict[str, TileConfig]:
    return _parse_overrides(_env.get("FLASHATTN_CONFIG", ""))


@functools.lru_cache(maxsize=16)
def _parse_overrides(text: str) -> dict[str, TileConfig]:
    out = {}
    for part in filter(None, text.split(";")):
        name, _, spec = part.partition("=")
        out[name.strip()] = TileConfig.parse(spec)
    return out


def tile_config(kernel: str, block_d: int, device: torch.device, seqlen: int | None = None,
                causal: bool = False) -> TileConfig:
    """The config for `kernel` ('fwd' | 'dkdv' | 'dq' | 'fwd_ws' | 'bwd_ws') at padded head dim `block_d`;
    `seqlen` (the longer of sq and sk; None: long) picks the short-sequence rows, `causal` the causal variant
    of a row where one is listed."""
    overrides = _overrides()
    if kernel in overrides:
        return overrides[kernel]
    # the smallest row limit that covers seqlen (None: long): a handful of distinct cache keys
    bucket = next((lim for lim in _LIMITS if seqlen is not None and seqlen <= lim), None)
    return _table_entry(kernel, block_d, device.type == "cuda", bucket, causal)


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
