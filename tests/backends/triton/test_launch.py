"""backends/triton/launch.py: a launch plan is reused only where Triton's JIT would pick the same compiled
kernel."""

import itertools
import math

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from utils import INTERPRET

from flashattn import _internals, config
from flashattn.backends.triton import launch as launch_mod

_BACKEND = make_backend(GPUTarget("cuda", 90, 32))


def _native(x):
    return native_specialize_impl(_BACKEND, x, False, True, True)


def _values():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 1000, 1024, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40,
            2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16, -1, -16, -(2**31), -(2**31) - 16]
    floats = [0.0, 1.0, 0.125, -3.5]
    base = torch.empty(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base.to(torch.float16), base.to(torch.float16)[8:],
               base.to(torch.bfloat16)[3:], base.to(torch.int32)]
    return ints + floats + [True, False, None] + tensors


def test_spec_never_merges_what_triton_tells_apart():
    # across kinds too: a launcher may pass a float in one call and None (a feature compiled out) in the next
    values = _values()
    for a, b in itertools.combinations(values, 2):
        if launch_mod._spec(a) == launch_mod._spec(b):
            assert _native(a) == _native(b), (a, b)
    # and it tells apart the cases that matter: 16 | x, x = 1, 32-bit range, alignment, dtype
    assert launch_mod._spec(16) != launch_mod._spec(17) != launch_mod._spec(1)
    assert launch_mod._spec(2**31 + 16) != launch_mod._spec(32)
    assert launch_mod._spec(2**63 + 16) != launch_mod._spec(2**62)
    t = torch.empty(8, dtype=torch.float16)
    assert launch_mod._spec(t) != launch_mod._spec(t[1:]) != launch_mod._spec(t.float())


def test_spec_tells_descriptors_apart_by_block_shape_and_layout():
    # a kernel may take a tile's width from its descriptor alone (the wide-head backwards take dv's): a plan
    # compiled for dv's 64-wide tiles must not run a call with 128-wide ones
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16)

    def desc(cols, swizzle=128):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=4)
        return TensorDescriptor(base, list(base.shape), list(base.stride()), [1, 64, 1, cols], layout)

    specs = [launch_mod._spec(d) for d in (desc(64), desc(128), desc(64, swizzle=64))]
    assert len(set(specs)) == 3
    assert launch_mod._spec(desc(128)) == specs[1]
    assert _native(desc(64)) != _native(desc(128))  # as Triton compiles them apart


def test_spec_of_the_triton_kernels_host_descriptors():
    # the Triton kernels' descriptors (triton.tools.tensor_descriptor, as tma.descriptor builds them) have no
    # layout: their spec is their dtype and block shape
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16)

    def desc(rows):
        return TensorDescriptor(base, list(base.shape), list(base.stride()), [1, rows, 1, 128])

    assert launch_mod._spec(desc(64)) == (torch.bfloat16, (1, 64, 1, 128), None)
    assert launch_mod._spec(desc(64)) != launch_mod._spec(desc(32))


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeKernel:
    """Stands for a JITFunction: kernel[grid](...) compiles (counted) and returns the compiled kernel."""

    arg_names = ["x", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.jit_calls, self.compiled = [], {}

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            key = (args[1] % 16 == 0, kwargs["BLOCK"])
            return self.compiled.setdefault(key, _Compiled())
        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(config, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_internals, "current_device", lambda: 0)
    monkeypatch.setattr(_internals, "raw_stream", lambda device: 1234)
    monkeypatch.setattr(launch_mod, "_plans", {})


def test_plan_reuses_the_compiled_kernel_with_every_parameter_in_order(fake_cuda):
    kernel, x = _FakeKernel(), torch.empty(4)
    launch_mod.launch(kernel, (3,), x, 32, 0.5, BLOCK=64, FLAG=True, num_warps=4)
    assert len(kernel.jit_calls) == 1
    launch_mod.launch(kernel, (5, 2), x, 48, 0.25, BLOCK=64, FLAG=True, num_warps=4)
    assert len(kernel.jit_calls) == 1  # same signature: no JIT
    (compiled,) = kernel.compiled.values()
    assert compiled.runs == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x, 48, 0.25, 64, True)]


