"""Tensor descriptors for the streamed tiles (Hopper's tensor memory accelerator, TMA), and what decides
whether tensors suit them.

The kernels' inner loops stream K/V (forward, dQ) or Q/dO (dK/dV) tiles. On sm90+ the loads can go through
TMA descriptors: one bulk copy per tile instead of per-thread address arithmetic and cp.async, which frees
registers and issue slots for the softmax. A descriptor covers a padded-layout tensor (batch, seqlen, heads,
d) with a (1, rows, 1, d) block; rows past seqlen read as zero, as the masked pointer loads do. Whether a
call uses them is its route's choice (routes.Spec.tma, routes.TritonForward.tma); this module tells the
route whether the tensors allow it.
"""

import functools

import torch


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_facts(device: torch.device) -> tuple[bool, tuple[int, int]]:
    """(a CUDA device, its (major, minor) capability): what routing asks of the device. (False, (0, 0)) for
    the interpreter's CPU tensors."""
    if device.type != "cuda":
        return False, (0, 0)
    return True, _capability(device.index or 0)


def aligned(*tensors: torch.Tensor) -> bool:
    """Every tensor has a 16-byte aligned base, a contiguous last dim and 16-byte multiple strides."""
    # plain loops: generator expressions cost ~1.5 us of host time per tensor
    for t in tensors:
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


def descriptor(t: torch.Tensor, block_rows: int):
    """The (batch, seqlen, heads, d) descriptor of t, one tile = block_rows rows of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, t.shape[-1]])
