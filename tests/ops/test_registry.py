"""The one op helper (flashattn.ops.registry.Op): the eager fast path gives what the registered op gives,
builds no autograd node for calls that need no gradient, and hands the backward no materialised gradient of
the outputs it does not differentiate."""

import uuid

import pytest
import torch
from utils import DEVICE

from flashattn import _validate, flash_attn_func
from flashattn.ops import attention as attention_ops
from flashattn.ops import attention_fp8, block_sparse, kvcache, merge
from flashattn.ops.registry import Op, through_registered_ops


def _qkv(requires_grad):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 37, 4, 32, generator=g).to(DEVICE).requires_grad_(requires_grad) for _ in range(3)]


def test_every_op_is_made_with_the_helper():
    ops = [attention_ops.attn_fwd, attention_ops.attn_bwd, attention_fp8.attn_fwd_fp8,
           block_sparse.block_sparse_fwd, block_sparse.block_sparse_bwd, kvcache.kvcache_fwd,
           merge.merge_states]
    assert all(isinstance(op, Op) for op in ops)
    assert {op.name for op in ops} == {
        "flashattn::attn_fwd", "flashattn::attn_bwd", "flashattn::attn_fwd_fp8",
        "flashattn::block_sparse_fwd", "flashattn::block_sparse_bwd", "flashattn::kvcache_fwd",
        "flashattn::merge_states"}


def test_the_eager_path_equals_the_registered_op(backend, monkeypatch):
    q, k, v = _qkv(requires_grad=True)
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    eager = (out, *torch.autograd.grad(out, (q, k, v), dout))
    # every call through torch.library's op and its registered autograd
    with through_registered_ops():
        out = flash_attn_func(q, k, v, causal=True)
        registered = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(eager, registered, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad", "inference_mode"])
def test_inference_takes_no_autograd_node(backend, monkeypatch, mode):
    q, k, v = _qkv(requires_grad=mode != "inputs_without_grad")
    ref = flash_attn_func(*_qkv(requires_grad=True), causal=True).detach()

    def no_node(*args):
        raise AssertionError("an autograd node was built for a call that needs no gradient")
    monkeypatch.setattr(attention_ops.attn_fwd, "_apply", no_node)
    if mode == "no_grad":
        with torch.no_grad():
            out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    elif mode == "inference_mode":
        with torch.inference_mode():
            out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    else:
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.grad_fn is None and not out.requires_grad and not lse.requires_grad
    assert torch.equal(out, ref)


def test_one_input_with_grad_gets_its_gradient(backend):
    q, k, v = _qkv(requires_grad=False)
    k.requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is not None
    (dk,) = torch.autograd.grad(out.sum(), k)
    q2, k2, v2 = _qkv(requires_grad=True)
    _, dk_all, _ = torch.autograd.grad(flash_attn_func(q2, k2, v2, causal=True).sum(), (q2, k2, v2))
    torch.testing.assert_close(dk, dk_all, rtol=0, atol=0)


def test_backward_gets_no_materialised_lse_gradient(backend, monkeypatch):
    # the engine would otherwise allocate and fill a zero tensor of the LSE's shape on every backward
    seen = []
    real = attention_ops.attn_bwd.impl

    def spy(*args):
        seen.append(args[0])
        return real(*args)
    monkeypatch.setattr(attention_ops.attn_bwd, "impl", spy)
    grads = []
    backward = attention_ops._backward

    def spy_backward(ctx, dout, dlse, drng):
        grads.append((dlse, drng))
        return backward(ctx, dout, dlse, drng)
    # a new Op whose eager Function wraps the spy
    op = Op(f"test_attn_fwd_{uuid.uuid4().hex[:12]}", attention_ops._fwd_impl, fake=attention_ops._fwd_fake)
    op.register_autograd(spy_backward, attention_ops._setup_context,
                         differentiable=("q", "k", "v", "learnable_sink"), non_differentiable_outputs=(1, 2))
    monkeypatch.setattr(attention_ops, "attn_fwd", op)
    q, k, v = _qkv(requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out.sum().backward()
    assert grads == [(None, None)] and len(seen) == 1
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_repeated_signatures_skip_the_checks_but_bad_input_still_raises(monkeypatch):
    monkeypatch.setattr(_validate, "_passed", set())
    checks = []
    real = _validate._check_qkv
    monkeypatch.setattr(_validate, "_check_qkv", lambda *args: checks.append(1) or real(*args))
    q, k, v = _qkv(requires_grad=False)
    for _ in range(3):
        _validate.check_qkv(q, k, v)
    assert len(checks) == 1
    bad = [(q, k.half(), v, "k has dtype"), (q, k[:, :, :3], v, "v has shape"), (q[0], k, v, "q must have 4"),
           (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, "contiguous last dimension")]
    for q_, k_, v_, message in bad:
        for _ in range(2):  # a signature that failed is never remembered
            with pytest.raises((TypeError, ValueError), match=message):
                _validate.check_qkv(q_, k_, v_)
    assert len(_validate._passed) == 1
    _validate.check_qkv(q, k, v, varlen=False)
    with pytest.raises(ValueError, match="q must have 3"):  # varlen: another layout, another signature
        _validate.check_qkv(q, k, v, varlen=True)
