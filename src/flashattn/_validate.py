"""Argument checks whose messages name the argument, the value received and what is expected."""

import math
import numbers

import torch

from flashattn import config
from flashattn.errors import FlashAttnError

MAX_HEADDIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)  # the FP8 (inference) calls' q, k, v
# q/k/v signatures that passed check_qkv (~1 KB each); past this many the set is emptied rather than grown
# (lengths that vary from batch to batch add one each)
_PASSED_SIGNATURES = 1024
_passed: set = set()


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t, ndim: int, layout: str, may_be_empty: tuple[int, ...] = (),
                 dtypes: tuple = _DTYPES, contiguous_dim: int | None = None) -> None:
    """t: a tensor of ndim dimensions in one of `dtypes` with a contiguous last dimension (or, when given,
    a contiguous dimension `contiguous_dim` instead). may_be_empty: the dimensions that may be 0 (batch and
    sequence axes: an empty batch gives empty outputs); every other dimension must be >= 1."""
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a torch.Tensor of layout {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise FlashAttnError(f"{name} must have {ndim} dimensions {layout}, got {t.dim()} ({_describe(t)})")
    if t.dtype not in dtypes:
        f64 = t.dtype == torch.float64
        hint = " (float64 is not supported on GPU; use bfloat16 or float16)" if f64 else ""
        raise FlashAttnError(
            f"{name} has dtype {t.dtype}; expected one of {', '.join(str(d) for d in dtypes)}{hint}"
        )
    for axis, size in enumerate(t.shape):
        if size == 0 and axis not in may_be_empty:
            raise FlashAttnError(
                f"{name} is empty in dimension {axis} ({_describe(t)}); in {layout} only the batch and "
                f"sequence dimensions may be 0"
            )
    # a dimension of size 1 has no stride to speak of (only element 0 is read)
    if contiguous_dim is not None and (t.shape[contiguous_dim] <= 1 or t.stride(contiguous_dim) == 1):
        return
    if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise FlashAttnError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}; "
            f"call .contiguous() on it"
        )


def check_qkv(q, k, v, varlen: bool = False, fp8: bool = False) -> None:
    """q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv) (varlen: without the batch dimension): same
    dtype and device, matching batch, lengths and head dims; h a multiple of h_k. fp8: the dtype is e4m3,
    and v may have its seqlen dim contiguous instead of its last."""
    # every check reads only the tensors' shapes, strides, dtypes and devices: a signature that passed once
    # passes again (~1.5 us to look up against ~7 us to check). Not while torch.compile traces: the sizes
    # may be symbolic there
    key = None
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch.compiler.is_compiling()):
        key = (varlen, fp8, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device)
        if key in _passed:
            return
    _check_qkv(q, k, v, varlen, fp8)
    if key is not None:
        if len(_passed) >= _PASSED_SIGNATURES:
            _passed.clear()
        _passed.add(key)


