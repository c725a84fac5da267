"""Launchers for the Triton attention kernels: allocate outputs, check strides, pick tiles and grid.

Pure functions (tensors in, tensors out, no autograd): tests, benchmarks and the CLI call them directly.
Shapes: q (b, sq, h, d), k/v (b, sk, h_k, d); any strides with a contiguous last dim.
"""

import math

import torch
import triton

from flashattn.kernels.attn_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from flashattn.kernels.attn_fwd import attn_fwd_kernel
from flashattn.ops.configs import tile_config

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels take exp2, so the softmax scale absorbs it
_INT32_MAX = 2**31 - 1


def _block_d(d: int) -> int:
    # tl.dot needs K >= 16; non-powers of two are padded and masked
    return max(16, triton.next_power_of_2(d))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (tf32 would be a 1e-3 error that no fp32 user expects)
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_offsets(name: str, t: torch.Tensor) -> None:
    # in-sequence offsets (row · row stride) are 32-bit in the kernels; batch and head offsets are 64-bit
    if t.shape[1] * t.stride(1) > _INT32_MAX:
        raise ValueError(
            f"{name} has seqlen {t.shape[1]} with row stride {t.stride(1)}: in-sequence offsets exceed 2^31 "
            f"elements; split the sequence or use a layout with a smaller row stride"
        )


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _unsupported(window_size, softcap, alibi_slopes) -> None:
    if tuple(window_size) != (-1, -1) or softcap != 0.0 or alibi_slopes is not None:
        raise NotImplementedError(
            "window_size, softcap and alibi_slopes are not implemented yet in the Triton kernels "
            "(they come with issue 7, training features)"
        )


def attention_forward(q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None):
    """out (b, sq, h, d) in q's dtype and lse (b, h, sq) float32 natural log (+inf: row saw no key)."""
    _unsupported(window_size, softcap, alibi_slopes)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_offsets(name, t)
    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    block_d = _block_d(d)
    cfg = tile_config("fwd", block_d, q.device)
    grid = (triton.cdiv(sq, cfg.block_m), b * h)
    attn_fwd_kernel[grid](
        q, k, v, out, lse,
        *_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(out),
        h, sq, sk, softmax_scale * LOG2E,
        GROUP=h // hk, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False):
    """Returns dq, dk, dv shaped like q, k, v (dk/dv summed over each GQA group).

    Deterministic whatever `deterministic` says: no atomics, every gradient element is written by one program.
    """
    del deterministic
    _unsupported(window_size, softcap, alibi_slopes)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        _check_offsets(name, t)
    dq = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, sk, hk, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, sk, hk, d), dtype=v.dtype, device=v.device)
    delta = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    block_d = _block_d(d)
    qk_scale = softmax_scale * LOG2E
    common = dict(GROUP=h // hk, HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype))

    pre_m = 64 if q.device.type == "cuda" else 32
    attn_bwd_preprocess_kernel[(triton.cdiv(sq, pre_m), b * h)](
        out, dout, delta, *_row_strides(out), *_row_strides(dout), h, sq,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_m,
    )
    cfg = tile_config("dkdv", block_d, q.device)
    attn_bwd_dkdv_kernel[(triton.cdiv(sk, cfg.block_n), b * hk)](
        q, k, v, dout, lse, delta, dk, dv,
        *_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(dout),
        *_row_strides(dk), *_row_strides(dv),
        h, hk, sq, sk, qk_scale, softmax_scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    cfg = tile_config("dq", block_d, q.device)
    attn_bwd_dq_kernel[(triton.cdiv(sq, cfg.block_m), b * h)](
        q, k, v, dout, lse, delta, dq,
        *_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(dout), *_row_strides(dq),
        h, sq, sk, qk_scale, softmax_scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq, dk, dv


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
