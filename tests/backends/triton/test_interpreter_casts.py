"""Under TRITON_INTERPRET=1 the kernels' float -> e4m3 / e5m2 casts round as the GPU's cvt.rn does
(backends/triton/interpreter.py): to nearest even, e4m3 saturating at ±448."""

import pytest
import torch
import triton
import triton.language as tl
from utils import INTERPRET

import flashattn.backends.triton.entry  # noqa: F401  (installs the fix under the interpreter)

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the interpreter's casts (TRITON_INTERPRET=1)")


@triton.jit
def _cast(x, o, N: tl.constexpr, E5M2: tl.constexpr):
    i = tl.arange(0, N)
    if E5M2:
        tl.store(o + i, tl.load(x + i).to(tl.float8e5))
    else:
        tl.store(o + i, tl.load(x + i).to(tl.float8e4nv))


@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("target", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrowing_casts_round_to_nearest_even(source, target):
    g = torch.Generator().manual_seed(0)
    # values around every binade (where a carry moves the exponent), ties, subnormals, saturation, zeros
    special = torch.tensor([0.4951, 0.96875, 0.9375 + 2**-5, -0.0, 0.0, 1e-4, 500.0, -1e4, 2.0**-10])
    x = torch.cat((special, torch.randn(4096 - special.numel(), generator=g) * 30))
    x = x.to(source)
    out = torch.empty(x.numel(), dtype=target)
    _cast[(1,)](x, out, N=x.numel(), E5M2=target == torch.float8_e5m2)
    want = x.float()
    if target == torch.float8_e4m3fn:
        want = want.clamp(-448, 448)
    want = want.to(target)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
