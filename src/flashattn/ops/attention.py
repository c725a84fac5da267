"""Launchers for the Triton attention kernels: allocate outputs, check strides, pick tiles and grid.

Pure functions (tensors in, tensors out, no autograd): tests, benchmarks and the CLI call them directly.
Padded layout: q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv), lse (b, h, sq).
Varlen layout (cu_seqlens_q/k given): q (total_q, h, d), k/v (total_k, h_k, ·), lse (h, total_q).
Any strides with a contiguous last dim.
"""

import math
import os
from dataclasses import dataclass

import torch

from flashattn.kernels.attn_bwd import (
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_preprocess_kernel,
    dq_from_acc_kernel,
)
from flashattn.kernels.attn_fwd import attn_fwd_kernel
from flashattn.ops import host, tma
from flashattn.ops.configs import TileConfig, tile_config

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels take exp2, so the softmax scale absorbs it
_INT32_MAX = 2**31 - 1
# the atomic-dQ backward's float32 accumulator holds at most this many bytes: larger problems run their kv
# heads in chunks, so that at N = 128K (b = 1, h = 16, d = 128) the forward+backward peak stays within issue
# 3's 2.2 GiB (outputs and gradients take 2.0; a whole accumulator would add 1 GiB)
_DQ_ACC_BYTES = 128 * 2**20


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class _Problem:
    """Everything the three kernels share, derived once from the arguments."""

    varlen: bool
    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int  # padded length, or max_seqlen_q for varlen
    seqlen_k: int
    d: int
    dv: int
    scalars: tuple  # qk_scale, cap_in, cap_out, left, right, dropout_p, rng_seed, rng_offset
    flags: dict

    @property
    def longest(self) -> int:
        """The longer padded sequence: picks the short-sequence tile rows (ops/configs.py)."""
        return max(self.seqlen_q, self.seqlen_k)

    def rows(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, row, head) strides of a q/k/v/o-like tensor in this layout."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))

    def descriptors(self, cfg: TileConfig, block_rows: int, *tensors: torch.Tensor) -> tuple[bool, list]:
        """(USE_TMA, one descriptor per streamed tensor, or None each when the pointer path runs)."""
        # d = 128 only: in one H200 run (results/h200-2026-11-29-s3/train) descriptors gave the d = 128
        # backward +1-3% over pointer loads, but cost d = 64 7-10% (forward and backward, N >= 4K); d = 256
        # configs pipeline over 2 stages, and the ptxas of Triton 3.6 crashes (SIGSEGV) on descriptor loads
        # pipelined over 2 stages (scripts/sm90_compile_check.py), which FLASHATTN_CONFIG could also ask for
        if self.d != 128 or self.dv != 128 or cfg.num_stages < 3:
            return False, [None] * len(tensors)
        if tma.usable(*tensors, varlen=self.varlen):
            return True, [tma.descriptor(t, block_rows) for t in tensors]
        return False, [None] * len(tensors)


def _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
             rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> _Problem:
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        h, d = q.shape[1], q.shape[2]
        hk = k.shape[1]
        sq, sk = int(max_seqlen_q), int(max_seqlen_k)
    else:
        batch, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
    for name, t, n in (("q", q, sq), ("k", k, sk), ("v", v, sk)):
        # in-sequence offsets (row · row stride) are 32-bit in the kernels; batch/head/start ones 64-bit
        row_stride = t.stride(0) if varlen else t.stride(1)
        if n * row_stride > _INT32_MAX:
            raise ValueError(
                f"{name} has seqlen {n} with row stride {row_stride}: in-sequence offsets exceed 2^31 "
                f"elements; split the sequence or use a layout with a smaller row stride"
            )
    left, right = window_size
    if causal:
        right = 0
    scalars = (
        softmax_scale * LOG2E,
        softmax_scale / softcap if softcap > 0 else 0.0,
        softcap * LOG2E,
        left, right, float(dropout_p), int(rng_seed), int(rng_offset),
    )
    flags = dict(
        GROUP=h // hk, HEAD_DIM=d, HEAD_DIM_V=v.shape[-1], BLOCK_D=host.block_d(d),
        BLOCK_DV=host.block_d(v.shape[-1]),
        IS_VARLEN=varlen, WINDOW_LEFT=left >= 0, WINDOW_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_DROPOUT=dropout_p > 0,
        DOT_PREC=host.dot_precision(q.dtype),
    )
    return _Problem(varlen, batch, h, hk, sq, sk, d, v.shape[-1], scalars, flags)


