"""Standard (materialising) attention, counted tensor by tensor, and the paper's asymptotic formulas.

Standard attention is written as a short program of kernel launches over named tensors. Running the program
gives the DRAM bytes (each launch reads its inputs and writes its outputs once: these kernels stream, so L2
reuse inside a launch does not change DRAM traffic) and the peak extra memory (allocations minus frees, in
order, as torch's caching allocator sees them).

Two recipes:
- "paper": FlashAttention paper Algorithm 0 and its backward: S and P written and read back in the input
  dtype.
- "naive": what torch executes for our `naive` benchmark provider (flashattn.bench.providers.naive), on
  contiguous (b, h, s, d) leaves, differentiated with torch.autograd.grad:
      k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)   # GQA only; the backward sums them back
      s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)         # (b, h, sq, sk) bf16, scaled in place
      s = s.masked_fill_(drop, -inf)                                # causal only; mask precomputed
      p = torch.softmax(s.to(torch.float32), dim=-1)                # fp32 copy, fp32 P kept for the backward
      o = torch.matmul(p.to(v.dtype), v)                            # bf16 P kept for dV
  Variants: `scale="fp32"` (s.float() * scale: a separate fp32 pass), `scale="fused"` (no pass over S),
  `layout="bshd"` ((b, s, h, d) leaves: matmul copies the transposed q, k, v and dO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashattn.iomodel.estimate import H200, AttnShape, IOEstimate, Machine, combine

PASSES = ("fwd", "bwd", "fwd+bwd")


@dataclass(frozen=True)
class Op:
    """One kernel launch: reads every byte of `reads`, writes every byte of `writes`, then frees `frees`.

    An in-place launch writes into a tensor that already exists: traffic, but no allocation.
    """

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    frees: tuple[str, ...] = ()
    flops: int = 0
    inplace: bool = False


INPUTS = ("q", "k", "v", "do")


def run_program(name: str, ops: list[Op], sizes: dict[str, int], **detail) -> IOEstimate:
    """Sum the traffic of `ops`; peak extra memory is the high-water mark of what they allocate.

    Freeing a caller's input (q, k, v, dO) releases nothing. A program may free tensors it did not allocate
    (backward releasing what the forward saved); that memory is available to later allocations, so the peak is
    relative to the live memory at the start.
    """
    live = peak = 0
    parts = []
    for op in ops:
        written = sum(sizes[t] for t in op.writes)
        live += 0 if op.inplace else written
        peak = max(peak, live)
        live -= sum(sizes[t] for t in op.frees if t not in INPUTS)
        parts.append(IOEstimate(op.name, bytes_read=sum(sizes[t] for t in op.reads), bytes_written=written,
                                flops=op.flops, peak_extra_bytes=0 if op.inplace else written))
    return combine(name, parts, peak_extra_bytes=peak, kernels=len(ops), **detail)


def _paper_program(shape: AttnShape) -> tuple[list[Op], list[Op], dict[str, int]]:
    b, h, sq, sk = shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k
    d, e = shape.headdim, shape.dtype_bytes
    mm = 2 * b * h * sq * sk * d
    # The paper has no GQA: K and V are counted per query head, as if repeated.
    sizes = dict(q=b * h * sq * d * e, k=b * h * sk * d * e, v=b * h * sk * d * e, do=b * h * sq * d * e)
    sizes.update(o=sizes["q"], dq=sizes["q"], dk=sizes["k"], dv=sizes["v"])
    sizes.update({t: b * h * sq * sk * e for t in ("s", "p", "dp", "ds")})
    fwd = [
        Op("S = QK^T", ("q", "k"), ("s",), flops=mm),
        Op("P = softmax(S)", ("s",), ("p",), frees=("s",)),
        Op("O = PV", ("p", "v"), ("o",), flops=mm),
    ]
    bwd = [
        Op("dV = P^T dO", ("p", "do"), ("dv",), flops=mm),
        Op("dP = dO V^T", ("do", "v"), ("dp",), flops=mm),
        Op("dS = P*(dP - rowsum(dP*P))", ("p", "dp"), ("ds",), frees=("p", "dp")),
        Op("dQ = dS K", ("ds", "k"), ("dq",), flops=mm),
        Op("dK = dS^T Q", ("ds", "q"), ("dk",), frees=("ds",), flops=mm),
    ]
    return fwd, bwd, sizes


SCALES = ("inplace", "fp32", "fused")
LAYOUTS = ("bhsd", "bshd")


def _naive_program(shape: AttnShape, *, scale: str, layout: str,
                   machine: Machine) -> tuple[list[Op], list[Op], dict[str, int]]:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    b, h, hk, sq, sk, d, e = (shape.batch, shape.nheads, shape.nheads_k, shape.seqlen_q, shape.seqlen_k,
                              shape.headdim, shape.dtype_bytes)
    group, causal = shape.group, shape.causal
    mm = 2 * b * h * sq * sk * d
    n = b * h * sq * sk
    q_bytes, kv_bytes, kvx_bytes = b * h * sq * d * e, b * hk * sk * d * e, b * h * sk * d * e
    sizes = {name: q_bytes for name in ("q", "do", "o", "dq")}
    sizes.update({name: kv_bytes for name in ("k", "v", "dk", "dv")})
    # An elementwise kernel broadcasting the (sq, sk) mask over b*h re-reads it from DRAM once it outgrows L2.
    sizes["mask"] = sq * sk if sq * sk <= machine.l2_effective else b * h * sq * sk

    def new(name: str, nbytes: int) -> str:
        sizes[name] = nbytes
        return name

    fwd: list[Op] = []
    bwd: list[Op] = []
    q, k, v, do = "q", "k", "v", "do"
    if layout == "bshd":
        fwd += [Op(f"copy {x}", (x,), (new(f"{x}c", sizes[x]),)) for x in (q, k, v)]
        bwd.append(Op("copy dO", (do,), (new("doc", q_bytes),)))
        q, k, v, do = "qc", "kc", "vc", "doc"
    if group > 1:
        fwd += [Op(f"repeat_interleave {x[0]}", (x,), (new(f"{x[0]}x", kvx_bytes),), frees=(x,))
                for x in (k, v)]
        k, v = "kx", "vx"

    fwd.append(Op("S = QK^T", (q, k), (new("s16", n * e),), flops=mm))
    # The provider's variable holds the input-dtype scores until it returns; later temporaries die when used.
    steps = {"inplace": ("scale", "mask", "cast"), "fp32": ("cast", "scale", "mask"),
             "fused": ("mask", "cast")}
    s, undo = "s16", []
    for step in steps[scale]:
        if step == "mask" and not causal:
            continue
        if step == "cast":
            fwd.append(Op("S.to(fp32)", (s,), (new("s32", n * 4),), frees=() if s == "s16" else (s,)))
            s = "s32"
        elif step == "scale" and scale == "inplace":
            fwd.append(Op("S.mul_(scale)", (s,), (s,), inplace=True))
        elif step == "scale":
            fwd.append(Op("S * scale", (s,), (new("s32s", n * 4),), frees=(s,)))
            s = "s32s"
        else:
            fwd.append(Op("S.masked_fill_(mask)", (s, "mask"), (s,), inplace=True))
        undo.append(step)
    fwd.append(Op("softmax", (s,), (new("p32", n * 4),), frees=() if s == "s16" else (s,)))
    p = "p32"
    nan_rows = causal and sk < sq  # the provider zeroes the rows that see no key
    if nan_rows:
        fwd.append(Op("P.nan_to_num()", (p,), (new("p32n", n * 4),)))
        p = "p32n"
    fwd += [
        Op("P.to(bf16)", (p,), (new("p16", n * e),), frees=(p,) if nan_rows else ()),
        Op("O = PV", ("p16", v), ("o",), frees=("s16",), flops=mm),
    ]

    dv = new("dvx", kvx_bytes) if group > 1 else "dv"
    bwd += [
        Op("dP = dO V^T", (do, v), (new("dp16", n * e),), flops=mm),
        Op("dV = P^T dO", ("p16", do), (dv,), frees=("p16", v, do), flops=mm),
        Op("dP.to(fp32)", ("dp16",), (new("dp32", n * 4),), frees=("dp16",)),
    ]
    g = "dp32"
    if nan_rows:
        bwd.append(Op("nan_to_num backward", (g, "p32"), (new("dp32n", n * 4),), frees=(g,)))
        g = "dp32n"
    bwd.append(Op("softmax backward", (g, "p32"), (new("ds32", n * 4),), frees=(g, "p32")))
    g, g_bytes = "ds32", 4
    for i, step in enumerate(reversed(undo)):
        if step == "cast":
            name, g_bytes, reads = "dS.to(bf16)", e, (g,)
        elif step == "scale":
            name, reads = "dS * scale", (g,)
        else:
            name, reads = "masked_fill backward", (g, "mask")
        out = new(f"ds{i}", n * g_bytes)
        bwd.append(Op(name, reads, (out,), frees=(g,)))
        g = out
    dk = new("dkx", kvx_bytes) if group > 1 else "dk"
    bwd += [
        Op("dQ = dS K", (g, k), ("dq",), flops=mm),
        Op("dK = dS^T Q", (g, q), (dk,), frees=(g, q, k), flops=mm),
    ]
    if group > 1:
        bwd += [Op("sum dK over group", ("dkx",), ("dk",), frees=("dkx",)),
                Op("sum dV over group", ("dvx",), ("dv",), frees=("dvx",))]
    return fwd, bwd, sizes


def standard_attention(
    shape: AttnShape,
    pass_: str = "fwd+bwd",
    *,
    recipe: str = "naive",
    scale: str = "inplace",
    layout: str = "bhsd",
    machine: Machine = H200,
) -> IOEstimate:
    """Standard attention's traffic, FLOPs and peak extra memory for `pass_` in {"fwd", "bwd", "fwd+bwd"}.

    The whole score matrix is computed whatever the mask (that is what these recipes do), so causal adds
    only the masking passes of the naive recipe. `scale` and `layout` select a naive variant (module
    docstring); the defaults are our provider.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    if recipe == "paper":
        fwd, bwd, sizes = _paper_program(shape)
    elif recipe == "naive":
        fwd, bwd, sizes = _naive_program(shape, scale=scale, layout=layout, machine=machine)
    else:
        raise ValueError(f"recipe must be 'paper' or 'naive', got {recipe!r}")
    ops = {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]
    conv = shape.convention_flops()
    est = run_program(f"standard[{recipe}] {pass_}", ops, sizes, recipe=recipe)
    convention = {"fwd": conv, "bwd": round(2.5 * conv), "fwd+bwd": round(3.5 * conv)}[pass_]
    return combine(est.name, est.parts, peak_extra_bytes=est.peak_extra_bytes, flops_convention=convention,
                   **est.detail)


