"""Launchers for the warp-specialised Hopper kernels: the forward (kernels/attn_fwd_ws.py) and the backward
(kernels/attn_bwd_ws.py).

The forward takes the plain case only: padded layout, fp16/bf16, d = dv = 128 (and 64, see `takes`), no
window other than causal, no softcap, ALiBi, dropout or sink; q, k, v and out must suit TMA descriptors
(16-byte aligned base and strides). Everything else, and `FLASHATTN_WS=0` (A/B timing), keeps the Triton
forward. Measured on the H200 beside the Triton forward in the same run (benchmarks/NOTES.md v17, v23):
d = 128 +24-37% without a mask, causal +20-25% at 1K-2K (GPU time, CUDA graphs) and +20-32% from 4K; d = 64
+1-14% without a mask and +3-4% causal at 1K (GPU time); causal from 2K it was 1-5% behind until three
consumer warpgroups of 64 rows (192-row tiles, d = 64 past 1K, NOTES v33): -1% to +3.5% at 2K, +4-5% at 4K.

Grid: persistent (one program per SM); after the first, each program takes its next query tile from a
shared counter, so under a causal mask the programs' totals even out (a static walk with the grid's stride
left the busiest 15% over the mean, NOTES v23); the kernel's last program zeroes the counter again, so one
per stream serves every call (`_tile_counter`). `FLASHATTN_WS_GRID=tiles` runs one program per tile
instead (A/B timing).

The backward (FA3's: dQ by TMA reduce-adds into a float32 buffer, 5 matmuls per tile pair instead of the
Triton backward's 7) takes the same plain calls at d = 64 and 128, causal or not: +8-24% over the Triton
backward at d = 128 (benchmarks/NOTES.md v20), +2% to +19% at d = 64 with its deferred dQ (v24); one run
each. Since v41 it reads each step's LSE and D from shared memory (+20% at d = 128 causal, +8% without the
mask, +2-6% at d = 64), and since v42 the d = 64 backward without a mask takes 128-row steps (+3-4%). It
never runs with deterministic=True (the reduce order varies, as with flash_attn's atomic dQ), nor once its
float32 dQ buffer would pass _DQ_BUFFER_CAP; FLASHATTN_WS_BWD=0 turns it off (A/B timing).
"""

import functools
from typing import NamedTuple

import torch

from flashattn import _env
from flashattn.ops import host, merge, tma
from flashattn.ops.configs import tile_config
from flashattn.ops.launch import Bound

_HALF_M = 64  # query rows per consumer warpgroup (the kernel's HALF_M)
# registers per thread for the kernel's 12 warps (two consumer warpgroups, the loader's): 168 x 384 fills the
# 64K-register file; the partitions then take 240 / 240 / 24 (gl.warp_specialize's worker_num_regs)
_MAXNREG = 168
_MAXNREG_THREE = 128  # 16 warps (three consumer warpgroups and the loader's) x 128 fill the register file
# the backward's float32 dQ buffer beyond which the Triton backward runs instead: the 128K-token memory target
# (2.2 GiB for forward + backward, b=1, h=16, d=128) leaves no room for a 1 GiB buffer
_DQ_BUFFER_CAP = 512 << 20


def takes(d: int) -> bool:
    """The shape side of the rule (features and layout aside; the IO model asks it too): d = 64 or 128, any
    length, causal or not; FLASHATTN_WS=0 sends every call to the Triton forward. Causal d = 64 from 2K took
    the Triton forward until three consumer warpgroups (NOTES v33): -1% to +3.5% against it at 2K, +4-5% at
    4K."""
    return d in (64, 128) and _env.get("FLASHATTN_WS", "1") != "0"


def _plain(pb, learnable_sink) -> bool:
    """The call has no feature the Gluon kernels lack: padded layout, no window but causal, no softcap, ALiBi,
    dropout or sink, d = dv."""
    f = pb.flags
    featureless = not (f["IS_VARLEN"] or f["WINDOW_LEFT"] or f["HAS_SOFTCAP"] or f["HAS_ALIBI"]
                       or f["HAS_DROPOUT"])
    # a right window other than causal's 0 is a band, which these kernels do not mask
    causal_only = not f["WINDOW_RIGHT"] or pb.scalars[4] == 0
    return featureless and causal_only and learnable_sink is None and pb.d == pb.dv