def test_plan_misses_where_the_specialisation_changes(fake_cuda):
    kernel, x = _FakeKernel(), torch.empty(4)
    launch_mod.launch(kernel, (1,), x, 32, 0.5, BLOCK=64, FLAG=True)
    launch_mod.launch(kernel, (1,), x, 33, 0.5, BLOCK=64, FLAG=True)  # 16 no longer divides n
    launch_mod.launch(kernel, (1,), x, 32, 0.5, BLOCK=128, FLAG=True)  # another constexpr
    launch_mod.launch(kernel, (1,), x[1:], 32, 0.5, BLOCK=64, FLAG=True)  # misaligned pointer
    launch_mod.launch(kernel, (1,), x, 32, 0.5, BLOCK=64, FLAG=True, num_warps=8)  # another option
    launch_mod.launch(kernel, (1,), x, 32, None, BLOCK=64, FLAG=True)  # a float argument passed as None
    assert len(kernel.jit_calls) == 6
    assert all(not c.runs for c in kernel.compiled.values())


def test_bound_launches_through_the_plan_launch_returned(fake_cuda, monkeypatch):
    kernel, x = _FakeKernel(), torch.empty(8)
    bound = launch_mod.Bound(kernel, (3,), dict(BLOCK=64, FLAG=True))
    bound((x, 32, 0.5))
    assert len(kernel.jit_calls) == 1 and kernel.jit_calls[0][0] == (3,)  # the grid as given
    plan = launch_mod.launch(kernel, (3,), x, 48, 0.25, BLOCK=64, FLAG=True)
    assert bound.plan is plan and plan.tail == (64, True) and plan.pointers == ((0, True),)
    bound((x, 48, 0.25))
    (compiled,) = kernel.compiled.values()
    assert len(kernel.jit_calls) == 1
    assert compiled.runs[-1] == (3, 1, 1, 1234, "fn", "meta", None, None, None, x, 48, 0.25, 64, True)
    # a tensor whose alignment is not the plan's: through launch, as the JIT would specialise it anew
    bound((x[1:], 48, 0.25))
    assert len(kernel.jit_calls) == 2 and bound.plan is not plan
    # another current device: through launch, whose plans are per device
    monkeypatch.setattr(_internals, "current_device", lambda: 1)
    runs = len(compiled.runs)
    bound((x, 48, 0.25))
    assert len(kernel.jit_calls) == 3 and len(compiled.runs) == runs


def test_direct_follows_launch_rule(monkeypatch):
    monkeypatch.setattr(config, "INTERPRET", False)
    assert not launch_mod.direct(torch.empty(4))  # a CPU tensor: no launch plans
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert launch_mod.direct(torch.empty(4))
    monkeypatch.setattr(config, "INTERPRET", True)
    assert not launch_mod.direct(torch.empty(4))


def test_no_plan_without_every_constexpr_named(fake_cuda):
    kernel, x = _FakeKernel(), torch.empty(4)
    for _ in range(2):
        launch_mod.launch(kernel, (1,), x, 32, 0.5, BLOCK=64)  # FLAG left to a default
    assert len(kernel.jit_calls) == 2


def test_interpreter_always_takes_the_jit(fake_cuda, monkeypatch):
    monkeypatch.setattr(config, "INTERPRET", True)
    kernel, x = _FakeKernel(), torch.empty(4)
    for _ in range(3):
        launch_mod.launch(kernel, (1,), x, 32, 0.5, BLOCK=64, FLAG=True)
    assert len(kernel.jit_calls) == 3


