"""Tensor descriptors for the streamed tiles (Hopper's tensor memory accelerator, TMA).

The kernels' inner loops stream K/V (forward, dQ) or Q/dO (dK/dV) tiles. On sm90+ the K/V loads can go through
TMA descriptors: one bulk copy per tile instead of per-thread address arithmetic and cp.async, which frees
registers and issue slots for the softmax. A descriptor covers a padded-layout tensor (batch, seqlen, heads,
d) with a (1, rows, 1, d) block; rows past seqlen read as zero, as the masked pointer loads do.

Used when every streamed tensor qualifies: CUDA, compute capability >= 9, fp16/bf16, padded layout (varlen
packs sequences back to back, so a tile would read the next sequence's rows instead of zeros), 16-byte
aligned base and strides; and only for d = 128 with pipelines of 3 or more stages (ops/attention.py says why:
measured slower at d = 64, a compiler crash at 2 stages). The dK/dV program's Q/dO stay on pointers (another
compiler crash, kernels/attn_bwd.py).
`FLASHATTN_TMA=0` turns the path off (A/B timing; the pointer path is always there).
"""

import functools

import torch

from flashattn import _env

_DTYPES = (torch.float16, torch.bfloat16)


def device_ok(t: torch.Tensor) -> bool:
    """A CUDA tensor on a GPU with TMA (sm90+)."""
    return t.device.type == "cuda" and _sm90(t.device.index or 0)


@functools.lru_cache(maxsize=8)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _aligned(t: torch.Tensor) -> bool:
    # plain loops: the generator expressions this replaced cost ~1.5 us of host time per tensor (NOTES v35)
    if t.data_ptr() % 16:
        return False
    size = t.element_size()
    strides = t.stride()
    if strides[-1] != 1:
        return False
    for s in strides[:-1]:
        if s * size % 16:
            return False
    return True


def usable(*tensors: torch.Tensor, varlen: bool) -> bool:
    """Whether the kernels may take their streamed tiles through descriptors for these tensors (the caller
    decides for which head dims and tiles)."""
    t0 = tensors[0]
    if varlen or t0.dtype not in _DTYPES or _env.get("FLASHATTN_TMA", "1") == "0" or not device_ok(t0):
        return False
    for t in tensors:
        if not _aligned(t):
            return False
    return True


def descriptor(t: torch.Tensor, block_rows: int):
    """The (batch, seqlen, heads, d) descriptor of t, one tile = block_rows rows of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, t.shape[-1]])
