"""flashattn._internals: each private shortcut is used on the tested versions, gives what the public path
gives, and steps aside for the public path elsewhere."""

import types

import pytest
import torch

from flashattn import _internals


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x * 2 * scale

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 * ctx.scale, None


def test_the_ci_torch_and_triton_are_tested_versions():
    # CI pins torch 2.13 and triton 3.6: the shortcuts must be what it runs, or CI tests the fallbacks only
    assert _internals.TORCH_FAST
    assert _internals.triton_fast()


def test_fast_apply_equals_function_apply():
    fast = _internals.function_apply(_Double, 1)
    assert fast is not _Double.apply
    x = torch.randn(5, requires_grad=True)
    y = fast(x, 3.0)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, _Double.apply(x, 3.0)) and torch.equal(g, torch.full_like(x, 6.0))


def test_fast_apply_takes_the_public_path_under_functorch_transforms():
    # Function.apply's own path: under vmap it needs a setup_context, which this Function has not
    fast = _internals.function_apply(_Double, 1)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(lambda x: fast(x, 2.0))(torch.randn(3, 4))


def test_untested_versions_get_the_public_paths(monkeypatch):
    monkeypatch.setattr(_internals, "TORCH_FAST", False)
    assert _internals.function_apply(_Double, 1) == _Double.apply
    monkeypatch.setattr(_internals, "TESTED_TORCH", ((1, 0), (1, 1)))
    assert not _internals._torch_fast()
    _internals.triton_fast.cache_clear()
    monkeypatch.setattr(_internals, "TESTED_TRITON", (0, 1))
    try:
        assert not _internals.triton_fast()
        public = _internals.descriptor_factory()
        t = torch.zeros(1, 64, 1, 32, dtype=torch.bfloat16)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        assert isinstance(public(t, [1, 64, 1, 32], [2048, 32, 32, 1], [1, 64, 1, 32], _layout()),
                          TensorDescriptor)
    finally:
        _internals.triton_fast.cache_clear()


def test_interpreter_casts_are_patched_on_the_tested_triton_only(monkeypatch):
    from triton.runtime import interpreter

    def wrap(original):
        def convert(*args):
            return original(*args)
        convert.flashattn_fixed = True
        return convert

    monkeypatch.setattr(interpreter, "_convert_float", lambda *args: None)
    unpatched = interpreter._convert_float
    _internals.triton_fast.cache_clear()
    monkeypatch.setattr(_internals, "TESTED_TRITON", (0, 1))
    try:
        assert not _internals.patch_interpreter_casts(wrap)
        assert interpreter._convert_float is unpatched
    finally:
        _internals.triton_fast.cache_clear()
    monkeypatch.undo()
    monkeypatch.setattr(interpreter, "_convert_float", unpatched)
    assert _internals.patch_interpreter_casts(wrap)
    patched = interpreter._convert_float
    assert patched is not unpatched and patched.flashattn_fixed
    assert _internals.patch_interpreter_casts(wrap) and interpreter._convert_float is patched  # once


def _layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([1, 64, 1, 32], gl.bfloat16)


def test_prechecked_descriptors_have_the_constructors_fields():
    # the shortcut sets the fields itself: a field a later Triton adds must show here
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.zeros(1, 64, 2, 32, dtype=torch.bfloat16)
    args = (list(t.shape), list(t.stride()), [1, 64, 1, 32], _layout())
    made = _internals.descriptor_factory()(t, *args)
    assert type(made) is TensorDescriptor and vars(made) == vars(TensorDescriptor(t, *args))


def test_direct_launch_passes_what_tritons_wrapper_passes(monkeypatch):
    # Triton 3.6's launcher wrapper around a fake C entry point: the direct launch must hand that entry point
    # the same arguments the wrapper builds from TensorDescriptor objects
    from triton.backends.nvidia import driver
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    calls = []
    signature = {"a_desc": "tensordesc<bf16[64, 32]>", "b_desc": "tensordesc<bf16[64, 32]>", "x": "*fp32",
                 "n": "i32", "BLOCK": "constexpr"}
    metas = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 64, 1, 32], fp4_padded=False)] * 2
    inner = driver.wrap_handle_tensordesc(lambda *args: calls.append(args), signature, metas)
    fills = []

    def fill(ptr, *rest):
        fills.append((ptr, rest))
        return f"map@{ptr}"

    class FakeDriver:  # what the wrapper asks of the active driver: the descriptor fill
        utils = types.SimpleNamespace(fill_tma_descriptor=fill)

    monkeypatch.setattr(driver.triton.runtime.driver, "_active", FakeDriver())
    monkeypatch.setattr(_internals, "_fill_tma_descriptor", lambda: fill)

    class Runner:
        launch, global_scratch_size, profile_scratch_size = staticmethod(inner), 0, 0
        launch_cooperative_grid, launch_pdl = False, False

    class Compiled:
        run, function, packed_metadata = Runner(), "fn", "meta"

    a, b = (torch.zeros(2, 64, 3, 32, dtype=torch.bfloat16) for _ in range(2))
    x = torch.zeros(4)
    specs = [(list(t.shape), list(t.stride())) for t in (a, b)]
    direct = _internals.direct_launch(Compiled(), tuple(specs))
    assert direct is not None
    direct((5, 1, 1), 1234, (a, b), (x, 7, 64))
    descs = [TensorDescriptor(t, *spec, [1, 64, 1, 32], _layout())
             for t, spec in zip((a, b), specs, strict=True)]
    inner(5, 1, 1, 1234, "fn", False, False, None, None, "meta", None, None, None, *descs, x, 7, 64)
    assert len(calls) == 2 and calls[0] == calls[1]
    assert fills[0] == fills[2] and fills[1] == fills[3]
    # a launcher of another shape (no descriptor handling, scratch memory): no direct launch
    Runner.global_scratch_size = 128
    assert _internals.direct_launch(Compiled(), tuple(specs)) is None
