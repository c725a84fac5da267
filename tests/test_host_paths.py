"""The host-side shortcuts of a call (NOTES v35): the environment reader, and inference without an autograd
node. Each must give what the plain path gives."""

import os

import pytest
import torch
from conftest import DEVICE

from flashattn import _env, _validate, autograd, flash_attn_func


def test_env_get_follows_every_write(monkeypatch):
    name = "FLASHATTN_TEST_ENV_READER"
    monkeypatch.delenv(name, raising=False)
    assert _env.get(name) is None and _env.get(name, "1") == "1"
    monkeypatch.setenv(name, "0")
    assert _env.get(name, "1") == "0"
    os.environ[name] = "héllo"  # non-ASCII round-trips as os.environ's own decoding does
    assert _env.get(name) == os.environ[name] == "héllo"
    monkeypatch.delenv(name)
    assert _env.get(name, "x") == "x"


def _qkv(requires_grad):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 37, 4, 32, generator=g).to(DEVICE).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad", "inference_mode"])
def test_inference_takes_no_autograd_node(backend, monkeypatch, mode):
    q, k, v = _qkv(requires_grad=mode != "inputs_without_grad")
    ref = flash_attn_func(*_qkv(requires_grad=True), causal=True).detach()

    def no_node(*args):
        raise AssertionError("an autograd node was built for a call that needs no gradient")
    monkeypatch.setattr(autograd._EagerAttention, "apply", no_node)
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
    backward = autograd._EagerAttention.backward

    def spy(ctx, dout, dlse, drng):
        seen.append((dlse, drng))
        return backward(ctx, dout, dlse, drng)
    monkeypatch.setattr(autograd._EagerAttention, "backward", staticmethod(spy))
    q, k, v = _qkv(requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out.sum().backward()
    assert seen == [(None, None)] and q.grad is not None and torch.isfinite(q.grad).all()


def test_env_snapshot_covers_every_name_read(monkeypatch):
    name = "FLASHATTN_TEST_ENV_SNAPSHOT"
    monkeypatch.setenv(name, "a")
    before = _env.snapshot()
    _env.get(name)  # a name read for the first time lengthens every later snapshot
    first = _env.snapshot()
    assert len(first) == len(before) + 1 and first[:len(before)] == before
    assert first == _env.snapshot()
    monkeypatch.setenv(name, "b")
    assert _env.snapshot() != first
    monkeypatch.delenv(name)
    assert _env.snapshot() != first


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


def test_apply_under_functorch_transforms_is_function_apply():
    # _EagerAttention.apply's own path is only for calls outside functorch transforms; under one it is
    # Function.apply's, which needs a setup_context this Function does not have
    q, k, v = _qkv(requires_grad=False)
    rest = (None, None, 37, 37, 0.1, True, -1, -1, 0.0, None, 0.0, False)

    def call(q):
        return autograd._EagerAttention.apply(q, k, v, None, rest)[0]

    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(call)(q.unsqueeze(0))
