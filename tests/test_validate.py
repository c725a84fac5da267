"""Argument validation of the public API.

Every bad input must raise ``ValueError``/``TypeError`` (never a Triton compile error, never a crash deep in a
kernel) whose message names the offending argument and the value received.  Messages are matched loosely:
the argument name as a word, and the received value in any reasonable spelling.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from utils import DEVICE, HAS_CUDA, INTERPRET

from flashattn import config as flashattn_config
from flashattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

DTYPE = torch.float16 if HAS_CUDA else torch.float32
B, S, H, D = 2, 16, 4, 32


def _t(*shape, dtype=DTYPE, device=DEVICE):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def _qkv(b=B, sq=S, sk=S, h=H, h_k=H, d=D):
    return _t(b, sq, h, d), _t(b, sk, h_k, d), _t(b, sk, h_k, d)


def _raises(fn, *patterns, exc=(ValueError, TypeError)):
    """Call ``fn``; it must raise ``exc`` with every regex in ``patterns`` found in the message."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for pat in patterns:
        assert re.search(pat, msg), f"error message lacks {pat!r}: {type(info.value).__name__}: {msg}"
    return msg


def _shape_re(*dims):
    """The shape in any of "(2, 16, 32)", "[2, 16, 32]", "torch.Size([2, 16, 32])"."""
    return r"\b" + r",\s*".join(str(x) for x in dims) + r"\b"


# --------------------------------------------------------------------------------------------- shapes/rank


def test_q_wrong_rank(backend):
    q, k, v = _qkv()
    q3 = _t(B, S, D)
    _raises(lambda: flash_attn_func(q3, k, v), r"\bq\b", r"\b3\b|" + _shape_re(B, S, D))


def test_k_wrong_rank(backend):
    q, k, v = _qkv()
    k5 = _t(B, S, 1, H, D)
    _raises(lambda: flash_attn_func(q, k5, v), r"\bk\b", r"\b5\b|" + _shape_re(B, S, 1, H, D))


def test_batch_mismatch(backend):
    q, _, _ = _qkv()
    _, k, v = _qkv(b=3)
    _raises(lambda: flash_attn_func(q, k, v), r"\bk\b", r"\b3\b")


def test_headdim_mismatch_k(backend):
    q, _, v = _qkv()
    k = _t(B, S, H, 48)
    _raises(lambda: flash_attn_func(q, k, v), r"\bk\b", r"\b48\b")


def test_headdim_v_too_large(backend):
    q, k, _ = _qkv()  # v may have its own head dim, but at most 256
    v = _t(B, S, H, 300)
    _raises(lambda: flash_attn_func(q, k, v), r"\bv\b", r"\b300\b", r"\b256\b")


def test_kv_seqlen_mismatch(backend):
    q, k, _ = _qkv()
    v = _t(B, S + 4, H, D)
    _raises(lambda: flash_attn_func(q, k, v), r"\bv\b", rf"\b{S + 4}\b")


def test_kv_heads_mismatch(backend):
    q, k, _ = _qkv()
    v = _t(B, S, 2, D)
    _raises(lambda: flash_attn_func(q, k, v), r"\bv\b", r"\b2\b")


def test_nheads_not_multiple_of_nheads_k(backend):
    q, k, v = _qkv(h=16, h_k=6)
    _raises(lambda: flash_attn_func(q, k, v), r"\bk\b", r"\b6\b", r"\b16\b")


@pytest.mark.parametrize("d", [257, 512])
def test_headdim_too_large(backend, d):
    q, k, v = _qkv(b=1, sq=4, sk=4, h=1, h_k=1, d=d)
    _raises(lambda: flash_attn_func(q, k, v), rf"\b{d}\b", r"\b256\b")


# ------------------------------------------------------------------------------------------- dtype/device


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_dtype(backend, dtype):
    q, k, v = (torch.ones(B, S, H, D, dtype=dtype, device=DEVICE) for _ in range(3))
    name = str(dtype).replace("torch.", "")
    _raises(lambda: flash_attn_func(q, k, v), r"\bq\b", rf"\b{name}\b")


def test_dtype_mismatch(backend):
    q, k, v = _qkv()
    other = torch.float32 if DTYPE != torch.float32 else torch.float16
    k = k.to(other)
    received = r"float16|half|fp16" if other == torch.float16 else r"float32|fp32|\bfloat\b"
    _raises(lambda: flash_attn_func(q, k, v), r"\bk\b", received)


