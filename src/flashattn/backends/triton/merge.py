"""Launcher of the partial-attention merge (kernels/triton/combine.py); backends/torch/merge.py is its twin.

Layouts: partial outputs stacked as (n, b, sq, h, d), partial LSEs as (n, b, h, sq), any strides with a
contiguous last dim of the outputs. Returns out (b, sq, h, d) in `out_dtype` and lse (b, h, sq) float32.
An LSE of -inf or +inf marks an empty partial; a row with no non-empty partial gets out 0 and lse +inf.
"""

import functools

import torch

from flashattn.backends.triton import host
from flashattn.backends.triton.launch import launch
from flashattn.kernels.triton.combine import combine_kernel

_TILE_ELEMS = 8192  # (splits, rows, d) elements one program loads at once: 64 fp32 registers a thread
_INTERPRETER_SMS = 4  # few programs under the interpreter, but still more than one split at test sizes


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def combine_tiles(n: int, rows: int, block_d: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_R): all partials of a row in one load when they fit, and rows per program chosen so
    that small merges (a decode step: batch · heads rows) still spread over the SMs."""
    block_s = min(host.pow2(n), max(2, _TILE_ELEMS // block_d))
    if device.type != "cuda":
        return block_s, 4
    sms, block_r = sm_count(device), 1
    while block_r < 16 and rows // (2 * block_r) >= 2 * sms:
        if 2 * block_r * block_s * block_d > _TILE_ELEMS:
            break
        block_r *= 2
    return block_s, block_r


def merge_partials(o_parts, lse_parts, *, out_dtype=None, out=None, lse=None):
    """Triton merge. `out` / `lse` may be given to write into (the decode launcher's final buffers)."""
    n, b, sq, h, d = o_parts.shape
    if out is None:
        out = torch.empty((b, sq, h, d), dtype=out_dtype or o_parts.dtype, device=o_parts.device)
    if lse is None:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=o_parts.device)
    block_d = host.block_d(d)
    block_s, block_r = combine_tiles(n, b * sq * h, block_d, o_parts.device)
    grid = (-(-sq * h // block_r), b)
    # through a launch plan: the JIT's per-call binding costs more host time than a small merge's GPU time
    launch(
        combine_kernel, grid,
        o_parts, lse_parts, out, lse,
        *o_parts.stride()[:4], *lse_parts.stride(),
        *out.stride()[:3], *lse.stride(),
        h, sq, n,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_S=block_s,
        num_warps=4,
    )
    return out, lse
