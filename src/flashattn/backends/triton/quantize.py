"""Launcher of the FP8 quantisation kernels (kernels/triton/quantize.py): two passes over x, the largest
magnitude then the cast. backends/torch/quantize.py is its twin; flashattn.fp8.quantize checks the
arguments.

x: (batch, seqlen, heads, d), 16-bit or float32, any strides (a last dim that is not contiguous is copied
first). rotation: None, or the (d, d) ±1 matrix H·diag(signs) (d a power of two >= 16). Returns (x8 like x
in e4m3, contiguous or with its seqlen dim contiguous, descale float32 (batch, heads) or (1,)).
"""

import torch

from flashattn.backends.triton import host
from flashattn.backends.triton.launch import launch
from flashattn.kernels.triton.quantize import fp8_amax_kernel, fp8_cast_kernel

_BLOCK_S = {True: 64, False: 32}  # rows per program on a GPU / under the interpreter


def quantize_fp8(x, *, per_head: bool, seq_contiguous: bool, rotation=None):
    b, s, h, d = x.shape
    if d > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    device = x.device
    if seq_contiguous:
        y = torch.empty((b, h, d, s), dtype=torch.float8_e4m3fn, device=device).permute(0, 3, 1, 2)
    else:
        y = torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn, device=device)
    slots = b * h if per_head else 1
    amax = torch.zeros(slots, dtype=torch.float32, device=device)
    descale = torch.ones(slots, dtype=torch.float32, device=device)
    if x.numel():
        block_s = _BLOCK_S[x.is_cuda]
        r = x if rotation is None else rotation.to(device=device, dtype=x.dtype).contiguous()
        grid = (b * h, host.cdiv(s, block_s))
        flags = dict(HEAD_DIM=d, BLOCK_D=host.block_d(d), BLOCK_S=block_s, ROTATE=rotation is not None,
                     PER_HEAD=per_head, DOT_PREC=host.dot_precision(x.dtype))
        strides = (x.stride(0), x.stride(1), x.stride(2))
        inv_sqrt_d = d ** -0.5
        launch(fp8_amax_kernel, grid, x, r, amax, *strides, h, s, inv_sqrt_d, **flags)
        launch(fp8_cast_kernel, grid, x, r, amax, y, descale, *strides, *y.stride(), h, s, inv_sqrt_d,
               **flags)
    return y, descale.view(b, h) if per_head else descale