@functools.lru_cache(maxsize=32)
def _shared_layout(rows: int, cols: int, dtype_name: str):
    # cached: building it costs ~15 us of host time, and every launch asks for 4-7 of them
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, cols], getattr(gl, dtype_name))


@functools.cache
def _descriptor_type():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    class PrecheckedDescriptor(TensorDescriptor):
        """Gluon's host descriptor without its constructor's checks (3 of the ~5 us each costs, 4-7 per
        launch): the launchers hand it tensors that tma.usable passed or that they allocated contiguous."""

        @classmethod
        def of(cls, base, shape, strides, block_shape, layout):
            # the fields set directly: the dataclass __init__ and its __post_init__ cost ~0.3 us more
            # (tests/test_launch_cache.py checks the fields against the constructor's)
            d = object.__new__(cls)
            d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
                base, shape, strides, block_shape, layout, "zero")
            return d

    return PrecheckedDescriptor


def _descriptor_spec(t, rows: int, cols: int, dtype_name: str | None = None) -> tuple:
    """What a TMA descriptor over a (batch, seqlen, heads, d) tensor like t with (1, rows, 1, cols) blocks in
    the wgmma-ready shared layout takes besides t; dtype_name: the Gluon element type (default: t's 16-bit
    type). The same for every tensor of t's shape, strides and dtype: a prepared launch keeps it."""
    if dtype_name is None:
        dtype_name = "float16" if t.dtype == torch.float16 else "bfloat16"
    return list(t.shape), list(t.stride()), [1, rows, 1, cols], _shared_layout(rows, cols, dtype_name)


class _Prepared(NamedTuple):
    """A launch of a Gluon kernel with all but its per-call tensors derived: what `forward` and `backward`
    return, and take back (ops/attention.py keeps it per call signature) to skip the derivations for
    tensors of the same shapes, strides, dtypes and alignment under the same switches."""

    launch: Bound
    specs: tuple  # _descriptor_spec of each descriptor argument, in order
    args: tuple  # the arguments between the per-call tensors that follow the descriptors

    def descriptors(self, *tensors) -> list:
        make = _descriptor_type().of
        return [make(t, *spec) for t, spec in zip(tensors, self.specs, strict=True)]


def eligible(pb, q, k, v, learnable_sink) -> bool:
    return (_plain(pb, learnable_sink) and takes(pb.d)
            and tma.usable(q, k, v, varlen=False))


def programs(n_work: int, device: torch.device) -> int:
    """Grid size for n_work query tiles: persistent (one program per SM, as one fills an SM's registers; each
    takes its next tile from a shared counter), or one program per tile with FLASHATTN_WS_GRID=tiles."""
    persistent = _env.get("FLASHATTN_WS_GRID", "persistent") != "tiles"
    return min(n_work, merge.sm_count(device)) if persistent else n_work


