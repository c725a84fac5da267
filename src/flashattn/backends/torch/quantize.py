"""FP8 quantisation in plain torch: the same arithmetic as the Triton kernels (backends/triton/quantize.py's
signature): the rows rotated in float32 by the ±1 matrix then 1 / sqrt(d); scale the largest power of two
2^k with amax · 2^k <= 448 (amax floored at 2^-100; 1 where amax is 0), read off amax's bits; the scaled
values saturated at ±448 and cast to e4m3; descale = 2^-k."""

import torch

FP8_MAX = 448.0


def quantize_fp8(x, *, per_head: bool, seq_contiguous: bool, rotation=None):
    b, s, h, d = x.shape
    xf = x.float()
    if rotation is not None:
        xf = (xf @ rotation.to(device=x.device, dtype=torch.float32)) * d ** -0.5
    if xf.numel() == 0:
        amax = xf.new_zeros((b, h) if per_head else (1,))
    else:
        amax = xf.abs().amax(dim=(1, 3)) if per_head else xf.abs().amax().reshape(1)
    bits = amax.clamp_min(2.0 ** -100).view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    k = torch.where((bits & 0x7FFFFF) <= 0x600000, 8 - e, 7 - e)
    k = torch.where(amax > 0, k, 0)
    scale = ((k + 127) << 23).view(torch.float32)
    expand = scale[:, None, :, None] if per_head else scale
    x8 = (xf * expand).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    x8 = x8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) if seq_contiguous else x8.contiguous()
    return x8, ((127 - k) << 23).view(torch.float32)
