"""Argument checks of the distributed entry points: messages name the argument, the value received and what
is expected. Local checks run before any communication, so a bad argument fails on its rank at once; the
cross-rank check (:func:`flashattn.distributed._comm.check_same`) then compares the ranks' shapes and options.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch

from flashattn.errors import FlashAttnError

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256
METHODS = ("ring", "ulysses", "hybrid")


def _describe(t) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise FlashAttnError(f"{name} must have {ndim} dimensions {layout}, got {t.dim()} ({_describe(t)})")
    if t.dtype not in _DTYPES:
        raise FlashAttnError(f"{name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
    if t.stride(-1) != 1:
        raise FlashAttnError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def qkv(q, k, v, varlen: bool = False) -> None:
    tok = "total" if varlen else "batch, seqlen_local"
    tensor("q", q, 3 if varlen else 4, f"({tok}, nheads, headdim)")
    tensor("k", k, 3 if varlen else 4, f"({tok}, nheads_k, headdim)")
    tensor("v", v, 3 if varlen else 4, f"({tok}, nheads_k, headdim_v)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise FlashAttnError(f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; "
                                 "they must "
                                 f"match")
    if not varlen and not (k.shape[0] == v.shape[0] == q.shape[0]):
        raise FlashAttnError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise FlashAttnError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match in all but the head dim")
    if varlen and k.shape[0] != q.shape[0]:
        raise FlashAttnError(f"q has {q.shape[0]} local tokens but k has {k.shape[0]}; varlen self-attention "
                             f"shards q, k and v alike")
    if k.shape[-1] != q.shape[-1]:
        raise FlashAttnError(f"k has headdim {k.shape[-1]} but q has {q.shape[-1]}; they must match")
    h, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or h % hk != 0:
        raise FlashAttnError(f"k has {hk} heads but q has {h}; nheads must be a multiple of nheads_k "
                             "(GQA/MQA)")
    for name, d in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if not 1 <= d <= MAX_HEADDIM:
            raise FlashAttnError(f"{name} has headdim {d}; expected 1..{MAX_HEADDIM}")


def scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise FlashAttnError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise FlashAttnError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    return float(softmax_scale)


def window(window_size) -> tuple[int, int]:
    """(left, right) ints; any negative value means unbounded (returned as -1)."""
    if isinstance(window_size, torch.Tensor):
        window_size = window_size.tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise FlashAttnError(f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size, strict=True):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise FlashAttnError(f"window_size {side} must be an int (-1: unbounded), got {w!r}")
        out.append(max(int(w), -1))
    return out[0], out[1]


def softcap(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise FlashAttnError(f"softcap must be a float >= 0 (0 = off), got {value!r}")
    return float(value)


def per_head(name: str, t, nheads: int, batch: int | None, device) -> None:
    """alibi_slopes (nheads,) / (batch, nheads) or learnable_sink (nheads,), float32 on q's device."""
    if t is None:
        return
    shapes = f"({nheads},)" + (f" or ({batch}, {nheads})" if batch is not None else "")
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a float32 tensor of shape {shapes}, got {type(t).__name__}")
    ok = tuple(t.shape) == (nheads,) or (batch is not None and tuple(t.shape) == (batch, nheads))
    if t.dtype != torch.float32 or not ok:
        raise FlashAttnError(f"{name} must be a float32 tensor of shape {shapes}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if t.device != device:
        raise FlashAttnError(f"{name} is on {t.device} but q is on {device}; they must share a device")


def method(value) -> str:
    if value not in METHODS:
        raise FlashAttnError(f"method={value!r}; expected one of {', '.join(repr(m) for m in METHODS)}")
    return value


def float_bits(x: float) -> int:
    """An int64 that is equal on two ranks iff the floats are (for the cross-rank comparison)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def dtype_code(dtype) -> int:
    return _DTYPE_CODES[dtype]