def test_device_mismatch(backend):
    q, k, v = _qkv()
    v = torch.empty(B, S, H, D, dtype=DTYPE, device="meta")
    _raises(lambda: flash_attn_func(q, k, v), r"\bv\b", r"\bmeta\b")


@pytest.mark.gpu
def test_float64_rejected_on_gpu():
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64, device="cuda") for _ in range(3))
    _raises(lambda: flash_attn_func(q, k, v), r"\bq\b", r"float64|double")


# ---------------------------------------------------------------------------------------------- empties


@pytest.mark.parametrize(
    "which, shape",
    [("q", (B, S, 0, D)), ("q", (B, S, H, 0))],
    ids=["nheads0", "headdim0"],
)
def test_empty_heads_or_headdim(backend, which, shape):
    q, k, v = _t(*shape), _t(B, S, shape[2], shape[3]), _t(B, S, shape[2], shape[3])
    _raises(lambda: flash_attn_func(q, k, v), rf"\b{which}\b", r"\b0\b|empty")


@pytest.mark.parametrize(
    "b, sq, sk", [(0, S, S), (B, 0, S), (B, S, 0), (0, 0, 0)],
    ids=["batch0", "seqlen_q0", "seqlen_k0", "all0"],
)
def test_empty_batch_or_sequence_gives_empty_outputs(backend, b, sq, sk):
    # SDPA's convention: empty in, empty out (no rows: nothing to attend; no keys: out 0, lse +inf, as any
    # row that sees no key), and zero gradients
    q = _t(b, sq, H, D).requires_grad_(True)
    k, v = _t(b, sk, H // 2, D).requires_grad_(True), _t(b, sk, H // 2, 24).requires_grad_(True)
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (b, sq, H, 24) and lse.shape == (b, H, sq) and s_dmask.shape == (0,)
    assert (out == 0).all() and torch.isposinf(lse).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=False)
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and (g == 0).all()
    out_d, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert out_d.shape == out.shape and s_dmask.shape == (b, H, -(-sq // 128) * 128, -(-sk // 128) * 128)


# ---------------------------------------------------------------------------------------------- strides


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_last_dim_not_contiguous(backend, which):
    q, k, v = _qkv()
    bad = _t(B, S, H, 2 * D)[..., ::2]
    assert bad.stride(-1) == 2
    args = {"q": q, "k": k, "v": v}
    args[which] = bad
    _raises(lambda: flash_attn_func(**args), rf"\b{which}\b", r"contiguous|stride")


# ------------------------------------------------------------------------------------------- non-tensors


def test_q_not_a_tensor(backend):
    _, k, v = _qkv()
    q = [[[[0.0] * D] * H] * S] * B
    _raises(lambda: flash_attn_func(q, k, v), r"\bq\b", r"\blist\b", exc=TypeError)


def test_k_numpy_array(backend):
    q, _, v = _qkv()
    k = np.zeros((B, S, H, D), dtype=np.float32)
    _raises(lambda: flash_attn_func(q, k, v), r"\bk\b", r"ndarray|numpy", exc=TypeError)


def test_v_none(backend):
    q, k, _ = _qkv()
    _raises(lambda: flash_attn_func(q, k, None), r"\bv\b", r"None", exc=TypeError)


# ----------------------------------------------------------------------------------------- other options


@pytest.mark.parametrize(
    "scale, received", [("abc", r"abc|\bstr\b"), ([1.0], r"\[1\.0\]|\blist\b")], ids=["str", "list"]
)
def test_softmax_scale_not_a_number(backend, scale, received):
    q, k, v = _qkv()
    _raises(lambda: flash_attn_func(q, k, v, softmax_scale=scale), r"softmax_scale", received)


@pytest.mark.parametrize(
    "window, received",
    [((1, 2, 3), _shape_re(1, 2, 3)), (5, r"\b5\b"), ((4,), r"\b4\b"), ("ab", r"ab|\bstr\b")],
    ids=["triple", "int", "single", "str"],
)
def test_window_size_not_a_pair(backend, window, received):
    q, k, v = _qkv()
    _raises(lambda: flash_attn_func(q, k, v, window_size=window), r"window_size", received)


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1])
def test_dropout_p_out_of_range(backend, p):
    q, k, v = _qkv()
    _raises(lambda: flash_attn_func(q, k, v, dropout_p=p), r"dropout_p", re.escape(str(p)))


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (-7, -100)], ids=["left", "right", "both"])
def test_window_size_below_minus_one_is_unbounded(backend, window):
    # flash_attn treats every negative side as unbounded
    q, k, v = _qkv()
    same = tuple(-1 if w < 0 else w for w in window)
    want = flash_attn_func(q, k, v, window_size=same)
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), want)


