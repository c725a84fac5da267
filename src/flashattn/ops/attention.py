"""Launchers for the Triton attention kernels: allocate outputs, check strides, pick tiles and grid.

Pure functions (tensors in, tensors out, no autograd): tests, benchmarks and the CLI call them directly.
Padded layout: q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv), lse (b, h, sq).
Varlen layout (cu_seqlens_q/k given): q (total_q, h, d), k/v (total_k, h_k, ·), lse (h, total_q).
Any strides with a contiguous last dim.

Launch order: grids are 1D, and under a window (causal included), where tiles differ in work, heads run in
groups heaviest tile first (kernels/common.py, grouped_program); `FLASHATTN_SCHEDULE=head-major` restores
plain head-by-head order (A/B timing).

Host time: at short lengths a call's Python outlasts its kernels. Calls that take the Gluon kernels keep
what they derive (the problem, the route, tiles, the launch's arguments but its tensors, the plans) per
signature: shapes, strides, dtypes, device, the options and every switch read so far (_env.snapshot), with
16-byte aligned tensors. A repeated signature only allocates its outputs, builds its descriptors and
launches (the forward's launcher: 49 -> 16 us of host time, NOTES v38); other calls take the full path.
"""

import math
from dataclasses import dataclass

import torch

from flashattn import _env
from flashattn.kernels.attn_bwd import attn_bwd_kernel, attn_bwd_preprocess_kernel
from flashattn.kernels.attn_fwd import attn_fwd_kernel
from flashattn.ops import attention_ws, host, tma
from flashattn.ops import launch as launch_mod
from flashattn.ops.configs import TileConfig, tile_config
from flashattn.ops.launch import Bound, launch

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels take exp2, so the softmax scale absorbs it
_INT32_MAX = 2**31 - 1
# bytes of streamed tiles (K/V, or Q/dO in the dK/dV role) that one group of heads may keep live in L2
# (50 MiB on the H200): interleaving every head lost 4-9% to L2 misses in the block-sparse kernels (NOTES v10)
_L2_BUDGET = 16 << 20
# call signatures whose derivations the Gluon launchers keep (ops/attention_ws.py, _Prepared; 5-8 KB each with
# its key): a model has a few per layer shape, and a cache past this many is emptied rather than grown
# (lengths that vary from batch to batch would otherwise add an entry each)
_CACHED_SIGNATURES = 256
_forward_cache: dict = {}
_backward_cache: dict = {}


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

    def lpt_group(self, n_bh: int, stream_bytes: int) -> int:
        """Heads per group of grouped_program's order, each streaming stream_bytes: 1 (head-major) when
        every tile of a head does the same work (no window), else as many as fit the L2 budget."""
        uneven = self.flags["WINDOW_LEFT"] or self.flags["WINDOW_RIGHT"]
        if not uneven or _env.get("FLASHATTN_SCHEDULE") == "head-major":
            return 1
        return max(1, min(n_bh, _L2_BUDGET // max(stream_bytes, 1)))

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


def _cacheable(q, streamed: tuple, alibi_slopes, learnable_sink, cu_seqlens_q, softmax_scale,
               window_size) -> bool:
    """Whether a call's derivations are cached: it may take a Gluon kernel (no tensor option, a head dim it
    takes, 16-byte aligned streamed tensors), it launches through plans, and its options key a dict (a
    float scale: an int one would specialise otherwise; a tuple window)."""
    if not (launch_mod.direct(q) and alibi_slopes is None and learnable_sink is None and cu_seqlens_q is None
            and type(softmax_scale) is float and type(window_size) is tuple
            and attention_ws.takes(q.shape[-1])):
        return False
    pointers = 0
    for t in streamed:
        pointers |= t.data_ptr()
    return pointers % 16 == 0


def _remember(cache: dict, key: tuple, entry: tuple) -> None:
    if len(cache) >= _CACHED_SIGNATURES:
        cache.clear()
    cache[key] = entry


def attention_forward(q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0, learnable_sink=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """out (like q, with v's head dim, q's dtype) and lse float32 natural log (+inf: the row saw no key)."""
    key = None
    if _cacheable(q, (q, k, v), alibi_slopes, learnable_sink, cu_seqlens_q, softmax_scale, window_size):
        # everything down to the launch's arguments but the tensors depends on these
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, softmax_scale, causal, window_size, softcap, dropout_p, rng_seed, rng_offset,
               _env.snapshot())
        hit = _forward_cache.get(key)
        if hit is not None:
            pb, group, out_shape, lse_shape, prepared = hit
            # sizes unpacked: torch.empty parses separate ints faster than a tuple (~0.6 us), or a Size (~1.3)
            out = torch.empty(*out_shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(*lse_shape, dtype=torch.float32, device=q.device)
            attention_ws.forward(pb, q, k, v, out, lse, group, prepared)
            return out, lse
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out_shape = (*q.shape[:-1], pb.dv)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse_shape = (pb.nheads, q.shape[0]) if pb.varlen else (pb.batch, pb.nheads, pb.seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    n_bh = pb.batch * pb.nheads
    group = pb.lpt_group(n_bh, pb.seqlen_k * (pb.d + pb.dv) * k.element_size() // pb.flags["GROUP"])
    if attention_ws.eligible(pb, q, k, v, learnable_sink):
        prepared = attention_ws.forward(pb, q, k, v, out, lse, group)
        if key is not None:
            _remember(_forward_cache, key, (pb, group, out_shape, lse_shape, prepared))
        return out, lse
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    cfg = tile_config("fwd", max(pb.flags["BLOCK_D"], pb.flags["BLOCK_DV"]), q.device, pb.longest)
    use_tma, descs = pb.descriptors(cfg, cfg.block_n, k, v)
    launch(
        attn_fwd_kernel, (host.cdiv(pb.seqlen_q, cfg.block_m) * n_bh,),
        q, k, v, out, lse,
        cu_seqlens_q if pb.varlen else q, cu_seqlens_k if pb.varlen else q, alibi,
        learnable_sink if learnable_sink is not None else q, *descs,
        *pb.rows(q), *pb.rows(k), *pb.rows(v), *pb.rows(out), *pb.lse_strides(lse), stride_alibi,
        pb.nheads, pb.seqlen_q, pb.seqlen_k, pb.seqlen_q, pb.seqlen_k, *pb.scalars, n_bh, group,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SINK=learnable_sink is not None, USE_TMA=use_tma,
        **pb.flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0,
                       learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, deterministic=False):
    """dq, dk, dv shaped like q, k, v (dk/dv summed over each GQA group), and dsink ((h,) float32 or None).

    Plain d = 64/128 calls take the Gluon backward (ops/attention_ws.py), whose dQ reduce-adds vary in order;
    with `deterministic` (or any feature) the Triton programs run: no atomics, every gradient element written
    by one program.
    """
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    key = None
    if not deterministic and _cacheable(q, (q, k, v, dout), alibi_slopes, learnable_sink, cu_seqlens_q,
                                        softmax_scale, window_size):
        key = (dout.shape, q.shape, k.shape, v.shape, out.shape, lse.shape, dout.stride(), q.stride(),
               k.stride(), v.stride(), out.stride(), lse.stride(), dout.dtype, q.dtype, k.dtype, v.dtype,
               out.dtype, lse.dtype, q.device, softmax_scale, causal, window_size, softcap, dropout_p,
               rng_seed, rng_offset, _env.snapshot())
        hit = _backward_cache.get(key)
        if hit is not None:
            pb, kv_group, preprocess, pre_args, prepared = hit
            dq = torch.empty(*q.shape, dtype=q.dtype, device=q.device)  # unpacked: as attention_forward's
            dk = torch.empty(*k.shape, dtype=k.dtype, device=k.device)
            dv = torch.empty(*v.shape, dtype=v.dtype, device=v.device)
            stats = attention_ws.backward_stats(pb, q.device)
            dq_acc = torch.empty(*q.shape, dtype=torch.float32, device=q.device)
            preprocess((out, dout, stats[1], q, dq_acc, lse, stats[0], *pre_args))
            attention_ws.backward(pb, q, k, v, dout, stats, dq_acc, dq, dk, dv, softmax_scale, kv_group,
                                  prepared)
            return dq, dk, dv, None
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu_q = cu_seqlens_q if pb.varlen else q
    cu_k = cu_seqlens_k if pb.varlen else q
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    lse_strides = pb.lse_strides(lse)
    flags = pb.flags
    block_d = max(flags["BLOCK_D"], flags["BLOCK_DV"])

    # the Gluon backward adds dQ into a float32 buffer and reads D with the LSE in base 2 from padded planes
    # (attention_ws.backward_stats): the preprocess zeroes the one and fills the other (no launch of its own)
    gluon = attention_ws.bwd_eligible(pb, q, k, v, dout, learnable_sink, deterministic)
    if gluon:
        stats = attention_ws.backward_stats(pb, q.device)
        delta, lse2, dq_acc = stats[1], stats[0], torch.empty(q.shape, dtype=torch.float32, device=q.device)
        delta_rows = stats.shape[-1]
        delta_strides = (pb.nheads * delta_rows, delta_rows)
    else:
        delta = lse2 = dq_acc = torch.empty_like(lse)
        delta_rows, delta_strides = pb.seqlen_q, lse_strides
    pre_m = 64 if q.device.type == "cuda" else 32
    preprocess = Bound(
        attn_bwd_preprocess_kernel, (host.cdiv(pb.seqlen_q, pre_m), pb.batch * pb.nheads),
        dict(HEAD_DIM_V=pb.dv, BLOCK_DV=flags["BLOCK_DV"], BLOCK_M=pre_m, IS_VARLEN=pb.varlen, GLUON=gluon),
    )
    pre_args = (*pb.rows(out), *pb.rows(dout), *lse_strides, *delta_strides, pb.nheads, pb.seqlen_q,
                delta_rows)
    preprocess((out, dout, delta, cu_q, dq_acc, lse, lse2, *pre_args))
    has_sink = learnable_sink is not None
    # per-row shares of the sink gradient, written by the dQ role (which has P and dP in fp32)
    dsink_rows = torch.zeros_like(lse) if has_sink else lse
    row_bytes = (pb.d + pb.dv) * q.element_size()
    kv_group = pb.lpt_group(pb.batch * pb.nheads_k, pb.seqlen_q * row_bytes * flags["GROUP"])
    if gluon:
        prepared = attention_ws.backward(pb, q, k, v, dout, stats, dq_acc, dq, dk, dv, softmax_scale,
                                         kv_group)
        if key is not None:
            _remember(_backward_cache, key, (pb, kv_group, preprocess, pre_args, prepared))
        return dq, dk, dv, None
    kv_cfg = tile_config("dkdv", block_d, q.device, pb.longest)
    q_cfg = tile_config("dq", block_d, q.device, pb.longest)
    # the dK/dV role loads Q/dO through pointers (kernels/attn_bwd.py says why); the dQ role streams K/V
    q_tma, (k_desc, v_desc) = pb.descriptors(q_cfg, q_cfg.block_n, k, v)
    q_group = pb.lpt_group(pb.batch * pb.nheads, pb.seqlen_k * row_bytes // flags["GROUP"])
    roles = (
        (host.cdiv(pb.seqlen_k, kv_cfg.block_n) * pb.batch * pb.nheads_k, True, kv_cfg, False, (None, None)),
        (host.cdiv(pb.seqlen_q, q_cfg.block_m) * pb.batch * pb.nheads, False, q_cfg, q_tma, (k_desc, v_desc)),
    )
    for n_programs, role_dkdv, cfg, use_tma, descs in roles:
        launch(
            attn_bwd_kernel, (n_programs,),
            q, k, v, dout, lse, delta, dq, dk, dv, cu_q, cu_k, alibi, learnable_sink if has_sink else q,
            dsink_rows, *descs,
            *pb.rows(q), *pb.rows(k), *pb.rows(v), *pb.rows(dout), *pb.rows(dq), *pb.rows(dk), *pb.rows(dv),
            *lse_strides, stride_alibi, pb.nheads, pb.nheads_k, pb.seqlen_q, pb.seqlen_k, pb.seqlen_q,
            pb.seqlen_k, *pb.scalars, softmax_scale, pb.batch, kv_group, q_group,
            DKDV_BLOCK_M=kv_cfg.block_m, DKDV_BLOCK_N=kv_cfg.block_n, DQ_BLOCK_M=q_cfg.block_m,
            DQ_BLOCK_N=q_cfg.block_n, ROLE_DKDV=role_dkdv, HAS_SINK=has_sink, USE_TMA=use_tma,
            **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
        )
    # lse is (h, total) in varlen, (b, h, sq) otherwise: sum everything but the head axis
    dsink = dsink_rows.sum(1 if pb.varlen else (0, 2)) if has_sink else None
    return dq, dk, dv, dsink