_counters: dict = {}


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The forward's tile counter and arrival count (int32 x 2), zero between launches: the kernel's last
    program resets them, so each stream keeps one (launches on a stream run one after another) and a call
    launches no zeroing kernel. Under CUDA graph capture every call gets a fresh zeroed pair of its own (the
    zeroing is captured): graphs may replay on several streams at once."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # CPU: the sm90 compile check
        return torch.zeros(2, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def forward_config(d: int, device: torch.device, longest: int, causal: bool = False):
    """The forward's tiles (ops/configs.py; FLASHATTN_CONFIG's fwd_ws= included), held to what the kernel
    does: steps of 128 keys (v32's half diagonal step assumes them: 64-key tiles gave wrong causal rows, and
    were 8-16% slower anyway, NOTES v36), two or three consumer warpgroups of 64 rows, a K/V ring of 2+."""
    cfg = tile_config("fwd_ws", d, device, longest, causal)
    if cfg.block_n != 128 or cfg.block_m not in (2 * _HALF_M, 3 * _HALF_M) or cfg.num_stages < 2:
        raise ValueError(
            f"FLASHATTN_CONFIG: fwd_ws={cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages} is not a "
            f"config of the Gluon forward, which takes block_m 128 or 192 (two or three consumer warpgroups "
            f"of 64 rows), block_n 128 and 2 or more stages"
        )
    return cfg


def forward(pb, q, k, v, out, lse, lpt_group: int, prepared: _Prepared | None = None) -> _Prepared:
    """Fill out and lse (attention_forward's contract) with the warp-specialised kernel; lpt_group: heads per
    group of the launch order, as the Triton forward's. prepared: what this returned for an earlier call of
    the same signature (_Prepared), skipping the derivations; returns the launch prepared."""
    if prepared is None:
        prepared = _prepare_forward(pb, q, k, v, out, lse, lpt_group)
    # the tiles past the first of each program go to whichever program asks first: a zeroed counter
    tile_counter = _tile_counter(q.device)
    prepared.launch((*prepared.descriptors(q, k, v, out), lse, *prepared.args, tile_counter))
    return prepared


def _prepare_forward(pb, q, k, v, out, lse, lpt_group: int) -> _Prepared:
    from flashattn.kernels.attn_fwd_ws import attn_fwd_ws_kernel

    causal = pb.flags["WINDOW_RIGHT"]
    cfg = forward_config(pb.d, q.device, pb.longest, causal)
    n_bh = pb.batch * pb.nheads
    n_work = host.cdiv(pb.seqlen_q, cfg.block_m) * n_bh
    # a query tile's O store completes under the next tile's first QK^T (NOTES v27);
    # FLASHATTN_FWD_DEFER_RELEASE=0 waits for it at the tile's end (A/B)
    defer_release = _env.get("FLASHATTN_FWD_DEFER_RELEASE", "1") != "0"
    # causal: a warpgroup whose rows see none of its last key tile's upper half skips it (NOTES v32);
    # FLASHATTN_FWD_HALF_DIAG=0 for the A/B
    half_diag = causal and _env.get("FLASHATTN_FWD_HALF_DIAG", "1") != "0"
    # 192-row tiles: three consumer warpgroups of 160 registers, which run their steps serially (NOTES v33)
    three = cfg.block_m == 3 * _HALF_M
    # the row max (bit 0) and the per-lane row sums (bit 1) reduced as trees, not chains: +5% with two
    # consumers at d=64 1K causal, -2 to -4% with three (NOTES v40); FLASHATTN_FWD_TREES for the A/B
    trees = int(_env.get("FLASHATTN_FWD_TREES", "0" if three else "3"))
    specs = (_descriptor_spec(q, _HALF_M, pb.d), _descriptor_spec(k, cfg.block_n, pb.d),
             _descriptor_spec(v, cfg.block_n, pb.d), _descriptor_spec(out, _HALF_M, pb.d))
    kwargs = dict(GROUP=pb.flags["GROUP"], HEAD_DIM=pb.d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  STAGES=cfg.num_stages, CAUSAL=causal, DEFER_RELEASE=defer_release, HALF_DIAG=half_diag,
                  TREES=trees, num_warps=4, maxnreg=cfg.maxnreg or (_MAXNREG_THREE if three else _MAXNREG))
    return _Prepared(
        Bound(attn_fwd_ws_kernel, (programs(n_work, q.device),), kwargs), specs,
        (lse.stride(0), lse.stride(1), pb.nheads, pb.seqlen_q, pb.seqlen_k, pb.scalars[0], n_bh, lpt_group),
    )


def takes_backward(d: int, dq_buffer_bytes: int) -> bool:
    """Whether a plain call at head dim `d` (= dv) takes the Gluon backward, by shape and switches (shared
    with the IO model, flashattn.iomodel): d = 64 or 128, a float32 dQ buffer within _DQ_BUFFER_CAP, and
    neither FLASHATTN_WS_BWD nor FLASHATTN_WS set to 0."""
    switched_on = all(_env.get(name, "1") != "0" for name in ("FLASHATTN_WS_BWD", "FLASHATTN_WS"))
    return switched_on and d in (64, 128) and dq_buffer_bytes <= _DQ_BUFFER_CAP


def bwd_eligible(pb, q, k, v, dout, learnable_sink, deterministic: bool) -> bool:
    """Whether the backward takes the Gluon kernel."""
    return (not deterministic and _plain(pb, learnable_sink) and takes_backward(pb.d, q.numel() * 4)
            and tma.usable(q, k, v, dout, varlen=False))


def backward_stats(pb, device: torch.device) -> torch.Tensor:
    """The backward kernel's per-row statistics, which the preprocess fills: (2, b·h, sq rounded up to 4)
    float32, [0] the LSE in base 2, [1] D = rowsum(dO ∘ O). The kernel's loader brings both with each (Q, dO)
    tile through one TMA copy, so a row of a plane must be 16-byte aligned: hence the padding."""
    return torch.empty(2, pb.batch * pb.nheads, -(-pb.seqlen_q // 4) * 4, dtype=torch.float32, device=device)


def backward(pb, q, k, v, dout, stats, dq_acc, dq, dk, dv, softmax_scale: float, kv_group: int,
             prepared: _Prepared | None = None) -> _Prepared:
    """Fill dq, dk and dv (attention_backward's contract) with the warp-specialised backward; stats: as
    `backward_stats`, filled; dq_acc: a zeroed float32 buffer shaped like q (contiguous), into which the
    kernel adds dQ. prepared: as `forward`'s."""
    if prepared is None:
        prepared = _prepare_backward(pb, q, k, v, dout, stats, dq_acc, dk, dv, softmax_scale, kv_group)
    prepared.launch((*prepared.descriptors(q, dout, k, v, dk, dv, dq_acc, stats), *prepared.args))
    dq.copy_(dq_acc)
    return prepared


@functools.cache
def _stats_layout():
    from triton.experimental.gluon import language as gl

    # unswizzled: the kernel reads each plane's row back as a plain vector
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def _prepare_backward(pb, q, k, v, dout, stats, dq_acc, dk, dv, softmax_scale: float,
                      kv_group: int) -> _Prepared:
    from flashattn.kernels.attn_bwd_ws import attn_bwd_ws_kernel

    causal = pb.flags["WINDOW_RIGHT"]
    cfg = tile_config("bwd_ws", pb.d, q.device, causal=causal)
    n_bhk = pb.batch * pb.nheads_k
    half_n = cfg.block_n // 2
    # d = 64 with 64-row steps (causal): each step computes the previous step's dQ (NOTES v24), whose four dSᵀ
    # buffers 128-row steps have no shared memory for; FLASHATTN_BWD_DEFER_DQ=0 for the A/B
    defer = _env.get("FLASHATTN_BWD_DEFER_DQ", "1") != "0"
    defer_dq = defer and pb.d == 64 and cfg.block_m == 64
    specs = (*(_descriptor_spec(t, cfg.block_m, pb.d) for t in (q, dout)),
             *(_descriptor_spec(t, half_n, pb.d) for t in (k, v, dk, dv)),
             _descriptor_spec(dq_acc, cfg.block_m, pb.d // 2, "float32"),
             (list(stats.shape), list(stats.stride()), [2, 1, cfg.block_m], _stats_layout()))
    kwargs = dict(GROUP=pb.flags["GROUP"], HEAD_DIM=pb.d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  STAGES=cfg.num_stages, CAUSAL=causal, DEFER_DQ=defer_dq, num_warps=4,
                  maxnreg=cfg.maxnreg or _MAXNREG)
    return _Prepared(
        Bound(attn_bwd_ws_kernel, (host.cdiv(pb.seqlen_k, cfg.block_n) * n_bhk,), kwargs), specs,
        (pb.nheads_k, pb.seqlen_q, pb.seqlen_k, pb.scalars[0], softmax_scale, n_bhk, kv_group),
    )