def _alibi_args(alibi_slopes, dummy):
    if alibi_slopes is None:
        return dummy, 0
    return alibi_slopes, (alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)


def attention_forward(q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0, learnable_sink=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """out (like q, with v's head dim, q's dtype) and lse float32 natural log (+inf: the row saw no key)."""
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = torch.empty((*q.shape[:-1], pb.dv), dtype=q.dtype, device=q.device)
    lse_shape = (pb.nheads, q.shape[0]) if pb.varlen else (pb.batch, pb.nheads, pb.seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    cfg = tile_config("fwd", max(pb.flags["BLOCK_D"], pb.flags["BLOCK_DV"]), q.device, pb.longest)
    grid = (host.cdiv(pb.seqlen_q, cfg.block_m), pb.batch * pb.nheads)
    use_tma, descs = pb.descriptors(cfg, cfg.block_n, k, v)
    attn_fwd_kernel[grid](
        q, k, v, out, lse,
        cu_seqlens_q if pb.varlen else q, cu_seqlens_k if pb.varlen else q, alibi,
        learnable_sink if learnable_sink is not None else q, *descs,
        *pb.rows(q), *pb.rows(k), *pb.rows(v), *pb.rows(out), *pb.lse_strides(lse), stride_alibi,
        pb.nheads, pb.seqlen_q, pb.seqlen_k, pb.seqlen_q, pb.seqlen_k, *pb.scalars,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SINK=learnable_sink is not None, USE_TMA=use_tma,
        **pb.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def atomic_dq(deterministic: bool, has_sink: bool) -> bool:
    """Whether the backward adds dQ with float32 atomics inside the dK/dV kernel (5 matmuls per tile pair,
    like flash_attn's default backward) rather than in a second kernel that recomputes S and dP (7 matmuls,
    bitwise reproducible). `deterministic=True` and learnable sinks (whose gradient the dQ kernel computes)
    take the second kernel; `FLASHATTN_ATOMIC_DQ=0` forces it (A/B timing)."""
    return not deterministic and not has_sink and os.environ.get("FLASHATTN_ATOMIC_DQ", "1") != "0"


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0,
                       learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, deterministic=False):
    """dq, dk, dv shaped like q, k, v (dk/dv summed over each GQA group), and dsink ((h,) float32 or None).

    `deterministic=False` (flash_attn's default): dQ is summed with float32 atomics, so its last bits may
    vary from run to run (dK, dV never do); True: every gradient element is written by one program.
    """
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty_like(lse)
    cu_q = cu_seqlens_q if pb.varlen else q
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    flags = pb.flags

    pre_m = 64 if q.device.type == "cuda" else 32
    attn_bwd_preprocess_kernel[(host.cdiv(pb.seqlen_q, pre_m), pb.batch * pb.nheads)](
        out, dout, delta, cu_q, *pb.rows(out), *pb.rows(dout), *pb.lse_strides(lse), pb.nheads, pb.seqlen_q,
        HEAD_DIM_V=pb.dv, BLOCK_DV=flags["BLOCK_DV"], BLOCK_M=pre_m, IS_VARLEN=pb.varlen,
    )
    cu_k = cu_seqlens_k if pb.varlen else q
    args = _BwdArgs(pb, q, k, v, dout, lse, delta, cu_q, cu_k, alibi, stride_alibi, softmax_scale)
    if atomic_dq(deterministic, learnable_sink is not None):
        _dkdv_atomic_dq(args, dq, dk, dv)
        return dq, dk, dv, None
    _dkdv(args, dk, dv, "dkdv", hk0=0, n_hk=pb.nheads_k)
    dsink = _dq(args, dq, learnable_sink)
    return dq, dk, dv, dsink


@dataclass(frozen=True)
class _BwdArgs:
    pb: _Problem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    alibi: torch.Tensor
    stride_alibi: int
    softmax_scale: float

    def common(self) -> tuple:
        pb = self.pb
        return (pb.seqlen_q, pb.seqlen_k, pb.seqlen_q, pb.seqlen_k, *pb.scalars, self.softmax_scale)

    @property
    def block_d(self) -> int:
        return max(self.pb.flags["BLOCK_D"], self.pb.flags["BLOCK_DV"])


def _dkdv(a: _BwdArgs, dk, dv, kernel: str, hk0: int, n_hk: int, acc=None):
    """The dK/dV kernel over kv heads [hk0, hk0 + n_hk); with acc (float32, q's layout with the chunk's
    query heads and BLOCK_D columns) it also adds dS K into acc."""
    pb, q = a.pb, a.q
    cfg = tile_config(kernel, a.block_d, q.device, pb.longest)
    use_tma, descs = pb.descriptors(cfg, cfg.block_m, q, a.dout)
    dq_tma = acc is not None and tma.device_ok(acc) and tma.enabled()
    acc_desc = tma.descriptor(acc if not pb.varlen else acc.unsqueeze(0), cfg.block_m) if dq_tma else None
    attn_bwd_dkdv_kernel[(host.cdiv(pb.seqlen_k, cfg.block_n), pb.batch * n_hk)](
        q, a.k, a.v, a.dout, a.lse, a.delta, dk, dv, a.cu_q, a.cu_k, a.alibi, *descs,
        acc if acc is not None else a.lse, acc_desc,
        *pb.rows(q), *pb.rows(a.k), *pb.rows(a.v), *pb.rows(a.dout), *pb.rows(dk), *pb.rows(dv),
        *pb.lse_strides(a.lse), a.stride_alibi, *(pb.rows(acc) if acc is not None else (0, 0, 0)),
        pb.nheads, n_hk, hk0, *a.common(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_TMA=use_tma, ATOMIC_DQ=acc is not None, DQ_TMA=dq_tma,
        **pb.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _dkdv_atomic_dq(a: _BwdArgs, dq, dk, dv):
    """dK/dV and, by float32 atomics in the same kernel, dQ: kv heads in chunks whose accumulator fits
    _DQ_ACC_BYTES, each chunk's accumulator then scaled into dq."""
    pb = a.pb
    group, block_d = pb.flags["GROUP"], pb.flags["BLOCK_D"]
    rows = a.q.shape[:-2]  # (b, sq) or (total_q,)
    per_kv_head = math.prod(rows) * group * block_d * 4
    chunk = max(1, min(pb.nheads_k, _DQ_ACC_BYTES // per_kv_head))
    acc_all = torch.empty((*rows, chunk * group, block_d), dtype=torch.float32, device=a.q.device)
    for hk0 in range(0, pb.nheads_k, chunk):
        n_hk = min(chunk, pb.nheads_k - hk0)
        acc = acc_all[..., : n_hk * group, :]
        acc.zero_()
        _dkdv(a, dk, dv, "dkdv_atomic", hk0, n_hk, acc)
        dq_part = dq[..., hk0 * group:(hk0 + n_hk) * group, :]
        n_rows, batch = (dq.shape[0], 1) if pb.varlen else (pb.seqlen_q, pb.batch)
        conv_m = 64 if a.q.device.type == "cuda" else 32
        dq_from_acc_kernel[(host.cdiv(n_rows, conv_m), batch * n_hk * group)](
            acc, dq_part, *pb.rows(acc), *pb.rows(dq_part), n_hk * group, n_rows, a.softmax_scale,
            HEAD_DIM=pb.d, BLOCK_D=block_d, BLOCK_M=conv_m,
        )


def _dq(a: _BwdArgs, dq, learnable_sink):
    """The dQ kernel (recomputes S and dP per tile); returns dsink ((h,) float32) or None."""
    pb, q = a.pb, a.q
    has_sink = learnable_sink is not None
    # per-row shares of the sink gradient, written by the dQ kernel (which has P and dP in fp32)
    dsink_rows = torch.zeros_like(a.lse) if has_sink else a.lse
    cfg = tile_config("dq", a.block_d, q.device, pb.longest)
    use_tma, descs = pb.descriptors(cfg, cfg.block_n, a.k, a.v)
    attn_bwd_dq_kernel[(host.cdiv(pb.seqlen_q, cfg.block_m), pb.batch * pb.nheads)](
        q, a.k, a.v, a.dout, a.lse, a.delta, dq, a.cu_q, a.cu_k, a.alibi, learnable_sink if has_sink else q,
        dsink_rows, *descs,
        *pb.rows(q), *pb.rows(a.k), *pb.rows(a.v), *pb.rows(a.dout), *pb.rows(dq),
        *pb.lse_strides(a.lse), a.stride_alibi, pb.nheads, *a.common(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SINK=has_sink, USE_TMA=use_tma, **pb.flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # lse is (h, total) in varlen, (b, h, sq) otherwise: sum everything but the head axis
    return dsink_rows.sum(1 if pb.varlen else (0, 2)) if has_sink else None