@pytest.mark.parametrize("form", ["list", "tensor", "tensor_items", "numpy"])
def test_window_size_as_list_or_tensor(backend, form):
    # flash_attn's tests (and some user code) pass torch.randint(0, seqlen, (2,)): a 2-element int64 tensor
    q, k, v = _qkv()
    window = {"list": [3, 2], "tensor": torch.tensor([3, 2]), "tensor_items": tuple(torch.tensor([3, 2])),
              "numpy": tuple(np.array([3, 2]))}[form]
    want = flash_attn_func(q, k, v, window_size=(3, 2))
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), want)


@pytest.mark.parametrize(
    "window, received",
    [(torch.tensor([1.0, 2.0]), r"float"), (torch.tensor([1, 2, 3]), _shape_re(3)), ((1.5, 2), r"1\.5")],
    ids=["float_tensor", "three", "float_item"],
)
def test_window_size_bad_tensor(backend, window, received):
    q, k, v = _qkv()
    _raises(lambda: flash_attn_func(q, k, v, window_size=window), r"window_size", received)


def test_softcap_negative(backend):
    q, k, v = _qkv()
    _raises(lambda: flash_attn_func(q, k, v, softcap=-1.0), r"softcap", r"-1")


@pytest.mark.parametrize(
    "shape, dtype, received",
    [
        ((H + 1,), torch.float32, rf"\b{H + 1}\b"),
        ((B, H), torch.float16, r"float16|half"),
        ((3, B, H), torch.float32, r"\b3\b"),
    ],
    ids=["wrong-heads", "fp16", "3d"],
)
def test_alibi_slopes_bad(backend, shape, dtype, received):
    q, k, v = _qkv()
    slopes = torch.rand(*shape, device=DEVICE).to(dtype)
    _raises(lambda: flash_attn_func(q, k, v, alibi_slopes=slopes), r"alibi_slopes", received)


def test_unknown_backend(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", None)
    _raises(lambda: flashattn_config.set_backend("bogus"), r"FLASHATTN_BACKEND", r"bogus", r"triton|torch")
    assert flashattn_config.backend is None


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="needs a machine without CUDA, not under TRITON_INTERPRET")
def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    q, k, v = _qkv()
    _raises(lambda: flash_attn_func(q, k, v), r"TRITON_INTERPRET|CUDA|cuda", exc=(ValueError, RuntimeError))


# ------------------------------------------------------------------------------------------ packed forms


def test_qkvpacked_wrong_rank(backend):
    qkv = _t(B, S, 3 * H, D)
    _raises(lambda: flash_attn_qkvpacked_func(qkv), r"\bqkv\b", r"\b4\b|" + _shape_re(B, S, 3 * H, D))


def test_qkvpacked_wrong_pack_dim(backend):
    qkv = _t(B, S, 2, H, D)
    _raises(lambda: flash_attn_qkvpacked_func(qkv), r"\bqkv\b", r"\b2\b")


def test_kvpacked_wrong_pack_dim(backend):
    q = _t(B, S, H, D)
    kv = _t(B, S, 3, H, D)
    _raises(lambda: flash_attn_kvpacked_func(q, kv), r"\bkv\b", r"\b3\b")


def test_kvpacked_batch_mismatch(backend):
    q = _t(B, S, H, D)
    kv = _t(B + 1, S, 2, H, D)
    _raises(lambda: flash_attn_kvpacked_func(q, kv), r"\bkv\b|\bk\b", rf"\b{B + 1}\b")


def test_kvpacked_gqa_not_divisible(backend):
    q = _t(B, S, 16, D)
    kv = _t(B, S, 2, 6, D)
    _raises(lambda: flash_attn_kvpacked_func(q, kv), r"\bkv\b|\bk\b", r"\b6\b")


def test_every_bad_argument_raises_the_one_error_class():
    # code written against flash_attn catches RuntimeError; Python code catches ValueError or TypeError
    from flashattn.errors import FlashAttnError

    q, k, v = _qkv()
    for call in (lambda: flash_attn_func(q, k.half() if q.dtype != torch.float16 else k.float(), v),
                 lambda: flash_attn_func(q, k, v, window_size=(0.5, 0)),
                 lambda: flash_attn_func(q, k, v, softmax_scale="x")):
        with pytest.raises(FlashAttnError) as info:
            call()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
