"""Analytic HBM-traffic model: why FlashAttention is fast, in bytes.

Standard attention moves Theta(N·d + N^2) bytes through HBM (the scores S and probabilities P are written and
read back); tiled attention moves Theta(N^2·d^2/M) for on-chip memory M. This package predicts, for a concrete
shape, the DRAM bytes read and written, FLOPs, arithmetic intensity and peak extra memory of

- our kernels: `forward_io`, `backward_io` (the Triton or the warp-specialised backward, as the launcher
  picks), `forward_backward_io`, `decode_io` (tiled.py);
- standard attention as the paper counts it and as torch executes our `naive` provider: `standard_attention`;
- the paper's asymptotic formulas: `standard_attention_io(N, d)`, `tiled_attention_io(N, d, M)`.

Each returns an `IOEstimate`. `scripts/ncu_io.py` measures the same quantities with Nsight Compute.
"""

from flashattn.iomodel.estimate import GB, H200, AttnShape, GiB, IOEstimate, Machine, combine, dtype_bytes
from flashattn.iomodel.standard import standard_attention, standard_attention_io, tiled_attention_io
from flashattn.iomodel.tiled import (
    backward_io,
    decode_io,
    default_num_splits,
    forward_backward_io,
    forward_io,
    kernel_tiles,
    leaves,
    ws_backward_tiles,
)

__all__ = [
    "GB", "GiB", "H200", "AttnShape", "IOEstimate", "Machine", "combine", "dtype_bytes",
    "forward_io", "backward_io", "forward_backward_io", "decode_io", "kernel_tiles", "default_num_splits",
    "leaves", "ws_backward_tiles", "standard_attention", "standard_attention_io", "tiled_attention_io",
]
