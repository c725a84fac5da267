"""The backward's atomic dQ: a float32 accumulator the dK/dV kernels add dS·K into, then scaled into dQ.

flash_attn's default backward adds dQ with atomics from the program of each key tile (5 matmuls per tile
pair); the alternative, a dQ kernel that recomputes S and dP per query tile (7 matmuls), is bitwise
reproducible and runs when `deterministic=True` (and for learnable sinks, whose gradient it computes). On sm90
the additions are bulk tensor reduces (TMA, one asynchronous op per (rows, d) float32 tile, as FA3 adds its
dQ); elsewhere, and under the interpreter, per-element atomics. `FLASHATTN_ATOMIC_DQ=0` forces the dQ
kernel (A/B timing).

The accumulator (q's rows × query heads × BLOCK_D, float32) is capped at _DQ_ACC_BYTES: larger problems run
their kv heads in chunks, one launch each, so that at N = 128K (b = 1, h = 16, d = 128) the forward+backward
peak stays within issue 3's 2.2 GiB (outputs and gradients take 2.0; a whole accumulator would add 1 GiB).
"""

import math
import os
from collections.abc import Callable

import torch

from flashattn.kernels.attn_bwd import dq_from_acc_kernel
from flashattn.ops import host, tma

_DQ_ACC_BYTES = 128 * 2**20


def atomic_dq(deterministic: bool, has_sink: bool) -> bool:
    """Whether the backward adds dQ atomically inside its dK/dV kernel (see the module docstring)."""
    return not deterministic and not has_sink and os.environ.get("FLASHATTN_ATOMIC_DQ", "1") != "0"


def descriptor(acc: torch.Tensor, varlen: bool, block_m: int):
    """(DQ_TMA, the accumulator's (batch, rows, heads, BLOCK_D) descriptor or None) for a kernel adding
    (block_m, BLOCK_D) tiles."""
    if not (tma.device_ok(acc) and tma.enabled()):
        return False, None
    return True, tma.descriptor(acc.unsqueeze(0) if varlen else acc, block_m)


def rows(acc: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of the accumulator (varlen: packed rows, no batch axis)."""
    return (0, acc.stride(0), acc.stride(1)) if varlen else (acc.stride(0), acc.stride(1), acc.stride(2))


def accumulate(q: torch.Tensor, dq: torch.Tensor, nheads_k: int, block_d: int, softmax_scale: float,
               varlen: bool, launch: Callable[[int, int, torch.Tensor], None]) -> None:
    """Fills dq: for each chunk of kv heads [hk0, hk0 + n), zeroes the accumulator, calls launch(hk0, n, acc)
    (the dK/dV kernel of those heads, adding into acc: q's layout with the chunk's query heads and BLOCK_D
    columns), then writes softmax_scale · acc into dq's heads of the chunk."""
    group = q.shape[-2] // nheads_k
    lead = q.shape[:-2]  # (b, sq) or (total_q,)
    per_kv_head = math.prod(lead) * group * block_d * 4
    chunk = max(1, min(nheads_k, _DQ_ACC_BYTES // max(1, per_kv_head)))
    acc_all = torch.empty((*lead, chunk * group, block_d), dtype=torch.float32, device=q.device)
    n_rows, batch = (lead[0], 1) if varlen else (lead[1], lead[0])
    block_m = 64 if q.device.type == "cuda" else 32
    for hk0 in range(0, nheads_k, chunk):
        n = min(chunk, nheads_k - hk0)
        acc = acc_all[..., : n * group, :]
        acc.zero_()
        launch(hk0, n, acc)
        dq_heads = dq[..., hk0 * group:(hk0 + n) * group, :]
        dq_rows = (0, dq_heads.stride(0), dq_heads.stride(1)) if varlen else dq_heads.stride()[:3]
        dq_from_acc_kernel[(host.cdiv(n_rows, block_m), batch * n * group)](
            acc, dq_heads, *rows(acc, varlen), *dq_rows, n * group, n_rows, softmax_scale,
            HEAD_DIM=q.shape[-1], BLOCK_D=block_d, BLOCK_M=block_m,
        )