def test_an_installed_hook_takes_the_jit(fake_cuda):
    from triton import knobs

    def hook(metadata):
        return None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        kernel, x = _FakeKernel(), torch.empty(4)
        for _ in range(2):
            launch_mod.launch(kernel, (1,), x, 32, 0.5, BLOCK=64, FLAG=True)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.jit_calls) == 2


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
@pytest.mark.parametrize("sq", [1, 17, 113])
def test_preprocess_fills_the_gluon_backward_inputs(sq):
    """GLUON: the backward's preprocess zeroes the Gluon backward's float32 dQ buffer, every row and column of
    it (the tail tile included; q's head dim, wider here than dv's), and writes D = rowsum(dO * O) and the LSE
    in base 2 into the stats planes, whose padding rows (up to a multiple of 4) get zeros. (A sink's gradient
    is the Gluon kernel's.)"""
    from flashattn.kernels.triton.attn_bwd import attn_bwd_preprocess_kernel

    b, h, d, dv = 2, 3, 72, 40
    rows = -(-sq // 4) * 4
    o, do = (torch.randn(b, sq, h, dv, dtype=torch.float16) for _ in range(2))
    lse = torch.randn(b, h, sq)
    stats = torch.full((2, b * h, rows), float("nan"))
    dq_acc = torch.full((b, sq, h, d), float("nan"))
    launch_mod.launch(
        attn_bwd_preprocess_kernel, (-(-sq // 32), b * h),
        o, do, stats[1], o, dq_acc, lse, stats[0], None, *o.stride()[:3], *do.stride()[:3],
        lse.stride(0), lse.stride(1), h * rows, rows, h, sq, rows,
        HEAD_DIM_V=dv, BLOCK_DV=64, BLOCK_M=32, IS_VARLEN=False, GLUON=True, HEAD_DIM=d, BLOCK_D=128,
    )
    assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).reshape(b * h, sq)
    torch.testing.assert_close(stats[1, :, :sq], delta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[0, :, :sq], lse.reshape(b * h, sq) / math.log(2), rtol=1e-6, atol=0)
    assert torch.equal(stats[:, :, sq:], torch.zeros(2, b * h, rows - sq))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
def test_preprocess_fills_the_varlen_gluon_backward_inputs():
    """Varlen GLUON: sequence b's D and base-2 LSE go to the stats planes from row 4 · STATS_ROW0[b] (the
    offsets in 4-row steps, a 16-byte aligned start for the kernel's TMA), rows between sequences untouched;
    the float32 dQ buffer is zeroed at the packed rows."""
    from flashattn.backends.triton import gluon
    from flashattn.kernels.triton.attn_bwd import attn_bwd_preprocess_kernel

    lens, h, d = [0, 5, 1, 8, 3], 2, 40
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, batch = int(cu[-1]), len(lens)
    row0 = gluon.varlen_tile_offsets(cu, batch, 4, total)
    assert row0.tolist() == [0, 0, 2, 3, 5, 6]
    rows = 4 * (-(-total // 4) + batch)
    o, do = (torch.randn(total, h, d, dtype=torch.float16) for _ in range(2))
    lse = torch.randn(h, total)
    stats = torch.full((2, h, rows), float("nan"))
    dq_acc = torch.full((total, h, d), float("nan"))
    launch_mod.launch(
        attn_bwd_preprocess_kernel, (-(-max(lens) // 32), batch * h),
        o, do, stats[1], cu, dq_acc, lse, stats[0], row0,
        0, *o.stride()[:2], 0, *do.stride()[:2], 0, lse.stride(0), 0, rows, h, total, rows,
        HEAD_DIM_V=d, BLOCK_DV=64, BLOCK_M=32, IS_VARLEN=True, GLUON=True, HEAD_DIM=d, BLOCK_D=64,
    )
    assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
    delta = (o.float() * do.float()).sum(-1).t()  # (h, total)
    written = torch.zeros(rows, dtype=torch.bool)
    for i, n in enumerate(lens):
        start, at = int(cu[i]), 4 * int(row0[i])
        torch.testing.assert_close(stats[1, :, at:at + n], delta[:, start:start + n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats[0, :, at:at + n], lse[:, start:start + n] / math.log(2), rtol=1e-6,
                                   atol=0)
        written[at:at + n] = True
    assert stats[:, :, ~written].isnan().all()  # nothing else written
