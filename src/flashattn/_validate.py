"""Argument checks whose messages name the argument, the value received and what is expected."""

import math
import numbers

import torch

from flashattn.errors import FlashAttnError

MAX_HEADDIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# q/k/v signatures that passed check_qkv (~1 KB each); past this many the set is emptied rather than grown
# (lengths that vary from batch to batch add one each)
_PASSED_SIGNATURES = 1024
_passed: set = set()


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a torch.Tensor of layout {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise FlashAttnError(f"{name} must have {ndim} dimensions {layout}, got {t.dim()} ({_describe(t)})")
    if t.dtype not in _DTYPES:
        f64 = t.dtype == torch.float64
        hint = " (float64 is not supported on GPU; use bfloat16 or float16)" if f64 else ""
        raise FlashAttnError(
            f"{name} has dtype {t.dtype}; expected one of {', '.join(str(d) for d in _DTYPES)}{hint}"
        )
    if t.numel() == 0:
        raise FlashAttnError(f"{name} is empty ({_describe(t)}); every dimension of {layout} must be >= 1")
    if t.stride(-1) != 1:
        raise FlashAttnError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}; "
            f"call .contiguous() on it"
        )


def check_qkv(q, k, v, varlen: bool = False) -> None:
    """q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv) (varlen: without the batch dimension): same
    dtype and device, matching batch, lengths and head dims; h a multiple of h_k."""
    # every check reads only the tensors' shapes, strides, dtypes and devices: a signature that passed once
    # passes again (~1.5 us to look up against ~7 us to check). Not while torch.compile traces: the sizes
    # may be symbolic there
    key = None
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch.compiler.is_compiling()):
        key = (varlen, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device)
        if key in _passed:
            return
    _check_qkv(q, k, v, varlen)
    if key is not None:
        if len(_passed) >= _PASSED_SIGNATURES:
            _passed.clear()
        _passed.add(key)


def _check_qkv(q, k, v, varlen: bool) -> None:
    ndim = 3 if varlen else 4
    b = "" if varlen else "batch, "
    check_tensor("q", q, ndim, f"({b}{'total_q' if varlen else 'seqlen_q'}, nheads, headdim)")
    check_tensor("k", k, ndim, f"({b}{'total_k' if varlen else 'seqlen_k'}, nheads_k, headdim)")
    check_tensor("v", v, ndim, f"({b}{'total_k' if varlen else 'seqlen_k'}, nheads_k, headdim_v)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise FlashAttnError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share "
                                 "a dtype")
        if t.device != q.device:
            raise FlashAttnError(f"{name} is on {t.device} but q is on {q.device}; q, k, v must share a "
                                 "device")
        if not varlen and t.shape[0] != q.shape[0]:
            raise FlashAttnError(f"{name} has batch {t.shape[0]} but q has batch {q.shape[0]}; they must "
                                 "match")
    if k.shape[-1] != q.shape[-1]:
        raise FlashAttnError(f"k has headdim {k.shape[-1]} but q has {q.shape[-1]}; they must match")
    if v.shape[:-1] != k.shape[:-1]:
        raise FlashAttnError(
            f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match in every dimension "
            f"but the last (v may have its own head dim)"
        )
    h, hk = q.shape[-2], k.shape[-2]
    if h % hk != 0:
        raise FlashAttnError(f"k has {hk} heads but q has {h}; nheads must be a multiple of nheads_k "
                             "(GQA/MQA)")
    for name, d in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if d > MAX_HEADDIM:
            raise FlashAttnError(f"{name} has headdim {d}; headdim must be at most {MAX_HEADDIM}")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise FlashAttnError(f"{name} must be an int32 tensor of shape (batch + 1,), got "
                                 f"{type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise FlashAttnError(
                f"{name} must be an int32 tensor of shape (batch + 1,) with batch >= 1, got dtype {cu.dtype} "
                f"and shape {tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise FlashAttnError(f"{name} is on {cu.device} but q is on {q.device}; they must share a device")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise FlashAttnError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0] - 1} sequences but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0] - 1}; they must describe the same batch"
        )
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
            raise FlashAttnError(f"{name} must be an int >= 0 (the longest sequence), got {m!r}")


def check_per_head(name: str, t, nheads: int, batch: int | None, device, allow_batch: bool) -> None:
    """alibi_slopes (nheads,) or (batch, nheads) / learnable_sink (nheads,): float32 on q's device."""
    if t is None:
        return
    shapes = f"({nheads},)" + (f" or ({batch}, {nheads})" if allow_batch else "")
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a float32 tensor of shape {shapes}, got {type(t).__name__}")
    ok_shape = tuple(t.shape) == (nheads,) or (allow_batch and tuple(t.shape) == (batch, nheads))
    if t.dtype != torch.float32 or not ok_shape:
        raise FlashAttnError(f"{name} must be a float32 tensor of shape {shapes}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if t.device != device:
        raise FlashAttnError(f"{name} is on {t.device} but q is on {device}; they must share a device")
    if t.stride(-1) != 1:
        raise FlashAttnError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def check_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise FlashAttnError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise FlashAttnError(f"softmax_scale must be a finite positive number, got {softmax_scale}")


def check_window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise FlashAttnError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = window_size
    for side, w in (("left", left), ("right", right)):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
            raise FlashAttnError(
                f"window_size {side} must be an int >= -1 (-1 means unbounded), got {w!r} in {window_size!r}"
            )
    return int(left), int(right)


def check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise FlashAttnError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def check_softcap(softcap) -> None:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or softcap < 0:
        raise FlashAttnError(f"softcap must be a float >= 0 (0 disables it), got {softcap!r}")


def check_packed(name: str, t, ndim: int, axis: int, count: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a torch.Tensor of layout {layout}, got {type(t).__name__}")
    if t.dim() != ndim or t.shape[axis] != count:
        raise FlashAttnError(f"{name} must have layout {layout}, got shape {tuple(t.shape)}")
