"""The Gluon launchers' descriptor views (backends/triton/gluon.py): the elements a view's block addresses are
the ones the kernels mean. Host arithmetic, on the CPU; the kernels that read and write through them run on
the GPU (`pytest -m gpu`, tests/backends/triton/test_gluon_bwd_gpu.py)."""

import pytest
import torch

from flashattn.backends.triton import gluon


@pytest.mark.parametrize("shape", [(2, 37, 3, 64), (1, 300, 4, 128), (1, 9, 2, 40)])
@pytest.mark.parametrize("cols", [32, 64])
def test_dq_strips_view_addresses_the_dq_buffers_elements(shape, cols):
    # the backward's float32 dQ buffer (batch, seqlen, heads, d) as (batch, heads, d / 8, seqlen, 8): the
    # block at bwd_dq.dq_coord's coordinates (b, h, c / 8, r, 0) is rows r.., head h, columns c.. of it
    b, n, h, d = shape
    t = torch.arange(b * n * h * d, dtype=torch.float32).view(shape)
    view_shape, strides, block, layout = gluon._dq_strips_spec(t, 16, cols)
    assert view_shape == [b, h, d // 8, n, 8] and block == [1, 1, cols // 8, 16, 8]
    assert layout.swizzle_byte_width == 0 and layout.rank == 5
    view = t.as_strided(view_shape, strides)
    for bi, hi, c, r in ((0, 0, 0, 0), (b - 1, h - 1, d // 8 - 1, n - 1), (b // 2, 1, 2, n // 3)):
        assert torch.equal(view[bi, hi, c, r], t[bi, r, hi, 8 * c:8 * c + 8])
    # every element exactly once
    assert torch.equal(view.permute(0, 3, 1, 2, 4).reshape(shape), t)
    # TMA wants 16-byte strides past the innermost dim
    assert all(st * 4 % 16 == 0 for st in strides[:-1])


def test_dq_strips_view_of_a_varlen_buffer():
    # varlen: the packed (total, heads, d) buffer goes to the descriptors as batch 1
    t = torch.arange(50 * 2 * 64, dtype=torch.float32).view(1, 50, 2, 64)
    view_shape, strides, _, _ = gluon._dq_strips_spec(t, 64, 32)
    view = t.as_strided(view_shape, strides)
    assert torch.equal(view[0, 1, 5, 49], t[0, 49, 1, 40:48])
