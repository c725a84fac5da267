"""flashattn._internals: each private shortcut is used on the tested versions, gives what the public path
gives, and steps aside for the public path elsewhere."""

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
    fast = _internals.function_apply(_Double)
    assert fast is not _Double.apply
    x = torch.randn(5, requires_grad=True)
    y = fast(x, 3.0)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, _Double.apply(x, 3.0)) and torch.equal(g, torch.full_like(x, 6.0))


def test_fast_apply_takes_the_public_path_under_functorch_transforms():
    # Function.apply's own path: under vmap it needs a setup_context, which this Function has not
    fast = _internals.function_apply(_Double)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(lambda x: fast(x, 2.0))(torch.randn(3, 4))


def test_untested_versions_get_the_public_paths(monkeypatch):
    monkeypatch.setattr(_internals, "TORCH_FAST", False)
    assert _internals.function_apply(_Double) == _Double.apply
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