def standard_attention_io(N: int, d: int, *, elem_bytes: int = 2) -> IOEstimate:
    """The paper's count for standard attention's forward (Algorithm 0), one head: Theta(N·d + N^2).

    Reads Q, K (2Nd), S (N^2), P (N^2), V (Nd); writes S, P (2N^2) and O (Nd): 4Nd + 4N^2 elements in all.
    """
    reads, writes = 3 * N * d + 2 * N * N, N * d + 2 * N * N
    return IOEstimate("standard (paper)", bytes_read=reads * elem_bytes, bytes_written=writes * elem_bytes,
                      flops=4 * N * N * d, flops_convention=4 * N * N * d,
                      peak_extra_bytes=(2 * N * N + N * d) * elem_bytes,
                      detail=dict(reads_elements=reads, writes_elements=writes))


def tiled_attention_io(N: int, d: int, M: int, *, elem_bytes: int = 2,
                       loop_order: str = "kv_outer") -> IOEstimate:
    """HBM traffic of tiled attention with on-chip memory of M elements (the paper's unit), one head.

    "kv_outer" is the paper's Algorithm 1 exactly: block sizes B_c = ceil(M/4d), B_r = min(B_c, d); the outer
    loop over T_c = ceil(N/B_c) K/V blocks reads K and V once but passes over Q, O, l, m T_c times:
        reads  = 2Nd + T_c (2Nd + 2N),   writes = (T_c + 1)(Nd + 2N)   (O, l, m initialised in HBM first)
    which is Theta(N^2 d^2 / M) since T_c ~ 4Nd/M (Theorem 2).
    "q_outer" is our kernels' (FlashAttention-2) loop order: B_r = ceil(M/4d) query rows stay on chip and K/V
    is streamed T_r = ceil(N/B_r) times: reads = Nd + 2Nd·T_r, writes = Nd + N (O and LSE). Same law.
    `detail["passes"]` is T_c or T_r: doubling M halves it.
    """
    if not 0 < d <= M:
        raise ValueError(f"on-chip memory M={M} elements must hold at least one head-dim row (d={d})")
    b_c = math.ceil(M / (4 * d))
    if loop_order == "kv_outer":
        b_r = min(b_c, d)
        passes = math.ceil(N / b_c)
        reads = 2 * N * d + passes * (2 * N * d + 2 * N)
        writes = (passes + 1) * (N * d + 2 * N)
    elif loop_order == "q_outer":
        b_r = b_c
        passes = math.ceil(N / b_r)
        reads = N * d + passes * 2 * N * d
        writes = N * d + N
    else:
        raise ValueError(f"loop_order must be 'kv_outer' or 'q_outer', got {loop_order!r}")
    return IOEstimate(f"tiled (M={M})", bytes_read=reads * elem_bytes, bytes_written=writes * elem_bytes,
                      flops=4 * N * N * d, flops_convention=4 * N * N * d,
                      peak_extra_bytes=N * d * elem_bytes,
                      detail=dict(block_r=b_r, block_c=b_c, passes=passes, reads_elements=reads,
                                  writes_elements=writes))