def _check_qkv(q, k, v, varlen: bool, fp8: bool) -> None:
    ndim = 3 if varlen else 4
    b = "" if varlen else "batch, "
    empty = (0,) if varlen else (0, 1)
    dtypes = FP8_DTYPES if fp8 else _DTYPES
    sq, sk = ("total_q", "total_k") if varlen else ("seqlen_q", "seqlen_k")
    check_tensor("q", q, ndim, f"({b}{sq}, nheads, headdim)", empty, dtypes)
    check_tensor("k", k, ndim, f"({b}{sk}, nheads_k, headdim)", empty, dtypes)
    check_tensor("v", v, ndim, f"({b}{sk}, nheads_k, headdim_v)", empty, dtypes,
                 (0 if varlen else 1) if fp8 else None)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise FlashAttnError(
                f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype")
        if t.device != q.device:
            raise FlashAttnError(
                f"{name} is on {t.device} but q is on {q.device}; q, k, v must share a device")
        if not varlen and t.shape[0] != q.shape[0]:
            raise FlashAttnError(
                f"{name} has batch {t.shape[0]} but q has batch {q.shape[0]}; they must match")
    if k.shape[-1] != q.shape[-1]:
        raise FlashAttnError(f"k has headdim {k.shape[-1]} but q has {q.shape[-1]}; they must match")
    if v.shape[:-1] != k.shape[:-1]:
        raise FlashAttnError(
            f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match in every dimension "
            f"but the last (v may have its own head dim)"
        )
    h, hk = q.shape[-2], k.shape[-2]
    if h % hk != 0:
        raise FlashAttnError(
            f"k has {hk} heads but q has {h}; nheads must be a multiple of nheads_k (GQA/MQA)")
    for name, d in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if d > MAX_HEADDIM:
            raise FlashAttnError(f"{name} has headdim {d}; headdim must be at most {MAX_HEADDIM}")


def check_cu_seqlens_shapes(cu_seqlens_q, cu_seqlens_k, q) -> int:
    """cu_seqlens_q / cu_seqlens_k from their metadata alone: int32, 1-D, (batch + 1,) with the same batch,
    contiguous, on q's device. Returns batch."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise FlashAttnError(
                f"{name} must be an int32 tensor of shape (batch + 1,), got {type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise FlashAttnError(
                f"{name} must be an int32 tensor of shape (batch + 1,), got dtype {cu.dtype} and shape "
                f"{tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise FlashAttnError(f"{name} is on {cu.device} but q is on {q.device}; they must share a device")
        if cu.stride(0) != 1 and cu.shape[0] > 1:
            raise FlashAttnError(f"{name} must be contiguous, got stride {cu.stride(0)}; call .contiguous()")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise FlashAttnError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0] - 1} sequences but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0] - 1}; they must describe the same batch"
        )
    return cu_seqlens_q.shape[0] - 1


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k) -> tuple[int, int]:
    """The varlen arguments, per argument (docs/compat.md, "What is checked"):

    cu_seqlens_q / cu_seqlens_k: always on the host, from their metadata (check_cu_seqlens_shapes). Their
        values (first 0, non-decreasing, last <= the tokens of q / k) are checked when they live in host
        memory (CPU tensors: reading them needs no device sync) or when flashattn.config.check_varlen is on
        (one device-to-host copy per call). Unchecked, the kernels clamp every row they derive from them
        into [0, tokens), so a bad value gives wrong rows, never an access out of bounds.
    max_seqlen_q / max_seqlen_k: ints >= 0, always; >= every sequence's length when the values are checked
        (else the rows past max_seqlen of a longer sequence are not computed).

    k None: paged keys, whose bound is the block table's (flashattn.paged). Returns (max_seqlen_q,
    max_seqlen_k) as ints.
    """
    check_cu_seqlens_shapes(cu_seqlens_q, cu_seqlens_k, q)
    maxima = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, torch.Tensor) and m.numel() == 1 and not m.dtype.is_floating_point:
            m = int(m)  # flash_attn's callers sometimes pass a 0-d tensor
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
            raise FlashAttnError(f"{name} must be an int >= 0 (the longest sequence), got {m!r}")
        maxima.append(int(m))
    if values_checked(cu_seqlens_q):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], None if k is None else k.shape[0],
                                *maxima)
    return maxima[0], maxima[1]


def values_checked(cu: torch.Tensor) -> bool:
    """Whether check_cu_seqlens reads the values of cu_seqlens like cu: always in host memory, on a device
    when flashattn.config.check_varlen asks for it (and no CUDA graph is being captured, where a
    device-to-host copy is illegal); never while torch.compile traces, where they are data-dependent."""
    if torch.compiler.is_compiling():
        return False
    if cu.device.type == "cpu":
        return True
    return config.check_varlen and not (cu.is_cuda and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int | None,
                            max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The values of both cu_seqlens (one device-to-host copy): first 0, non-decreasing, last <= the
    tokens of the packed tensor (total_k None: no bound, paged keys), each length <= max_seqlen."""
    both = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist() if cu_seqlens_q.numel() else [[], []]
    for (name, total, mname, m), cu in zip(
        (("cu_seqlens_q", total_q, "max_seqlen_q", max_seqlen_q),
         ("cu_seqlens_k", total_k, "max_seqlen_k", max_seqlen_k)), both, strict=True):
        shown = cu if len(cu) <= 8 else f"[{cu[0]}, {cu[1]}, ..., {cu[-1]}] ({len(cu)} entries)"
        if cu[0] != 0:
            raise FlashAttnError(f"{name}[0] is {cu[0]} in {name}={shown}; expected 0")
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        for i, n in enumerate(lengths):
            if n < 0:
                raise FlashAttnError(
                    f"{name} decreases at index {i + 1} ({cu[i]} -> {cu[i + 1]}) in {name}={shown}; expected "
                    f"non-decreasing offsets"
                )
        if total is not None and cu[-1] > total:
            raise FlashAttnError(
                f"{name}[-1] is {cu[-1]} in {name}={shown} but the packed tensor has {total} tokens; "
                f"expected {name}[-1] <= {total}"
            )
        longest = max(lengths, default=0)
        if longest > m:
            raise FlashAttnError(
                f"{mname} is {m} but sequence {lengths.index(longest)} of {name} has {longest} tokens; "
                f"expected {mname} >= the longest sequence"
            )


def check_per_head(name: str, t, nheads: int, batch: int | None, device, allow_batch: bool) -> None:
    """alibi_slopes (nheads,) or (batch, nheads) / learnable_sink (nheads,): float32 on q's device."""
    if t is None:
        return
    shapes = f"({nheads},)" + (f" or ({batch}, {nheads})" if allow_batch else "")
    if not isinstance(t, torch.Tensor):
        raise FlashAttnError(f"{name} must be a float32 tensor of shape {shapes}, got {type(t).__name__}")
    ok_shape = tuple(t.shape) == (nheads,) or (allow_batch and tuple(t.shape) == (batch, nheads))
    if t.dtype != torch.float32 or not ok_shape:
        raise FlashAttnError(
            f"{name} must be a float32 tensor of shape {shapes}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise FlashAttnError(f"{name} is on {t.device} but q is on {device}; they must share a device")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise FlashAttnError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def check_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise FlashAttnError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise FlashAttnError(f"softmax_scale must be a finite positive number, got {softmax_scale}")


def _window_side(w, side: str, window_size) -> int:
    integer_tensor = isinstance(w, torch.Tensor) and not (w.dtype.is_floating_point or w.dtype == torch.bool)
    if integer_tensor and w.numel() == 1:
        w = int(w)
    if isinstance(w, bool) or not isinstance(w, numbers.Integral):
        raise FlashAttnError(
            f"window_size {side} must be an int >= -1 (or any negative int: every negative value means "
            f"unbounded), got {w!r} in {window_size!r}"
        )
    return max(int(w), -1)


def check_window(window_size) -> tuple[int, int]:
    """(left, right) as ints from a tuple, a list or a 2-element integer tensor; a negative side is unbounded
    and comes back as -1 (flash_attn treats every value below 0 so)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.dtype.is_floating_point or window_size.dtype == torch.bool:
            raise FlashAttnError(
                f"window_size must be a pair (left, right) of ints, got a tensor of shape "
                f"{tuple(window_size.shape)} and dtype {window_size.dtype}"
            )
        window_size = window_size.reshape(2).tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise FlashAttnError(f"window_size must be a pair (left, right), got {window_size!r}")
    return (_window_side(window_size[0], "left", window_size),
            _window_side(window_size[1], "right", window_size))


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
